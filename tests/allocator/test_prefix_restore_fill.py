"""A hit's admission on a hybrid (issue 41, the host cost of a cache prefill step):

- ``alloc_mamba`` zeroes only the new state slots no device checkpoint overwrites
  (``StateCheckpoints.restoring``): a hit's slot gets the checkpoint's envelope by one
  copy, with no fill before it, and a miss admitted with it is still zeroed;
- the checkpoint slots a step reserves for its prefill chunks
  (``alloc.prefix.reserve_checkpoint``) inside ``alloc.prefix.batched()`` are bound
  with one table write for all, and the device tables equal their host mirrors after.

Independent derivations: the bytes of every slot are read back from the pool and
compared with the bytes written into the checkpointed request's slot (a pattern this
test chose) and with zeros; every other Mamba slot is filled with garbage first, so a
slot that was neither zeroed nor restored shows it. The zeroed slots are logged by a
spy on ``UnifiedPool.zero_pages``; the tables by the debug-mode integrity check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import full_config

from unikv.allocator import PoolAllocator
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, StatePart

PS = 4
PATTERN = 0x5A  # the checkpointed request's state bytes
GARBAGE = 0xC3  # every other Mamba slot before the admissions


def _alloc() -> PoolAllocator:
    state = MambaSpec(1, (StatePart((3,)),), StatePart((29,)))
    configs = [full_config(PS), SubPoolConfig("mamba", state)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": 16, "mamba": 8}))
    return PoolAllocator(pool, max_requests=8, max_context=64, debug=True)


def _slot_bytes(alloc: PoolAllocator, slot: int) -> torch.Tensor:
    """The envelope of request ``slot``'s live state slot (a view of the pool)."""
    book = alloc.parts.mamba.book
    page = int(book.physical(np.array([slot + 1], np.int32))[0])
    assert page > 0
    return alloc.pool.page_envelope("mamba", page)


def _checkpointed(alloc: PoolAllocator) -> np.ndarray:
    """A finished request whose state (``PATTERN``) is checkpointed at 8 tokens; its
    tokens."""
    tokens = np.arange(9) + 100
    slot = alloc.new_request()
    assert alloc.alloc_mamba(np.array([slot])) is not None
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([9])) is not None
    _slot_bytes(alloc, slot).fill_(PATTERN)
    alloc.prefix.insert(slot, tokens[:8])
    assert alloc.prefix.checkpoint(slot, tokens[:8])
    alloc.free_request(slot)
    return tokens


def _garbage(alloc: PoolAllocator) -> None:
    """Every Mamba slot but the sink and the checkpoints' holds ``GARBAGE``."""
    states = alloc.parts.prefix.states
    kept = set(states.book.physical(np.array(list(states.by_node.values()), np.int32)).tolist())
    for page in range(1, alloc.pool["mamba"].num_pages):
        if page not in kept:
            alloc.pool.page_envelope("mamba", page).fill_(GARBAGE)


@pytest.mark.parametrize("with_miss", [False, True])
def test_a_hits_slot_is_the_checkpoint_and_only_misses_are_zeroed(with_miss, monkeypatch):
    alloc = _alloc()
    tokens = _checkpointed(alloc)
    _garbage(alloc)
    zeroed: list[int] = []
    zero = alloc.pool.zero_pages

    def spy(name, pages):
        zeroed.extend(pages.data.tolist())
        zero(name, pages)

    monkeypatch.setattr(alloc.pool, "zero_pages", spy)
    hit = alloc.prefix.match(np.concatenate([tokens[:8], [7]]))
    assert hit.num_tokens == 8
    slots = [alloc.new_request(prefix=hit)] + ([alloc.new_request()] if with_miss else [])
    assert alloc.alloc_mamba(np.array(slots)) is not None
    assert torch.equal(
        _slot_bytes(alloc, slots[0]), torch.full_like(_slot_bytes(alloc, 0), PATTERN)
    )
    book = alloc.parts.mamba.book
    misses = book.physical(np.array(slots[1:], np.int32) + 1).tolist()
    assert zeroed == misses, "the hit's slot takes the copy alone; a miss's is zeroed"
    for slot in slots[1:]:
        assert not _slot_bytes(alloc, slot).any()
    assert alloc.parts.prefix.states.restored == 1
    alloc.check_integrity()


def test_a_steps_reservations_bind_in_one_write():
    alloc = _alloc()
    writer = alloc.parts.writer
    slots = [alloc.new_request() for _ in range(3)]
    assert alloc.alloc_mamba(np.array(slots)) is not None
    for s in slots:
        assert alloc.alloc_extend(np.array([s]), np.array([0]), np.array([9])) is not None
    before = writer.writes
    with alloc.prefix.batched():
        for s in slots:
            assert alloc.prefix.reserve_checkpoint(s, 8)
        assert writer.writes == before, "staged: nothing written inside the scope"
    assert writer.writes == before + 1
    states = alloc.parts.prefix.states
    assert sorted(states.direct) == sorted(slots)
    alloc.check_integrity()  # (debug: the device v2p / p2v equal their host mirrors)
    # outside a scope a reservation is written at once, as before
    other = alloc.new_request()
    assert alloc.alloc_mamba(np.array([other])) is not None
    assert alloc.alloc_extend(np.array([other]), np.array([0]), np.array([9])) is not None
    before = writer.writes
    assert alloc.prefix.reserve_checkpoint(other, 8)
    assert writer.writes == before + 1
    alloc.check_integrity()
