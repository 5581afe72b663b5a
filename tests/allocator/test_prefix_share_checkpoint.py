"""``prefix.share_checkpoint`` (a decode take's insert and checkpoint in one chain walk,
issue 41) leaves the cache as ``insert`` then ``checkpoint`` do.

Two twin allocators run the same script: one through the two verbs (the
checkpoint's node and the superseded one looked up from the request's tokens), one
through ``share_checkpoint`` (both walked back from the chain end its insert
reached). The script covers rolling takes that supersede the one before, a take
after a declined boundary (two new pages), a request whose pages repeat another's
tokens (its chain end is the other request's node, whose checkpoint it may reuse),
and tight pools whose takes evict other conversations' checkpoints. Compared: every
lookup's hit, the checkpoints held (their tokens) and the counters; integrity after
each step.
"""

from __future__ import annotations

import numpy as np
import pytest
from allocator_fixtures import full_config

from unikv.allocator import PoolAllocator
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, StatePart

PS = 4


def _alloc(slots: int, pages: int) -> PoolAllocator:
    state = MambaSpec(1, (StatePart((3,)),), StatePart((29,)))
    configs = [full_config(PS), SubPoolConfig("mamba", state)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages, "mamba": slots}))
    return PoolAllocator(pool, max_requests=4, max_context=64, debug=True)


def _take(alloc, fused: bool, slot: int, tokens: np.ndarray, at: int, previous: int) -> bool:
    if fused:
        return alloc.prefix.share_checkpoint(slot, tokens, at, previous=previous, drop=True)
    alloc.prefix.insert(slot, tokens)
    old = tokens[:previous] if previous else None
    return alloc.prefix.checkpoint(slot, tokens[:at], supersedes=old, drop=old is not None)


def _state(alloc, chats: list[np.ndarray]) -> tuple:
    states = alloc.parts.prefix.states
    hits = [alloc.prefix.match(t[: n + 1]).num_tokens for t in chats for n in range(len(t))]
    held = sorted(states.position.get(n, -1) for n in states.by_node)
    return hits, held, states.saved, states.superseded, states.evicted, states.copied


def _script(fused: bool, slots: int, pages: int) -> list[tuple]:
    alloc = _alloc(slots, pages)
    rng = np.random.default_rng(3)
    chats = [rng.integers(0, 50, 21) for _ in range(3)]
    chats.append(chats[0].copy())  # a repeat: its pages are the first one's tokens
    out = []
    # (conversation, [points]) in order; 0 before a point: none superseded
    for c, points in enumerate([[4, 8, 16], [8, 12], [4, 12, 20], [8, 16]]):
        slot = alloc.new_request()
        assert alloc.alloc_mamba(np.array([slot])) is not None
        tokens = chats[c]
        assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([len(tokens)]))
        previous = 0
        for at in points:
            taken = _take(alloc, fused, slot, tokens[:at], at, previous)
            previous = at if taken else previous
            alloc.check_integrity()
            out.append((taken, *_state(alloc, chats)))
        alloc.free_request(slot)
        out.append(_state(alloc, chats))
    return out


@pytest.mark.parametrize("slots, pages", [(8, 64), (3, 12), (2, 10)])
def test_share_checkpoint_equals_insert_then_checkpoint(slots, pages):
    plain, fused = _script(False, slots, pages), _script(True, slots, pages)
    assert fused == plain
    assert any(step[0] for step in plain if len(step) == 7), "some takes happened"
