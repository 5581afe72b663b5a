"""Lazy compaction: move live pages into holes so bands reach a packing.

    before:  | UP: A . B . . C |  gap  | DOWN ...       ('.' = hole)
    target:  | UP: A C B |        gap        | DOWN ...
             C (outside the target) moves into a hole; the frontier absorbs the
             trailing holes for free; virtual ids never change.

Holes are reused first (allocation pops them before any band grows); a band's
frontier absorbs the holes next to it at no cost; only live pages outside the
target band move, each with one envelope copy (``UnifiedPool.move_pages``),
into holes of the target nearest the far end. ``v2p``/``p2v`` are rewritten.

Sub-pools are processed so that a band that the next target overlaps has
already retreated: if X's target overlaps Y's current band, Y goes first. Along
the chain UP | FLOAT | DOWN this order has no cycle.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from unikv.allocator.capacity import Bands
from unikv.allocator.subpool import FREE, LIVE, SubPoolAllocator
from unikv.ids import PhysicalPageIds
from unikv.pool import Grow, UnifiedPool


def plan_moves(sub: SubPoolAllocator, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Sources (live pages of ``sub`` outside ``[lo, hi)``) and destinations (holes
    inside it, farthest from the frontier first): host int32 arrays. The band
    must already cover ``[lo, hi)``."""
    pages = np.arange(sub.lo, sub.hi, dtype=np.int32)
    states = sub.state[sub.lo : sub.hi]
    src = pages[(states == LIVE) & ((pages < lo) | (pages >= hi))]
    target = np.arange(lo, hi, dtype=np.int32)
    open_ = target[sub.state[lo:hi] == FREE]
    if sub.grow == Grow.DOWN:
        open_ = open_[::-1]
    assert len(open_) >= len(src), (
        f"{sub.name!r}: target band [{lo}, {hi}) has {len(open_)} open pages for {len(src)} moves"
    )
    return src, open_[: len(src)].copy()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def compaction_order(subs: Mapping[str, SubPoolAllocator], targets: Bands) -> list[str]:
    """Names in an order where a band retreats before another target takes its bytes."""

    def span(name: str, band: tuple[int, int]) -> tuple[int, int]:
        pb = subs[name].page_bytes
        return band[0] * pb, band[1] * pb

    before = {
        x: {y for y in targets if y != x and _overlaps(span(x, targets[x]), span(y, subs[y].band))}
        for x in targets
    }
    order: list[str] = []
    while len(order) < len(targets):
        ready = [x for x in targets if x not in order and before[x] <= set(order)]
        assert ready, f"compaction order has a cycle: {before}"
        order.append(ready[0])
    return order


def compact_to(pool: UnifiedPool, subs: Mapping[str, SubPoolAllocator], targets: Bands) -> int:
    """Move pages so every band becomes its target; returns the number of moves.

    Pinned and pending pages must already lie inside their targets (the capacity
    oracle keeps them); destinations are holes or pages no band owns."""
    moved = 0
    for name in compaction_order(subs, targets):
        sub = subs[name]
        lo, hi = targets[name]
        if sub.lo < sub.hi:  # first the hull of both bands: destinations become holes
            sub.set_band(min(lo, sub.lo), max(hi, sub.hi))
        src, dst = plan_moves(sub, lo, hi)
        if len(src):
            packed = sub.upload(np.concatenate([src, dst]))
            pool.move_pages(
                name,
                PhysicalPageIds(packed[: len(src)], name),
                PhysicalPageIds(packed[len(src) :], name),
                check=False,
            )
            _take_open(sub, dst)
            sub.apply_moves(src, dst)
            moved += len(src)
        sub.set_band(lo, hi)
    return moved


def _take_open(sub: SubPoolAllocator, dst: np.ndarray) -> None:
    """Destinations (holes) leave the free stack."""
    stack = sub._stack[: sub.num_free]
    keep = stack[~np.isin(stack, dst)]
    sub.num_free = 0
    sub._push(keep)
