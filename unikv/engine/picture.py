"""A text picture of the unified pool: which bytes hold whose live pages.

    |####FFFFF..FFF          SSS.SS|   # sink, F/S/... live pages of a sub-pool
                                       (first letter of its name, upper case),
                                       . a hole inside a band, space = unclaimed

Each column covers ``total_bytes / width`` bytes and shows what holds most of
them. Read from the allocator's host mirrors (no device access).
"""

from __future__ import annotations

import numpy as np

from unikv.allocator.subpool import FREE, LIVE, PENDING

SINK, HOLE, EMPTY = "#", ".", " "


def pool_picture(pool, alloc, width: int = 64) -> str:
    """One line of ``width`` columns; see the module docstring."""
    total = pool.total_bytes
    edges = np.linspace(0, total, width + 1)
    owner = np.zeros((width, len(pool.subpools) + 3))  # bytes per (column, what)
    labels = [SINK, HOLE, EMPTY]
    _add(owner, edges, 0, 0, pool.sink_bytes)
    for i, name in enumerate(pool.subpools):
        labels.append(name[0].upper())
        sub = alloc.subpool(name)
        for page in np.flatnonzero((sub.state == LIVE) | (sub.state == PENDING)):
            _add(owner, edges, 3 + i, page * sub.page_bytes, (page + 1) * sub.page_bytes)
        for page in np.flatnonzero(sub.state == FREE):
            _add(owner, edges, 1, page * sub.page_bytes, (page + 1) * sub.page_bytes)
    width_bytes = np.diff(edges)
    owner[:, 2] = np.maximum(width_bytes - owner.sum(axis=1), 0)
    return "|" + "".join(labels[j] for j in owner.argmax(axis=1)) + "|"


def _add(owner: np.ndarray, edges: np.ndarray, what: int, lo: float, hi: float) -> None:
    """Add the overlap of byte range [lo, hi) with every column to ``owner[:, what]``."""
    first = max(int(np.searchsorted(edges, lo, side="right")) - 1, 0)
    last = min(int(np.searchsorted(edges, hi, side="left")), len(edges) - 1)
    for col in range(first, last):
        overlap = min(hi, edges[col + 1]) - max(lo, edges[col])
        if overlap > 0:
            owner[col, what] += overlap


def pool_usage(pool, alloc) -> dict[str, dict[str, int]]:
    """Per sub-pool: live pages, their bytes, and the share of the pool's bytes."""
    usage = {}
    for name, sub in pool.subpools.items():
        live = int(alloc.subpool(name).num_live)
        usage[name] = dict(
            pages=live,
            bytes=live * sub.page_bytes,
            percent=round(100 * live * sub.page_bytes / pool.total_bytes, 1),
        )
    return usage
