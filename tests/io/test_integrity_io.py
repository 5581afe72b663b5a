"""HostTier.check_integrity and Tiering.check_integrity can fail: on a busy tier
(used slots, free slots out of heap order once popped, a slot waiting for a
reload's event, a reload in flight with pinned pages), each case breaks ONE
invariant and expects the AssertionError that names it. Fake done-events stand
in for CUDA events on the CPU."""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
from allocator_fixtures import FakeEvent

from unikv.allocator import PoolAllocator
from unikv.ids import PhysicalPageIds, VirtualPageIds
from unikv.io import HostTier
from unikv.io.host_tier import HostCopy, HostPageIds
from unikv.io.tiering import Tiering
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

PS = 4
CONFIGS = [
    SubPoolConfig("full", MHASpec(1, 1, 4, dtype=torch.float32), page_size=PS),
    SubPoolConfig("swa", MHASpec(1, 1, 2, dtype=torch.float32, sliding_window=8), page_size=PS),
]


def busy() -> tuple[PoolAllocator, Tiering]:
    """r0 (16 tokens): pages 0-1 offloaded to host slots 0-1, reloaded, the slots
    freed; page 2 offloaded (slot 2 used); slot 0, taken again, freed while a
    reload still reads it (PENDING); one reload in flight whose destination page
    stays pinned."""
    pool = UnifiedPool(CONFIGS, pool_bytes_for(CONFIGS, {"full": 12, "swa": 12}))
    alloc = PoolAllocator(pool, max_requests=2, max_context=32)
    tiering = Tiering(alloc, HostTier(pool, "full", 6))
    slot = alloc.new_request()
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([16])) is not None
    vpages = alloc.parts.requests.pages[slot, :4].astype(np.int64)
    first = tiering.offload(VirtualPageIds(torch.from_numpy(vpages[:2]), "full"))
    assert tiering.offload(VirtualPageIds(torch.from_numpy(vpages[2:3]), "full")) is not None
    assert tiering.reload(first) is not None
    tier = tiering.tier
    waiting = tier.offload(
        PhysicalPageIds(torch.tensor([int(alloc.parts.books["full"].v2p_host[vpages[3]])]), "full")
    )
    tier._reader[waiting.host_slots.data[0]] = FakeEvent()  # a reload still reading it
    tier.free(waiting.host_slots)
    page = PhysicalPageIds(
        torch.tensor([int(alloc.parts.books["full"].v2p_host[vpages[0]])]), "full"
    )
    alloc.io.pin("full", page)
    tiering._pinned.append(HostCopy(HostPageIds(torch.tensor([5])), page, FakeEvent()))
    return alloc, tiering


def _unsorted_heap(tiering) -> None:
    tier = tiering.tier
    tier._free = sorted(tier._free, reverse=True)


CASES: dict[str, Callable[[Tiering], None]] = {
    "one state, writer and reader per slot": lambda t: t.tier._writer.append(None),
    "the host pool holds num_slots envelopes": lambda t: setattr(
        t.tier, "host", t.tier.host[:, :-1]
    ),
    "every slot is FREE, USED or PENDING": lambda t: t.tier._state.__setitem__(4, 7),
    "the free heap holds exactly the FREE slots": lambda t: heapq.heappush(t.tier._free, 2),
    "the free list is a heap (lowest slot first)": _unsorted_heap,
    "PENDING slots are exactly those waiting for a reload's event": lambda t: (
        t.tier._pending.clear()
    ),
    "a free or pending slot has no writer or reader": lambda t: t.tier._writer.__setitem__(
        0, FakeEvent()
    ),
    "the tier and the allocator serve the same pool and sub-pool": lambda t: setattr(
        t, "name", "swa"
    ),
    "the pages of a reload in flight are pinned": lambda t: t.alloc.parts.books[
        t.name
    ].pins.__setitem__(t._pinned[0].pages.data.numpy(), 0),
}


def test_the_busy_state_is_intact_and_busy():
    alloc, tiering = busy()
    tiering.check_integrity()
    alloc.check_integrity()
    state = list(tiering.tier._state)
    assert state.count(0) >= 3 and state.count(1) == 1 and state.count(2) == 1
    assert len(tiering.tier._free) >= 2 and tiering._pinned


@pytest.mark.parametrize("invariant", list(CASES))
def test_each_broken_invariant_is_named(invariant):
    _, tiering = busy()
    CASES[invariant](tiering)
    with pytest.raises(AssertionError, match=re.escape(invariant)):
        tiering.check_integrity()


def test_the_cases_name_distinct_invariants():
    names = list(CASES)
    assert all(a not in b for a in names for b in names if a != b)
