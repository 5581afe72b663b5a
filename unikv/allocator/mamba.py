"""Mamba state slots: one slot (page size 1) per request. The sub-pool's virtual
id of request r is ``r + 1`` (0 is the sink), so compaction can move a slot and
``slots`` still finds it through ``v2p``. With speculative decoding (``k`` =
``draft_slots`` > 0) request r also holds k per-draft-position slots, virtual ids
``R + 1 + r * k + j`` (R = max_requests, j < k), taken and freed with its slot and
counted wherever it is (admission's ``reserve``, the capacity oracle's demand, the
pool's one-request floor): a verify step writes the state after its token j into
slot j (``draft_slots``), and accepting j drafts makes slot j the request's live
one by exchanging the two bindings (``select``: v2p/p2v entries, no state copied;
the old live slot becomes draft slot j). Ids above them are prefix-cache state
checkpoints (``checkpoints.py``); a request opened with a hit gets its checkpoint
copied into its new slot here.

    Mamba virtual ids:  0 sink | 1..R request slots | R+1..R+R*k draft slots | checkpoints

Cost: ``k * spec.entry_bytes`` more per request (``docs/design.md`` section 13 gives
the figures per family), paid from the same buffer as any state slot: the Mamba band
grows into free bytes or takes them from the attention bands (section 6).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from unikv.allocator.checkpoints import StateCheckpoints
from unikv.allocator.fences import FenceQueue
from unikv.allocator.pages import PageBook
from unikv.allocator.requests import RequestTable
from unikv.allocator.room import Room
from unikv.allocator.tables import TablePatch, TableWriter
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
        draft_slots: int = 0,
    ) -> None:
        self.pool, self.book, self.requests = pool, book, requests
        self.fences, self.room, self.writer, self.states = fences, room, writer, states
        self.k = draft_slots  # per-draft-position slots per request (speculation)
        self.draft_base = requests.max_requests + 1

    def draft_vids(self, slots: np.ndarray) -> np.ndarray:
        """(B, k) int32 virtual ids of the draft slots of requests ``slots`` (host)."""
        base = self.draft_base + np.asarray(slots, np.int64)[:, None] * self.k
        return (base + np.arange(self.k)).astype(np.int32)

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
        every = np.concatenate([vids, self.draft_vids(slots).reshape(-1)])  # + k each
        assert not (book.physical(every) >= 0).any(), (
            "draft-state invariant: a request without a state slot holds no draft slot"
        )
        with self.writer.batch():  # what making room evicted goes with the bind's write
            if len(vids) and not self.room.reserve({book.name: len(every)}, 0, slots):
                return None
            pages = book.take(len(every))
            book.bind_host(every, pages)
            bound = self.writer.bind(book, every, pages)
        phys = PhysicalPageIds(bound[: len(vids)], book.name)
        # zeroed before any later forward, in stream order; not the slots a device
        # checkpoint's restore overwrites whole (a hit's admission: one copy, no fill)
        restored = self.states.restoring(slots) if self.states is not None else None
        if restored is None or not restored.any():
            self.pool.zero_pages(book.name, phys)
        elif not restored.all():  # (a mixed batch: the others' slots, from the host)
            fresh = self.writer.upload(pages[: len(vids)][~restored], wide=True)
            self.pool.zero_pages(book.name, PhysicalPageIds(fresh, book.name))
        if self.states is not None:
            self.states.restore(slots)
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
        """Free the slots of request virtual ids ``vids`` (host int32) that hold one,
        with their draft slots."""
        if self.states is not None:
            self.states.slots_freed((vids - 1).astype(np.int64))
        if self.k:  # each request's slot, then its draft slots (as one by one)
            vids = np.concatenate([vids[:, None], self.draft_vids(vids - 1)], axis=1).reshape(-1)
        if self.states is not None:
            self.states.flush_for(vids.tolist())  # a queued checkpoint reads one of them
        vids = vids[self.book.physical(vids) >= 0]
        self.writer.unbind(self.book, vids, self.fences.unbind(self.book, vids))

    def check_select(self, slots: object, positions: object) -> tuple[np.ndarray, np.ndarray]:
        """(slots, positions) as int64 arrays once valid for ``select`` (ValueError
        otherwise, nothing changed): one position per request in ``slots``, each in
        [-1, k), every request holding a state slot."""
        slots = self.requests.check_slots(slots, "select")
        positions = np.asarray(positions, np.int64)
        if positions.shape != slots.shape or ((positions < -1) | (positions >= self.k)).any():
            raise ValueError(
                f"select: positions must be {slots.shape[0]} ints in [-1, {self.k}) (the "
                f"draft state slots per request), got {positions.tolist()}"
            )
        held = self.book.physical((slots + 1).astype(np.int32)) > 0
        if not held.all():
            raise ValueError(f"select: requests {slots[~held].tolist()} hold no state slot")
        return slots, positions

    def select(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """After a verify step: request ``slots[i]``'s state is the one its draft slot
        ``positions[i]`` holds (host ints; -1: its live slot's, nothing to do). That
        slot becomes the live one and the live one that draft slot: two bindings
        exchanged per request, one table write, no state copied. (The scheduler's
        ``complete_verify`` calls it after ``truncate``: the speculative rollback.)"""
        slots, positions = self.check_select(slots, positions)
        moved = positions >= 0
        if not moved.any():
            return
        slots, positions = slots[moved], positions[moved]
        if self.states is not None:  # a queued checkpoint reads one of these bindings
            every = np.concatenate([(slots + 1), self.draft_vids(slots).reshape(-1)])
            self.states.flush_for(every.tolist())
        assert (positions < self.k).all(), "draft-state invariant: a position below k"
        live = (slots + 1).astype(np.int32)
        draft = self.draft_vids(slots)[np.arange(len(slots)), positions]
        pa, pb = self.book.exchange_host(live, draft)
        patch = TablePatch()
        v = patch.part(np.concatenate([live, draft]))
        p = patch.part(np.concatenate([pb, pa]))
        patch.add(self.writer.v2p_id[self.book.name], v, p)
        patch.add(self.writer.p2v_id[self.book.name], p, v)
        self.writer.write(patch)

    def draft_slots(self, req_slots: torch.Tensor) -> PhysicalPageIds:
        """(B, k) physical draft slots of (B,) device request slots (0, the sink, for
        requests without them). No host sync."""
        ids = (req_slots.long() * self.k + self.draft_base)[:, None]
        ids = ids + torch.arange(self.k, device=req_slots.device)
        found = self.book.v2p.index_select(0, ids.view(-1)).clamp_min(0)
        return PhysicalPageIds(found.view(-1, self.k), self.book.name)

    def slots(self, req_slots: torch.Tensor, drafts: bool = False) -> PhysicalPageIds:
        """Current physical state slots of (B,) int32/int64 device request slots
        (0, the sink, for requests without one); ``drafts``: their (B, k) draft
        slots (``draft_slots``). No host sync."""
        if drafts:
            return self.draft_slots(req_slots)
        v2p = self.book.v2p
        return PhysicalPageIds(
            v2p.index_select(0, req_slots.long() + 1).clamp_min(0), self.book.name
        )


def rollback(mamba: MambaSlots | None, slots: object, rows: object) -> Callable[[], None]:
    """The state half of a verify step's rollback (``PoolAllocator.truncate``'s
    ``state_rows``), checked now and run by the returned call: each request's state
    becomes the one its draft slot ``rows[i]`` holds (-1: its live slot's,
    ``MambaSlots.select``). ``rows`` None: nothing to do."""
    if rows is None:
        return lambda: None
    if mamba is None or not mamba.k:
        raise ValueError("truncate: state_rows needs per-draft state slots (speculation on "
                         "a recurrent model); this allocator has none")  # fmt: skip
    checked = mamba.check_select(slots, rows)
    return lambda: mamba.select(*checked)
