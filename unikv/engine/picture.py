"""A text picture of the unified pool: which bytes hold whose live pages.

    |####FFFFF..FFF          SSS.SS|   # sink, F/S/... live pages of a sub-pool
                                       (first letter of its name, upper case),
                                       . a hole inside a band, space = unclaimed
    |########MMMMmmmmMMMM....  FFFF|   a Mamba sub-pool (page size 1): one slot per
                                       request, drawn M and m in turn slot by slot

Each column covers ``total_bytes / width`` bytes and shows what holds most of
them. Read from the allocator's host mirrors (no device access).
"""

from __future__ import annotations

import numpy as np

from unikv.allocator.pages import FREE, LIVE, PENDING

SINK, HOLE, EMPTY = "#", ".", " "


def _labels(pool) -> list[tuple[str, str]]:
    """Per sub-pool, the letters of its live pages: (even, odd) page index."""
    out = []
    for name, sub in pool.subpools.items():
        letter = name[0].upper()
        out.append((letter, letter.lower()) if sub.spec.kind == "mamba" else (letter, letter))
    return out


def pool_picture(pool, alloc, width: int = 64) -> str:
    """One line of ``width`` columns; see the module docstring."""
    total = pool.total_bytes
    edges = np.linspace(0, total, width + 1)
    pairs = _labels(pool)
    labels = [SINK, HOLE, EMPTY] + [c for pair in pairs for c in pair]
    owner = np.zeros((width, len(labels)))  # bytes per (column, what)
    _add(owner, edges, 0, 0, pool.sink_bytes)
    for i, (name, (even, odd)) in enumerate(zip(pool.subpools, pairs)):
        sub, state = pool.subpools[name], alloc.view.page_states(name)
        for page in np.flatnonzero((state == LIVE) | (state == PENDING)):
            what = 3 + 2 * i + (int(page % 2) if even != odd else 0)
            _add(owner, edges, what, page * sub.page_bytes, (page + 1) * sub.page_bytes)
        for page in np.flatnonzero(state == FREE):
            _add(owner, edges, 1, page * sub.page_bytes, (page + 1) * sub.page_bytes)
    width_bytes = np.diff(edges)
    owner[:, 2] = np.maximum(width_bytes - owner.sum(axis=1), 0)
    return "|" + "".join(labels[j] for j in owner.argmax(axis=1)) + "|"


def legend(pool) -> str:
    """What the letters of ``pool_picture`` mean for this pool."""
    parts = [f"{SINK} sink"]
    for (even, odd), (name, sub) in zip(_labels(pool), pool.subpools.items()):
        if even == odd:
            parts.append(f"{even} live pages of {name}")
        else:
            parts.append(f"{even}/{odd} live slots of {name} (one per request, in turn)")
    return ", ".join(parts) + f", {HOLE} free page or slot, blank: no band"


def _add(owner: np.ndarray, edges: np.ndarray, what: int, lo: float, hi: float) -> None:
    """Add the overlap of byte range [lo, hi) with every column to ``owner[:, what]``."""
    first = max(int(np.searchsorted(edges, lo, side="right")) - 1, 0)
    last = min(int(np.searchsorted(edges, hi, side="left")), len(edges) - 1)
    for col in range(first, last):
        overlap = min(hi, edges[col + 1]) - max(lo, edges[col])
        if overlap > 0:
            owner[col, what] += overlap


def pool_usage(pool, alloc) -> dict[str, dict[str, int]]:
    """Per sub-pool: live pages (slots for a Mamba sub-pool), their bytes, and the
    share of the pool's bytes."""
    usage = {}
    for name, sub in pool.subpools.items():
        live = alloc.view.live_pages(name)
        usage[name] = {
            "pages": live,
            "bytes": live * sub.page_bytes,
            "percent": round(100 * live * sub.page_bytes / pool.total_bytes, 1),
        }
    return usage
