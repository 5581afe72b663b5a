"""A hybrid chat's turn ends survive until the next turn hits them (issue 41, item 1).

End to end on CPU (fp32, torch reference kernels), tiny Qwen3.5 (Gated DeltaNet + full
attention), page 4:

- four conversations x three turns, round-robin (each round one ``generate`` of every
  conversation's next turn), in a pool of 20 pages and 10 state slots: every later
  turn hits the whole pages of its previous prompt and answer. Before, the round's
  admissions evicted the turn ends the other waiting turns of the round would hit (a
  page shortfall evicted as many checkpoints as pages short, oldest first), and every
  third turn missed. Tokens equal the run without the cache and transformers'.
- a turn stopped by a stop token right on a page boundary that the cost rule declined
  (reuse below 1 while it could go on): no checkpoint is taken from its live slot as
  it finishes (the step planned ahead has fed the stop token by then), so the next
  turn hits its prompt's last whole page with transformers' tokens (a finish-time
  take tried here gave wrong tokens).

Independent derivations: the ideal hit is the whole pages of the previous prompt and
answer less the never-fed last token (``(len - 1) // ps * ps``), counted from the
tokens alone; the tokens are transformers' ``generate`` on the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread, save_tiny_hybrid  # noqa: F401
from prefix_fixtures import pool_budget, prefix_llm

from unikv.engine import SamplingParams
from unikv.engine.checkpoint_rule import CheckpointRule
from unikv.hf_config import specs_from_hf_config

pytestmark = pytest.mark.usefixtures("one_thread")

PS = 4


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_5"))
    return path, save_tiny_hybrid("qwen3_5", path)


def _chat(llm, convs: int, turns: int, new: int, seed: int):
    """Round-robin chat on ``llm``: (each round's prompts, outputs, ideal hits)."""
    g = torch.Generator().manual_seed(seed)
    msgs = [[torch.randint(0, VOCAB, (PS + 2,), generator=g).tolist() for _ in range(turns)]
            for _ in range(convs)]  # fmt: skip
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    history, rounds = [[] for _ in range(convs)], []
    for t in range(turns):
        prompts = [history[c] + msgs[c][t] for c in range(convs)]
        ideal = [(len(h) - 1) // PS * PS if h else 0 for h in history]
        outs = llm.generate(prompts, params)
        rounds.append((prompts, outs, ideal))
        history = [p + o.output_ids for p, o in zip(prompts, outs)]
    return rounds


def test_a_round_robin_chat_hits_every_previous_turn_end(hybrid):
    path, hf = hybrid
    configs = specs_from_hf_config(path, page_size=PS, dtype=torch.float32)
    kw = {"kv_cache_bytes": pool_budget(configs, 20, state_slots=10), "max_model_len": 96}
    kw["max_num_batched_tokens"] = 64
    new = 2 * PS + 3
    plain = _chat(prefix_llm(path, PS, False, **kw), 4, 3, new, seed=5)
    llm = prefix_llm(path, PS, True, **kw)
    cached = _chat(llm, 4, 3, new, seed=5)
    for (prompts, outs, ideal), (_, base, _) in zip(cached, plain):
        got = [o.output_ids for o in outs]
        assert got == [o.output_ids for o in base], "tokens differ from the run without the cache"
        assert got == [hf_greedy(hf, p, new) for p in prompts], "tokens differ from transformers"
        hits = [o.num_cached_tokens for o in outs]
        assert hits == ideal, f"each turn hits its previous turn end: {hits} vs {ideal}"
    states = llm.alloc.parts.prefix.states
    assert states.evicted > 0, "the pool is tight enough to evict checkpoints"
    assert not states.wanted, "no waiting request is left expecting a checkpoint"
    llm.alloc.check_integrity()


def test_a_turn_stopped_on_a_page_boundary_restores_no_state_past_its_stop(hybrid):
    """The cost rule declines every decode boundary short of ``max_tokens`` (a copy
    dearer than any recompute it might save); the turn stops by a stop token whose
    position leaves its computed tokens (the stop token is never fed) on a page
    boundary. A checkpoint taken from the live slot as it finishes would hold the
    state after the stop token too (the step planned ahead fed it before the stop was
    seen): the next turn must hit only a state taken at a boundary (its prompt's last
    whole page here) and give transformers' tokens."""
    path, hf = hybrid
    g = torch.Generator().manual_seed(4)
    first = torch.randint(0, VOCAB, (PS + 2,), generator=g).tolist()
    free_run = hf_greedy(hf, first, 4 * PS)
    # the stop token's index j: computed tokens len(first) + j on a page boundary,
    # past the first decode boundary, the token not seen before (it stops there)
    cut = next(
        j
        for j in range(PS + 1, 4 * PS)
        if (len(first) + j) % PS == 0 and free_run[j] not in free_run[:j]
    )
    llm = prefix_llm(path, PS, True)
    llm.scheduler.prefix.rule = CheckpointRule(copy_s=1e3, prefill_tokens_per_s=1.0)
    stop = SamplingParams(max_tokens=4 * PS, stop_token_ids=(free_run[cut],), temperature=0.0)
    (turn,) = llm.generate([first], stop)
    assert turn.finish_reason == "stop" and turn.output_ids == free_run[: cut + 1]
    second = first + turn.output_ids + torch.randint(0, VOCAB, (3,), generator=g).tolist()
    (nxt,) = llm.generate([second], SamplingParams(max_tokens=6, temperature=0.0))
    assert (len(first) + cut) % PS == 0  # the stop token was never fed
    assert nxt.num_cached_tokens == (len(first) - 1) // PS * PS
    assert nxt.output_ids == hf_greedy(hf, second, 6)
    llm.alloc.check_integrity()


def test_an_aborted_waiting_turn_leaves_no_expected_checkpoint(hybrid):
    """A turn added to the waiting queue marks the turn end its prompt would restore
    (``Scheduler.add`` -> ``PrefixCaching.expect``); aborted before it opens, the mark
    goes (``Scheduler.finish``), and the next turn that does open hits it."""
    from unikv.engine.request import Request

    path, hf = hybrid
    g = torch.Generator().manual_seed(6)
    first = torch.randint(0, VOCAB, (PS + 2,), generator=g).tolist()
    llm = prefix_llm(path, PS, True)
    params = SamplingParams(max_tokens=2 * PS + 3, temperature=0.0)
    (turn,) = llm.generate([first], params)
    second = first + turn.output_ids + torch.randint(0, VOCAB, (3,), generator=g).tolist()
    prefix, states = llm.alloc.parts.prefix, llm.alloc.parts.prefix.states
    end = (len(first) + len(turn.output_ids) - 1) // PS * PS  # the turn end, whole pages
    node = prefix.walk(np.array(second[:end], np.int64))[-1].node_id
    waiting = Request(10**6, list(second), params, 0, frozenset(), 96)
    llm.scheduler.add(waiting)
    assert dict(states.wanted) == {node: 1}, "the waiting turn expects its turn end"
    llm.scheduler.finish(waiting, "abort")
    assert not states.wanted and not llm.scheduler.waiting
    llm.alloc.check_integrity()
    (nxt,) = llm.generate([second], SamplingParams(max_tokens=4, temperature=0.0))
    assert nxt.num_cached_tokens == end and nxt.output_ids == hf_greedy(hf, second, 4)
    assert not states.wanted
