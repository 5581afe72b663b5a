"""A rolling decode checkpoint drops the request's own superseded one BEFORE making
room for itself (issue 41): the take must not evict another conversation's
checkpoint while the one it replaces still holds a state slot.

Two conversations through the engine's own prefix policy (``PrefixCaching`` over a
``PoolAllocator`` on a CPU pool; no model: the allocator's verbs stand in for the
forward). Conversation B's first turn leaves a prompt-end checkpoint and finishes.
Conversation A decodes past two page boundaries: its checkpoint at the first is
superseded by the one at the second. The Mamba band holds A's live slot and two
checkpoints, no more, so the second take needs a slot. Today's order (take, then
drop the superseded) evicts B's checkpoint, the oldest, and B's next turn misses;
dropping A's own first keeps B's, so B's next turn hits its whole first turn.

Independent derivation: the hit is read from ``alloc.prefix.match`` (a second walk
of the cache, not the policy's bookkeeping) and compared to the ideal, the whole
pages of B's first turn; the recomputed tokens are the next turn's prompt less it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from allocator_fixtures import full_config

from unikv.allocator import PoolAllocator
from unikv.engine.checkpoint_rule import CheckpointRule
from unikv.engine.prefix_policy import PrefixCaching
from unikv.engine.request import Request
from unikv.engine.sampling import SamplingParams
from unikv.pool import SubPoolConfig, UnifiedPool
from unikv.specs import MambaSpec, StatePart

PS = 4


def _engine(checkpoint_slots: int) -> tuple[PoolAllocator, PrefixCaching]:
    """A pool of exactly: the sink, five full pages (B's two cached ones and A's
    three) and A's live state slot plus ``checkpoint_slots``. A state slot (128 B)
    is two full pages (64 B), so the page A's ninth token needs fits, and no slot is
    left over for the checkpoint at 12."""
    state = MambaSpec(1, (StatePart((3,)),), StatePart((29,)))  # 32 float32: 128 B
    configs = [full_config(PS), SubPoolConfig("mamba", state)]
    page, slot = (c.spec.page_bytes(c.page_size) for c in configs)
    assert (page, slot) == (64, 128)
    pool = UnifiedPool(configs, slot + 5 * page + (1 + checkpoint_slots) * slot)  # sink: a slot
    assert pool.sink_bytes == slot
    alloc = PoolAllocator(pool, max_requests=2, max_context=32, debug=True)
    return alloc, PrefixCaching(alloc, True, False, CheckpointRule(every_page=True))


def _request(rid: int, prompt: list[int], new: int) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=new), 0, frozenset(), 32)


def _run(alloc: PoolAllocator, policy: PrefixCaching, r: Request, output: list[int]) -> None:
    """Admit ``r`` and run it to its end as ``Scheduler.schedule`` and ``complete`` do:
    its prompt in chunks (each reserving the checkpoint slot of the point it reaches:
    ``before_step``), then one token a step, each step's
    sample (the next of ``output``) appended once every known token is in; at the
    end its pages are shared and its slot freed."""
    policy.open(r)
    slot = np.array([r.slot])
    assert alloc.alloc_mamba(slot) is not None
    while r.finish_reason is None:
        n = policy.chunk(r, 64)
        assert alloc.alloc_extend(slot, np.array([r.num_cached]), np.array([n]))
        policy.before_step(SimpleNamespace(requests=[r], num_new=[n]))
        r.num_cached += n
        if r.num_cached == r.seq_len:
            r.append(output[len(r.output_ids)])
        policy.after_step(SimpleNamespace(requests=[r], num_new=[n]))
    policy.share(r)
    alloc.free_request(r.slot)


def _scenario() -> tuple[int, int, dict]:
    alloc, policy = _engine(checkpoint_slots=2)
    states = alloc.parts.prefix.states
    b_prompt, b_out = list(range(100, 109)), [109]
    b = _request(0, b_prompt, 1)
    _run(alloc, policy, b, b_out)
    assert len(states.by_node) == 1, "B's first turn leaves its prompt-end checkpoint"
    a = _request(1, list(range(200, 204)), 9)
    _run(alloc, policy, a, list(range(300, 309)))  # decode checkpoints at 8 and 12
    alloc.check_integrity()
    a_next = a.prompt_ids + a.output_ids + list(range(400, 405))
    assert alloc.prefix.match(a_next[:-1]).num_tokens == 12, "A's turn end stays cached"
    b_next = b_prompt + b_out + list(range(110, 115))
    hit = alloc.prefix.match(b_next[:-1]).num_tokens
    return hit, len(b_next) - 1 - hit, {"evicted_by_takes": states.evicted_by_takes}


def test_superseded_decode_checkpoint_goes_before_another_conversations():
    hit, recomputed, counts = _scenario()
    ideal = 8  # B's first turn: 9 prompt tokens, its last whole page ends at 8
    assert hit == ideal, f"B's next turn hits its first turn's checkpoint, got {hit}"
    assert recomputed == 14 - ideal
    assert counts["evicted_by_takes"] == 0, "no take evicted another chain's checkpoint"


def test_a_take_with_no_superseded_checkpoint_still_makes_room():
    """Control: with no superseded checkpoint of its own (one state slot for
    checkpoints), A's first decode take evicts B's, as before: the order changes
    only what goes first, not whether room is made."""
    alloc, policy = _engine(checkpoint_slots=1)
    states = alloc.parts.prefix.states
    b = _request(0, list(range(100, 109)), 1)
    _run(alloc, policy, b, [109])
    a = _request(1, list(range(200, 204)), 5)
    _run(alloc, policy, a, list(range(300, 305)))  # one decode checkpoint, at 8
    assert states.evicted_by_takes == 1 and len(states.by_node) == 1
    assert alloc.prefix.match(list(range(200, 204)) + list(range(300, 305))).num_tokens == 8
    alloc.check_integrity()
