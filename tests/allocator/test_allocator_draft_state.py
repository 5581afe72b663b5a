"""Per-draft-position state slots (``UnifiedPool(state_slots=1 + k)``): each request
holds k Mamba slots besides its own, taken, counted and freed with it;
``MambaSlots.select`` makes draft slot j the live one by exchanging bindings, no byte
copied.

The oracle is the pool's raw bytes: every slot is stamped with its own pattern through
the buffer (page p of the Mamba grid at byte ``p * entry_bytes``), and after a
selection the request's live slot (found through the device tables) must hold the
pattern its draft slot held, and that draft slot the old live pattern."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import CHAINS, PAGES, snapshot

from unikv.allocator import PoolAllocator
from unikv.pool import UnifiedPool, pool_bytes_for

K = 2


@pytest.fixture
def alloc():
    configs = CHAINS["full+mamba"](4)
    total = pool_bytes_for(configs, {c.name: PAGES[c.name] for c in configs})
    pool = UnifiedPool(configs, total, state_slots=1 + K)
    return PoolAllocator(pool, max_requests=4, max_context=40, debug=True)


def _bytes(alloc, phys: int) -> torch.Tensor:
    size = alloc.pool.subpools["mamba"].page_bytes
    return alloc.pool.buffer[phys * size : (phys + 1) * size]


def _slots(alloc, r: int) -> tuple[int, list[int]]:
    """(live physical slot, draft physical slots) of request r, from the device."""
    req = torch.tensor([r])
    live = int(alloc.mamba_slots(req).data[0])
    return live, alloc.mamba_slots(req, drafts=True).data[0].tolist()


def test_slots_are_taken_selected_and_freed_with_the_request(alloc):
    mamba = alloc.parts.books["mamba"]
    r0, r1 = alloc.new_request(), alloc.new_request()
    assert alloc.alloc_mamba(np.array([r0, r1])) is not None
    assert mamba.num_live == 2 * (1 + K)
    layout = {r: _slots(alloc, r) for r in (r0, r1)}
    every = [p for live, drafts in layout.values() for p in [live, *drafts]]
    assert len(set(every)) == len(every) and min(every) > 0  # distinct real slots
    for i, p in enumerate(every):  # stamp each slot with its own pattern
        _bytes(alloc, p).fill_(i + 1)
    stamp = {p: i + 1 for i, p in enumerate(every)}

    # the speculative rollback: truncate (no tokens to cut here) and select the states
    alloc.truncate(np.array([r0, r1]), np.array([0, 0]), state_rows=np.array([1, -1]))
    live0, drafts0 = _slots(alloc, r0)
    assert live0 == layout[r0][1][1] and drafts0 == [layout[r0][1][0], layout[r0][0]]
    assert torch.all(_bytes(alloc, live0) == stamp[layout[r0][1][1]])  # no copy: the slot
    assert _slots(alloc, r1) == layout[r1]  # -1: unchanged
    assert mamba.num_live == 2 * (1 + K)
    alloc.check_integrity()

    alloc.free_request(r0)
    assert mamba.num_live == 1 + K
    alloc.free_request(r1)
    assert mamba.num_live == 0


def test_admission_reserves_the_draft_slots_atomically(alloc, monkeypatch):
    """alloc_mamba asks the room maker for 1 + K slots a request in one reservation;
    refused, it changes nothing (no partial set of draft slots)."""
    room = alloc.parts.mamba.room
    asked = []
    real = room.reserve
    monkeypatch.setattr(
        room, "reserve", lambda new, *a, **kw: asked.append(dict(new)) or real(new, *a, **kw)
    )
    slots = [alloc.new_request() for _ in range(3)]
    assert alloc.alloc_mamba(np.array(slots[:2])) is not None
    assert asked == [{"mamba": 2 * (1 + K)}]
    monkeypatch.setattr(room, "reserve", lambda new, *a, **kw: False)  # no room
    before = snapshot(alloc)
    assert alloc.alloc_mamba(np.array(slots[2:])) is None
    assert snapshot(alloc) == before
    alloc.check_integrity()


def test_bad_selections_are_value_errors(alloc):
    r0, r1 = alloc.new_request(), alloc.new_request()
    alloc.alloc_mamba(np.array([r0]))
    before = snapshot(alloc)

    def select(slots, rows):  # the facade's rollback verb (truncate's state_rows)
        alloc.truncate(slots, np.zeros(len(slots), np.int64), state_rows=rows)

    with pytest.raises(ValueError, match=r"positions must be 1 ints in \[-1, 2\)"):
        select(np.array([r0]), np.array([K]))
    with pytest.raises(ValueError, match="positions must be 1 ints"):
        select(np.array([r0]), np.array([0, 1]))
    with pytest.raises(ValueError, match=f"requests \\[{r1}\\] hold no state slot"):
        select(np.array([r1]), np.array([0]))
    with pytest.raises(ValueError, match="state_slots must be an int >= 1"):
        UnifiedPool(CHAINS["full+mamba"](4), alloc.pool.total_bytes, state_slots=0)
    assert snapshot(alloc) == before
