"""Prefix caching for recurrent hybrids (state checkpoints, ``allocator/checkpoints.py``).

End to end on CPU (fp32, torch reference kernels) with a tiny Qwen3.5 (Gated
DeltaNet + full attention): greedy tokens with hits equal the run without the
cache and transformers' ``generate`` on the same weights, at page sizes 4 and
16, for repeated prompts, prompts sharing part of a page, and a tight pool
with eviction and preemption; ``num_cached_tokens`` counts the whole pages
reused. Allocator level: a checkpoint restores exactly the bytes it copied,
hits fall back to the longest prefix with a checkpoint, checkpoints count as
reclaimable room, and each new integrity invariant fires on its corruption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import full_config, mamba_config
from engine_fixtures import VOCAB, hf_greedy, one_thread, save_tiny_hybrid  # noqa: F401
from prefix_fixtures import (
    chat_turns,
    partial_hit,
    pool_budget,
    prefix_llm,
    run_without_and_with_cache,
    tight_pool_prompts,
)

from unikv.allocator import PoolAllocator
from unikv.engine import LLM, SamplingParams
from unikv.ids import PhysicalPageIds
from unikv.pool import UnifiedPool, pool_bytes_for

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_5"))
    return path, save_tiny_hybrid("qwen3_5", path)


@pytest.mark.parametrize("ps", [4, 16])
def test_hybrid_hits_give_the_tokens_of_no_cache_and_of_transformers(hybrid, ps):
    path, hf = hybrid
    run = run_without_and_with_cache(path, hf, ps, NEW_TOKENS, seed=3)  # whole pages hit
    stats = run.llm.alloc.prefix.counters()
    assert stats["checkpoints"] > 0 and stats["hit_tokens"] >= sum(run.whole_pages)
    run.llm.alloc.check_integrity()
    # prompt 0 checkpoints at 3 pages only; prompt 3 shares 2.5 pages: no checkpoint at 2
    fresh, part = partial_hit(path, ps, run)
    assert part.num_cached_tokens == 0 and part.output_ids == run.want[3]
    other = run.prompts[3][: 2 * ps] + [11, 12, 13]  # the 2 pages prompts 0 and 3 share
    (out,) = fresh.generate([other], run.params)
    assert out.num_cached_tokens == 2 * ps  # prompt 3 checkpointed where it left prompt 0
    assert out.output_ids == hf_greedy(hf, other, NEW_TOKENS)


@pytest.mark.parametrize("ps", [4, 16])
def test_a_chat_turn_hits_the_previous_prompt_and_answer(hybrid, ps):
    """Three chat turns (each prompt = the previous prompt + answer + a message):
    every later turn hits the whole pages of the previous prompt and answer (the
    decode-time checkpoint), not only those of the previous prompt, with
    transformers' tokens."""
    path, hf = hybrid
    llm = prefix_llm(path, ps, True, max_model_len=160)

    def exact(prompt, outputs):
        assert outputs[0].output_ids == hf_greedy(hf, prompt, 2 * ps + 3)

    history = chat_turns(llm, ps, exact)
    llm.alloc.check_integrity()
    (out,) = llm.generate([history[:-3] + [1, 2]], SamplingParams(max_tokens=1, temperature=0.0))
    assert out.num_cached_tokens == (len(history) - 1) // ps * ps  # the last turn's, too


def test_hybrid_tight_pool_evicts_and_preempts_with_the_same_tokens(hybrid):
    from unikv.hf_config import specs_from_hf_config

    path, hf = hybrid
    ps = 4
    prompts = tight_pool_prompts(seed=5)
    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    budget = pool_budget(configs, 14)
    params = SamplingParams(
        max_tokens=2 * NEW_TOKENS, temperature=0.0
    )  # decodes outgrow the pool: preemption
    want = [hf_greedy(hf, p, 2 * NEW_TOKENS) for p in prompts]
    llm = prefix_llm(
        path, ps, True, kv_cache_bytes=budget, max_model_len=48, max_num_batched_tokens=7
    )
    for _ in range(2):
        assert [o.output_ids for o in llm.generate(prompts, params)] == want
    assert llm.scheduler.num_preemptions > 0
    stats = llm.alloc.prefix.counters()
    assert stats["evicted_pages"] > 0 and stats["hit_tokens"] > 0
    assert llm.alloc.parts.prefix.states.evicted > 0
    llm.alloc.check_integrity()


def test_a_one_token_prefill_chunk_among_decodes_feeds_its_own_token(hybrid):
    """Regression (the tight-pool case above): a prefill chunk cut to one token (at
    a state checkpoint, or by the token budget) in a step where every other request
    decodes makes a step of one token per request; that lane must feed the token at
    its ``num_cached``, not its prompt's last token. Here the budget cuts it: 3
    decodes + 1 token of the long prompt, without prefix caching."""
    path, hf = hybrid
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (2, 2, 2, 11)]
    llm = LLM(path, device="cpu", max_num_seqs=4, page_size=4, max_model_len=32,
              max_num_batched_tokens=4, debug=True)  # fmt: skip
    cut = []

    def watch(llm, batch, logits):
        mid = [r.num_cached < len(r.prompt_ids) for r in batch.requests]  # after the step
        cut.append(batch.is_decode and any(mid))

    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=watch
    )
    assert any(cut), "the schedule no longer makes a one-token mid-prompt chunk among decodes"
    assert [o.output_ids for o in outs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


# -- allocator level -------------------------------------------------------------------


def _alloc(ps: int = 4, pages: int = 12, slots: int = 6) -> PoolAllocator:
    configs = [full_config(ps), mamba_config()]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages, "mamba": slots}))
    return PoolAllocator(pool, max_requests=4, max_context=32, debug=True)


def _envelope(alloc: PoolAllocator, slot: int) -> torch.Tensor:
    """Request ``slot``'s state slot envelope (a view of the pool buffer)."""
    phys = alloc.mamba_slots(torch.tensor([slot]))
    return alloc.pool.page_envelope("mamba", int(phys.data[0]))


def _state(alloc: PoolAllocator, slot: int) -> torch.Tensor:
    return _envelope(alloc, slot).clone()


def _serve(alloc: PoolAllocator, tokens: np.ndarray, fill: float) -> int:
    """A request holding ``tokens`` whose state slot holds ``fill`` (as fp32 bytes)."""
    hit = alloc.prefix.match(tokens[:-1])
    slot = alloc.new_request(prefix=hit)
    assert alloc.alloc_mamba(np.array([slot])) is not None
    n = len(tokens) - hit.num_tokens
    assert alloc.alloc_extend(np.array([slot]), np.array([hit.num_tokens]), np.array([n]))
    _envelope(alloc, slot).view(torch.float32).fill_(fill)
    return slot


def _checkpoint(alloc: PoolAllocator, slot: int, tokens: np.ndarray) -> bool:
    """Cache request ``slot``'s pages holding ``tokens`` and checkpoint its state there."""
    alloc.prefix.insert(slot, tokens)
    return alloc.prefix.checkpoint(slot, tokens)


def test_a_hit_restores_exactly_the_checkpointed_bytes():
    alloc = _alloc()
    tokens = np.arange(11)
    a = _serve(alloc, tokens, 1.5)
    assert _checkpoint(alloc, a, tokens[:8])
    saved = _state(alloc, a)
    _envelope(alloc, a).zero_()
    alloc.free_request(a)
    hit = alloc.prefix.match(tokens[:-1])
    assert hit.num_tokens == 8
    b = alloc.new_request(prefix=hit)
    alloc.alloc_mamba(np.array([b]))
    assert torch.equal(_state(alloc, b), saved)  # what was copied, not the later zeroing
    c = alloc.new_request()  # a miss starts from zeros
    alloc.alloc_mamba(np.array([c]))
    assert not _state(alloc, c).any()
    alloc.check_integrity()


def test_a_hit_falls_back_to_the_longest_prefix_with_a_checkpoint():
    alloc = _alloc()
    tokens = np.arange(14)
    a = _serve(alloc, tokens, 2.0)
    assert _checkpoint(alloc, a, tokens[:4])
    alloc.prefix.insert(a, tokens[:12])  # pages 1-2 cached with no checkpoint at their end
    assert alloc.prefix.match(tokens[:-1]).num_tokens == 4
    assert not alloc.prefix.checkpoint(a, tokens[:6])  # not a whole-page boundary
    alloc.free_request(a)
    assert alloc.prefix.match(np.arange(100, 110)).num_tokens == 0


def test_checkpoints_are_reclaimable_room_and_go_with_their_nodes():
    alloc = _alloc(slots=3)  # 3 Mamba slots (the sink aside: fewer)
    prefix, states = alloc.parts.prefix, alloc.parts.prefix.states
    taken = []
    for i in range(6):
        tokens = np.arange(9) + 100 * i
        slot = _serve(alloc, tokens, float(i))
        taken.append(_checkpoint(alloc, slot, tokens[:8]))
        alloc.free_request(slot)
    assert all(taken)  # each took the room of an older one: LRU eviction
    assert states.evicted > 0 and len(states.by_node) >= 1
    assert alloc.can_admit({"mamba": len(states.by_node)}) == (True, True)
    newest = np.arange(9) + 500
    assert alloc.prefix.match(newest[:-1]).num_tokens == 8
    assert alloc.prefix.match(np.arange(8)).num_tokens == 0  # the oldest was evicted
    alloc.parts.writer.write(prefix.evict(prefix.num_evictable))  # nodes gone: checkpoints too
    assert not states.by_node and not states.lru
    alloc.check_integrity()


def _corrupt(alloc: PoolAllocator, how: str) -> None:
    states, book = alloc.parts.prefix.states, alloc.parts.prefix.states.book
    node = next(iter(states.by_node))
    vid = states.by_node[node]
    if how == "unbound":
        book.v2p_host[vid] = -1
    elif how == "orphan":
        states.by_node[10**6] = states.by_node.pop(node)
        states.lru = type(states.lru)((10**6, None) for _ in range(1))
    elif how == "alias":
        book.v2p_host[1] = book.v2p_host[vid]
        alloc.parts.requests.in_use[0] = True
    elif how == "lru":
        states.lru.clear()
    elif how == "byid":
        alloc.parts.prefix.by_id.pop(node)
    elif how == "position":  # recorded one page later than its node's chain
        states.position[node] += alloc.parts.prefix.roles.page_size
    elif how == "demoted":  # a checkpoint marked superseded that is not first to go
        states.demoted.add(next(reversed(states.lru)))
        states.demoted.add(10**7)
    elif how == "unreachable":  # the chain's first node gone, its page with it
        prefix = alloc.parts.prefix
        first = next(n for n in prefix.by_page.values() if n.parent_id == 0)
        del prefix.by_page[first.page], prefix.by_id[first.node_id]


@pytest.mark.parametrize(
    "how, message",
    [
        ("unbound", "checkpoint slots are LIVE Mamba slots owned by the cache"),
        ("orphan", "each checkpoint's node exists"),
        ("alias", "no request slot aliases a checkpoint slot"),
        ("lru", "evictable checkpoints are exactly those no opening request waits"),
        ("byid", "the prefix nodes by id are the live nodes"),
        ("unreachable", "each checkpoint is reachable from the root"),
        ("demoted", "demoted checkpoints are evictable and the first of the LRU"),
        ("position", "each checkpoint was taken at its node's position"),
    ],
)
def test_each_checkpoint_invariant_names_its_corruption(how, message):
    alloc = _alloc()
    tokens = np.arange(9)
    slot = _serve(alloc, tokens, 3.0)
    _checkpoint(alloc, slot, tokens[:8])
    alloc.free_request(slot)
    alloc.check_integrity()
    _corrupt(alloc, how)
    with pytest.raises(AssertionError, match=message):
        from unikv.allocator.checkpoints import check_checkpoints

        check_checkpoints(alloc.parts)


def test_a_checkpoint_restored_at_another_position_is_caught():
    """A checkpoint whose recorded position disagrees with the hit restoring it (a
    state after 12 tokens under the node of 8, say) stops the hit with an assert
    naming it, before any restore is staged."""
    alloc = _alloc()
    tokens = np.arange(11)
    a = _serve(alloc, tokens, 1.5)
    assert _checkpoint(alloc, a, tokens[:8])
    alloc.free_request(a)
    states = alloc.parts.prefix.states
    node = next(iter(states.by_node))
    assert states.position[node] == 8
    states.position[node] = 12
    hit = alloc.prefix.match(tokens[:-1])
    assert hit.num_tokens == 8
    with pytest.raises(AssertionError, match="a hit restores a checkpoint taken at its own"):
        alloc.new_request(prefix=hit)


def test_restore_copies_through_the_pool_only():
    """The restore is the pool's page copy: src and dst slots differ, both Mamba."""
    alloc = _alloc()
    tokens = np.arange(9)
    a = _serve(alloc, tokens, 4.0)
    _checkpoint(alloc, a, tokens[:8])
    vid = next(iter(alloc.parts.prefix.states.by_node.values()))
    ckpt = int(alloc.parts.books["mamba"].v2p_host[vid])
    assert ckpt != int(alloc.mamba_slots(torch.tensor([a])).data[0])
    env = alloc.pool.page_envelope("mamba", ckpt).view(torch.float32)
    assert torch.equal(env, torch.full_like(env, 4.0))
    assert isinstance(alloc.mamba_slots(torch.tensor([a])), PhysicalPageIds)


def test_a_checkpoint_whose_room_evicted_an_ancestor_is_not_taken():
    """Making room for a checkpoint's slot may evict an unreferenced ANCESTOR page
    of its chain (here: B's block-2 node hangs under A's freed blocks 0-1). Such a
    checkpoint would be unreachable; it is refused, and a later lookup of a chain
    whose ancestor was evicted finds no stale checkpoint (found by the hybrid
    prefix state machine, tests/allocator/test_prefix_hybrid_stateful.py)."""
    alloc = _alloc(pages=8, slots=3)
    prefix, t = alloc.parts.prefix, np.arange(13)
    b = alloc.new_request()  # a miss: B holds private copies of blocks 0-1
    alloc.alloc_mamba(np.array([b]))
    alloc.alloc_extend(np.array([b]), np.array([0]), np.array([13]))
    a = alloc.new_request()
    alloc.alloc_extend(np.array([a]), np.array([0]), np.array([9]))
    alloc.prefix.insert(a, t[:8])  # nodes of blocks 0-1 on A's pages
    alloc.prefix.insert(b, t[:12])  # block 2's node on B's page, under A's nodes
    alloc.free_request(a)  # A's pages evictable; B's node referenced
    c = alloc.new_request()
    for s in (c, alloc.new_request(), alloc.new_request()):
        alloc.alloc_mamba(np.array([s]))  # the Mamba room is gone
    alloc.alloc_extend(np.array([c]), np.array([0]), np.array([12]))
    assert prefix.num_evictable == 2
    taken = alloc.prefix.checkpoint(b, t[:12])  # its slot's room evicts blocks 0-1
    assert not taken and not prefix.states.by_node, "an unreachable checkpoint was kept"
    assert alloc.prefix.match(t[:12]).num_tokens == 0
    alloc.check_integrity()


def test_a_superseded_checkpoint_is_evicted_before_older_ones():
    """``demote`` (the policy: a request's prompt-end checkpoint once its first decode
    one is taken) sends a checkpoint to the front of the LRU: when the Mamba sub-pool is
    short, it goes first, ahead of an older one, and the longer one stays."""
    alloc = _alloc(slots=3)  # 3 Mamba slots (the sink aside: fewer)
    states = alloc.parts.prefix.states
    old = np.arange(9) + 1000
    slot = _serve(alloc, old, 1.0)
    assert _checkpoint(alloc, slot, old[:8])
    alloc.free_request(slot)
    turn = np.arange(13)
    slot = _serve(alloc, turn, 2.0)
    assert _checkpoint(alloc, slot, turn[:4]) and _checkpoint(alloc, slot, turn[:12])
    alloc.prefix.demote_checkpoint(turn[:4])
    assert states.num_demoted == 1
    alloc.check_integrity()
    alloc.free_request(slot)
    i = 0
    while not states.evicted:  # more conversations' checkpoints until one must go
        tokens = np.arange(9) + 100 * (i := i + 1)
        slot = _serve(alloc, tokens, float(i))
        assert _checkpoint(alloc, slot, tokens[:8])
        alloc.free_request(slot)
    assert states.evicted == 1 and states.num_demoted == 0
    assert alloc.prefix.match(turn[:4]).num_tokens == 0  # the demoted one went
    assert alloc.prefix.match(old[:8]).num_tokens == 8  # not the oldest
    assert alloc.prefix.match(turn[:12]).num_tokens == 12
    alloc.check_integrity()


@pytest.mark.usefixtures("one_thread")
def test_a_decoding_request_keeps_one_rolling_checkpoint(hybrid):
    """A 10-token prompt decoding 8 tokens at page 4 checkpoints at its prompt's last
    whole page (8) and at each page its decode completes (12, 16): the first decode one
    demotes the prompt-end one (a repeat of the prompt still hits it), the next drops
    its predecessor, so the request holds one and the next turn hits it."""
    path, hf = hybrid
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(8)).tolist()
    llm = prefix_llm(path, 4, True)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert out.output_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    prefix, states = llm.alloc.parts.prefix, llm.alloc.parts.prefix.states
    seq = np.array(prompt + out.output_ids, np.int64)
    node = {k: prefix.walk(seq[:k])[-1].node_id for k in (8, 12, 16)}
    assert states.demoted == {node[8]} and node[12] not in states.by_node
    assert node[16] in states.by_node and llm.alloc.prefix.match(seq[:9]).num_tokens == 8
    assert llm.alloc.prefix.match(seq[:17]).num_tokens == 16
    llm.alloc.check_integrity()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("ps", [4, 16])
def test_a_turn_stopped_by_eos_hits_its_answer_next_turn(hybrid, ps):
    """A chat turn that stops at a stop token (as real chats stop at EOS), not at
    max_tokens: its decode's rolling checkpoint lets the next turn hit the previous
    prompt *and* answer up to its last whole page, with transformers' tokens."""
    path, hf = hybrid
    g = torch.Generator().manual_seed(4)
    first = torch.randint(0, VOCAB, (ps + 2,), generator=g).tolist()
    free_run = hf_greedy(hf, first, 3 * ps)
    cut = next(j for j in range(ps + 3, 3 * ps) if free_run[j] not in free_run[:j])
    llm = prefix_llm(path, ps, True)
    stop = SamplingParams(max_tokens=3 * ps, stop_token_ids=(free_run[cut],), temperature=0.0)
    (turn,) = llm.generate([first], stop)
    assert turn.finish_reason == "stop" and turn.output_ids == free_run[: cut + 1]
    second = first + turn.output_ids + torch.randint(0, VOCAB, (3,), generator=g).tolist()
    (nxt,) = llm.generate([second], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    computed = len(first) + len(turn.output_ids) - 1  # the stop token was never fed
    assert nxt.num_cached_tokens == computed // ps * ps > (len(first) - 1) // ps * ps
    assert nxt.output_ids == hf_greedy(hf, second, NEW_TOKENS)
    llm.alloc.check_integrity()


@pytest.mark.usefixtures("one_thread")
def test_the_cost_rule_skips_a_decode_boundary_and_keeps_the_turn_end(hybrid):
    """With a copy that costs 4.5 tokens of prefill (``CheckpointRule``), a 10-token
    prompt decoding 8 tokens at page 4 (it computes 17 tokens at most) declines the
    boundary at 12 (a 4/5 chance to be the turn end x 4 tokens = 3.2 < 4.5) and takes
    the one at 16 (its last: 1 x 8 tokens since the prompt-end checkpoint at 8 > 4.5):
    one decode copy instead of two, the same tokens, and the next turn hits 16."""
    from unikv.engine.checkpoint_rule import CheckpointRule

    path, hf = hybrid
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(8)).tolist()
    llm = prefix_llm(path, 4, True)
    llm.scheduler.prefix.rule = CheckpointRule(copy_s=0.0045, prefill_tokens_per_s=1000.0)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert out.output_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    prefix, states = llm.alloc.parts.prefix, llm.alloc.parts.prefix.states
    seq = np.array(prompt + out.output_ids, np.int64)
    node = {k: prefix.walk(seq[:k])[-1].node_id for k in (8, 12, 16)}
    assert node[12] not in states.by_node and node[16] in states.by_node
    assert states.demoted == {node[8]} and states.saved == 2  # 8 and 16 only
    assert llm.alloc.prefix.match(seq[:17]).num_tokens == 16
    llm.alloc.check_integrity()


@pytest.mark.usefixtures("one_thread")
def test_the_next_turn_demotes_the_turn_end_it_extended(hybrid):
    """With ``supersede_turns``: turn 1 (10-token prompt, 8 new tokens, page 4) ends
    with a decode checkpoint at 16; turn 2 (its prompt and answer and 3 more tokens)
    hits 16 and takes its own prompt-end checkpoint at 20: the turn end at 16,
    superseded, is demoted (first to go), the answers those of transformers; the
    prompt-end one at 20 is no turn end."""
    path, hf = hybrid
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, VOCAB, (10,), generator=g).tolist()
    llm = prefix_llm(path, 4, True)
    llm.scheduler.prefix.supersede_turns = True  # (off by default)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    (one,) = llm.generate([prompt], params)
    second = prompt + one.output_ids + torch.randint(0, VOCAB, (3,), generator=g).tolist()
    prefix, states = llm.alloc.parts.prefix, llm.alloc.parts.prefix.states
    node16 = prefix.walk(np.array(second[:16], np.int64))[-1].node_id
    assert node16 in states.turn_ends and node16 not in states.demoted
    (two,) = llm.generate([second], params)
    assert two.num_cached_tokens == 16 and two.output_ids == hf_greedy(hf, second, NEW_TOKENS)
    assert node16 in states.demoted
    node20 = prefix.walk(np.array(second[:20], np.int64))[-1].node_id
    assert node20 in states.by_node and node20 not in states.turn_ends
    llm.alloc.check_integrity()
