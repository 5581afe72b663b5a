"""Page envelopes of one sub-pool as rows of a 2-D byte view.

Page ``p`` of a sub-pool is bytes ``[p * page_bytes, (p + 1) * page_bytes)`` of
``pool.buffer`` (docs/design.md section 2), so the sub-pool's grid is the row view

    rows = buffer[: num_pages * page_bytes].view(num_pages, page_bytes)

and every I/O operation is a row gather, a row scatter or a row slice.
"""

from __future__ import annotations

import numpy as np
import torch

from unikv.ids import PhysicalPageIds, expect
from unikv.pool import UnifiedPool


def page_rows(pool: UnifiedPool, name: str) -> torch.Tensor:
    """(num_pages, page_bytes) uint8 view of sub-pool ``name``'s page grid."""
    sub = pool[name]
    return pool.buffer[: sub.num_pages * sub.page_bytes].view(sub.num_pages, sub.page_bytes)


def physical_pages(pages: object, what: str, name: str) -> torch.Tensor:
    """The plain (n,) int tensor of ``pages`` after checking it is 1-D
    ``PhysicalPageIds`` of sub-pool ``name``."""
    data = expect(pages, PhysicalPageIds, what, name)
    if data.dim() != 1:
        raise ValueError(f"{what} must be a 1-D page list, got shape {tuple(data.shape)}")
    return data


def host_list(pages: torch.Tensor) -> list[int]:
    """Page ids as host ints (free for CPU tensors; a sync for device tensors)."""
    return pages.detach().to("cpu", torch.int64).tolist()


def runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Split a slot list into runs of consecutive slots.

    Returns ``(first_index, first_slot, length)`` for each maximal run, so that
    ``slots[i : i + length] == range(first_slot, first_slot + length)``.
    """
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            out.append((start, slots[start], i - start))
            start = i
    return out if slots else []


def pair_runs(pages: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """Split paired page and slot lists into runs where both are consecutive.

    Returns ``(first_index, first_page, length)`` for each maximal run, so that
    ``pages[i : i + length] == range(first_page, first_page + length)`` and the
    slots ``slots[i : i + length]`` are consecutive too: one byte range on each side
    (the page-major law: a page's envelope is one range, consecutive pages one).
    """
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1 or slots[i] != slots[i - 1] + 1:
            out.append((start, pages[start], i - start))
            start = i
    return out if pages else []


def run_bounds(*columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``pair_runs`` over numpy columns (equal-length int arrays): (first index,
    length) of each maximal run where every column steps by one, as two int64
    arrays; vectorised, so a batch of n pages costs O(1) Python calls."""
    n = len(columns[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    step = np.ones(n - 1, bool)
    for column in columns:
        step &= np.diff(column) == 1
    starts = np.concatenate(([0], np.flatnonzero(~step) + 1)).astype(np.int64)
    return starts, np.diff(np.append(starts, n))
