"""Lazy compaction: move live pages into holes so bands reach a packing.

    before:  | UP: A . B . . C |  gap  | DOWN ...       ('.' = hole)
    target:  | UP: A C B |        gap        | DOWN ...
             C (outside the target) moves into a hole; the frontier absorbs the
             trailing holes for free; virtual ids never change.

Holes are reused first (allocation pops them before any band grows); a band's
frontier absorbs the holes next to it at no cost; only live pages outside the
target band move, each with one envelope copy (``UnifiedPool.move_pages``),
into holes of the target nearest the far end. ``v2p``/``p2v`` are rewritten.
The plan (``bands.plan_moves``, ``bands.compaction_order``) is pure; this
module carries it out.

Sub-pools are processed so that a band that the next target overlaps has
already retreated (``bands.compaction_order``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from unikv.allocator.bands import compaction_order, plan_moves
from unikv.allocator.capacity import Bands
from unikv.allocator.pages import PageBook
from unikv.allocator.tables import TableWriter
from unikv.ids import PhysicalPageIds
from unikv.pool import UnifiedPool


def compact_to(
    pool: UnifiedPool, books: Mapping[str, PageBook], writer: TableWriter, targets: Bands
) -> int:
    """Move pages so every band becomes its target; returns the number of moves.

    Pinned and pending pages must already lie inside their targets (the capacity
    oracle keeps them); destinations are holes or pages no band owns."""
    moved = 0
    for name in compaction_order(books, targets):
        book = books[name]
        lo, hi = targets[name]
        if book.lo < book.hi:  # first the hull of both bands: destinations become holes
            book.set_band(min(lo, book.lo), max(hi, book.hi))
        src, dst = plan_moves(book, lo, hi)
        if len(src):
            ids = writer.upload(np.concatenate([src, dst]))
            pool.move_pages(
                name,
                PhysicalPageIds(ids[: len(src)], name),
                PhysicalPageIds(ids[len(src) :], name),
                check=False,
                disjoint=True,  # live pages into holes: no page is both
            )
            book.take_these(dst)
            writer.move(book, book.apply_moves(src, dst), src, dst)
            moved += len(src)
        book.set_band(lo, hi)
    return moved
