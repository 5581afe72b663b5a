"""A request's own superseded checkpoint is not an eviction (issue 41, item 2).

A rolling take drops (or re-keys the slot of) the same request's previous decode
checkpoint: the policy replaced it, no room was made for anything. It is counted
as ``superseded``; ``evicted`` (and ``PrefixVerbs.evicted``, the checkpoint cost
rule's pressure signal) counts only checkpoints the room maker took or that went
with their node. Independent derivation: in a pool with a slot to spare for every
checkpoint nothing needs room, so the evictions are 0 and the superseded ones the
takes after the first (each replaces the one before); in a pool of one spare slot
two requests' takes need room: the second's take evicts the first's checkpoint
(read back through ``match``).
"""

from __future__ import annotations

import numpy as np
from allocator_fixtures import full_config

from unikv.allocator import PoolAllocator
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, StatePart

PS = 4


def _alloc(slots: int, pages: int = 32) -> PoolAllocator:
    state = MambaSpec(1, (StatePart((3,)),), StatePart((29,)))
    configs = [full_config(PS), SubPoolConfig("mamba", state)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages, "mamba": slots}))
    return PoolAllocator(pool, max_requests=4, max_context=64, debug=True)


def _request(alloc: PoolAllocator, tokens: np.ndarray) -> int:
    slot = alloc.new_request()
    assert alloc.alloc_mamba(np.array([slot])) is not None
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([len(tokens)]))
    return slot


def _roll(alloc: PoolAllocator, slot: int, tokens: np.ndarray, points: list[int]) -> None:
    """Rolling takes at ``points`` (tokens): each supersedes and drops the one before."""
    previous = None
    for at in points:
        alloc.prefix.insert(slot, tokens[:at])
        old = tokens[:previous] if previous else None
        assert alloc.prefix.checkpoint(slot, tokens[:at], supersedes=old, drop=old is not None)
        previous = at


def test_rolling_takes_supersede_and_evict_nothing():
    alloc = _alloc(slots=4)  # a request slot and spare ones: no take needs room
    states = alloc.parts.prefix.states
    tokens = np.arange(21) + 100
    slot = _request(alloc, tokens)
    _roll(alloc, slot, tokens, [4, 8, 12, 16])
    alloc.check_integrity()
    assert states.saved == 4 and len(states.by_node) == 1, "one checkpoint held: the latest"
    assert states.superseded == 3, "each take after the first replaced the one before"
    assert states.evicted == 0 and alloc.prefix.evicted == 0, "no room was made: no pressure"
    assert alloc.prefix.match(tokens[:17]).num_tokens == 16
    alloc.free_request(slot)


def test_takes_that_need_room_count_only_the_checkpoints_they_evict():
    alloc = _alloc(slots=3, pages=12)  # tight: later conversations evict earlier ones
    states = alloc.parts.prefix.states
    chats = []
    while not states.evicted and len(chats) < 12:
        tokens = np.arange(13) + 100 * (len(chats) + 1)
        slot = _request(alloc, tokens)
        _roll(alloc, slot, tokens, [4, 8, 12])
        alloc.free_request(slot)
        chats.append(tokens)
        alloc.check_integrity()
    assert states.evicted, "the pool is tight enough to evict"
    # each conversation's takes at 4 and 8 were superseded (its 12 replaced them), so
    # its hit is 12 tokens while its last checkpoint stays, else none
    hits = [alloc.prefix.match(t).num_tokens for t in chats]
    assert set(hits) <= {0, 12} and hits[-1] == 12
    assert states.superseded == 2 * len(chats)
    assert states.evicted == hits.count(0), "the evictions are the conversations that lost"
