"""Mamba state slots: one slot (page size 1) per request. The sub-pool's virtual
id of request r is ``r + 1`` (0 is the sink), so compaction can move a slot and
``slots`` still finds it through ``v2p``. Ids from ``max_requests + 1`` on are
prefix-cache state checkpoints (``checkpoints.py``); a request opened with a hit
gets its checkpoint copied into its new slot here.
"""

from __future__ import annotations

import numpy as np
import torch

from unikv.allocator.checkpoints import StateCheckpoints
from unikv.allocator.fences import FenceQueue
from unikv.allocator.pages import PageBook
from unikv.allocator.requests import RequestTable
from unikv.allocator.room import Room
from unikv.allocator.tables import TableWriter
from unikv.ids import PhysicalPageIds
from unikv.pool import UnifiedPool


class MambaSlots:
    """Alloc, free and look up the state slots of one Mamba sub-pool."""

    def __init__(
        self,
        pool: UnifiedPool,
        book: PageBook,
        requests: RequestTable,
        fences: FenceQueue,
        room: Room,
        writer: TableWriter,
        states: StateCheckpoints | None = None,
    ) -> None:
        self.pool, self.book, self.requests = pool, book, requests
        self.fences, self.room, self.writer, self.states = fences, room, writer, states

    def alloc(self, slots: object) -> PhysicalPageIds | None:
        """One zeroed state slot for each request in ``slots`` ((B,) host ints,
        requests without one), or the state checkpoint of the prefix hit it opened
        with: the (B,) physical slots on the device, or None (state unchanged)
        when the chain cannot make room."""
        book = self.book
        slots = self.requests.check_slots(slots, "alloc_mamba")
        vids = (slots + 1).astype(np.int32)
        if (book.physical(vids) >= 0).any():
            held = slots[book.physical(vids) >= 0].tolist()
            raise ValueError(f"alloc_mamba: requests {held} already hold a slot")
        if len(vids) and not self.room.reserve({book.name: len(vids)}, 0, slots):
            return None
        pages = book.take(len(vids))
        book.bind_host(vids, pages)
        phys = PhysicalPageIds(self.writer.bind(book, vids, pages), book.name)
        self.pool.zero_pages(book.name, phys)  # before any later forward, in stream order
        if self.states is not None:
            self.states.restore(slots, phys)
        return phys

    def free(self, slots: object) -> None:
        """Free the state slots of ``slots`` ((B,) host ints, requests holding one)."""
        slots = self.requests.check_slots(slots, "free_mamba")
        vids = (slots + 1).astype(np.int32)
        if (self.book.physical(vids) < 0).any():
            empty = slots[self.book.physical(vids) < 0].tolist()
            raise ValueError(f"free_mamba: requests {empty} hold no slot")
        self.free_bound(vids)

    def free_bound(self, vids: np.ndarray) -> None:
        """Free the slots of virtual ids ``vids`` that hold one (host int32)."""
        if self.states is not None:
            self.states.unpin((vids - 1).astype(np.int64))
        vids = vids[self.book.physical(vids) >= 0]
        self.writer.unbind(self.book, vids, self.fences.unbind(self.book, vids))

    def slots(self, req_slots: torch.Tensor) -> PhysicalPageIds:
        """Current physical state slots of (B,) int32/int64 device request slots
        (0, the sink, for requests without one). No host sync."""
        v2p = self.book.v2p
        return PhysicalPageIds(
            v2p.index_select(0, req_slots.long() + 1).clamp_min(0), self.book.name
        )
