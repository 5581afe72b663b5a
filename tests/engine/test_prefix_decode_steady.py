"""A steady decode step costs the cache nothing per request (issue 41).

With prefix caching on a hybrid model, a plain decode step (``BatchKind.DECODE``)
calls the cache's per-request work (``PrefixCaching._after_one``: shares, decode
checkpoints) only for the requests with something due in that step: a page that
the step completed past the prompt (a decode checkpoint), or the prompt's last
token fed (its pages shared). The oracle is derived by hand from the prompt
lengths, the page size and the hits (whole pages of all but the last prompt
token), counting the tokens each request fed step by step; the spies record what
the cache did. Tiny Qwen3.5, fp32, a roomy pool, two chat turns (the second hits the first's
last decode checkpoint): greedy tokens equal transformers' and the run without the
cache.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_hybrid,
)
from prefix_fixtures import pool_budget, prefix_llm

from unikv.engine import SamplingParams
from unikv.engine.request import BatchKind
from unikv.hf_config import specs_from_hf_config

pytestmark = pytest.mark.usefixtures("one_thread")

PS, NEW_TOKENS = 8, 16
LENGTHS = (5, 10, 15, 19)  # prompt tokens: each completes its pages at other steps


class Spy:
    """Per engine step: the requests the cache's per-request hook visited and the
    request slots its verbs shared or checkpointed inside ``after_step``; plus, from each step's batch,
    the tokens every request fed (the oracle's input)."""

    def __init__(self, llm) -> None:
        policy, verbs = llm.scheduler.prefix, llm.alloc.prefix
        self.now: dict[str, list] = {"visits": [], "inserts": [], "checkpoints": []}
        self.steps: list[dict] = []
        one, insert, checkpoint = policy._after_one, verbs.insert, verbs.checkpoint
        after = policy.after_step
        self.inside = False  # within ``after_step`` (a finished request's share is not)

        def after_step(*args, **kwargs):
            self.inside = True
            try:
                return after(*args, **kwargs)
            finally:
                self.inside = False

        def visit(r, n, verify):
            self.now["visits"].append(r.request_id)
            return one(r, n, verify)

        def inserted(slot, *args, **kwargs):
            if self.inside:
                self.now["inserts"].append(int(slot))
            return insert(slot, *args, **kwargs)

        def checkpointed(slot, *args, **kwargs):
            if self.inside:
                self.now["checkpoints"].append(int(slot))
            return checkpoint(slot, *args, **kwargs)

        both = verbs.share_checkpoint  # (insert and checkpoint in one chain walk)

        def shared_and_checkpointed(slot, *args, **kwargs):
            if self.inside:
                self.now["inserts"].append(int(slot))
                self.now["checkpoints"].append(int(slot))
            return both(slot, *args, **kwargs)

        policy._after_one, verbs.insert, verbs.checkpoint = visit, inserted, checkpointed
        verbs.share_checkpoint = shared_and_checkpointed
        policy.after_step = after_step
        sched = llm.scheduler
        schedule = sched.schedule
        self.slots: dict[int, int] = {}  # request id -> its slot in the step scheduled last

        def scheduled():
            batch = schedule()
            self.slots = {r.request_id: r.slot for r in batch.requests}
            return batch

        sched.schedule = scheduled

    def on_step(self, llm, batch, logits) -> None:
        fed = {r.request_id: n for r, n in zip(batch.requests, batch.num_new)}
        self.steps.append({**self.now, "kind": batch.kind, "fed": fed, "slots": self.slots})
        self.now = {k: [] for k in self.now}


def due_by_hand(
    steps: list[dict], prompts: dict[int, int], hits: dict[int, int]
) -> list[tuple[set, set]]:
    """Per step, (the requests whose one-token step completed a page past the prompt,
    those whose one-token step fed the prompt's last token), from the tokens each fed
    since its hit (``t``: held after the step)."""
    held, out = dict(hits), []
    for step in steps:
        fills, ends = set(), set()
        for rid, n in step["fed"].items():
            held[rid] += n
            t, p = held[rid], prompts[rid]
            if n == 1 and t % PS == 0 and t > p:
                fills.add(rid)
            elif n == 1 and t == p:
                ends.add(rid)
        out.append((fills, ends))
    return out


def test_steady_decode_steps_make_no_per_request_cache_call(tmp_path):
    path = str(tmp_path / "qwen3_5")
    hf = save_tiny_hybrid("qwen3_5", path)
    g = torch.Generator().manual_seed(7)
    first = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    configs = specs_from_hf_config(path, page_size=PS, dtype=torch.float32)
    kw = {"max_num_batched_tokens": 128, "max_model_len": 64,
          "kv_cache_bytes": pool_budget(configs, 96, state_slots=24)}  # fmt: skip
    plain, llm = prefix_llm(path, PS, False, **kw), prefix_llm(path, PS, True, **kw)
    steady = fills = 0
    prompts = first
    for turn in range(2):
        want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        assert [o.output_ids for o in plain.generate(prompts, params)] == want
        spy = Spy(llm)
        outs = llm.generate(prompts, params, on_step=spy.on_step)
        assert [o.output_ids for o in outs] == want, f"turn {turn}"
        # the second turn (prompt, answer, a 3-token message) hits the first's last
        # decode checkpoint: its last whole page of the tokens it computed
        hits = [0] * 4 if turn == 0 else [(n + NEW_TOKENS - 1) // PS * PS for n in LENGTHS]
        assert [o.num_cached_tokens for o in outs] == hits, f"turn {turn}"
        ids = sorted({rid for s in spy.steps for rid in s["fed"]})
        assert len(ids) == len(prompts)
        order = dict(zip(ids, range(len(prompts))))  # request ids in submission order
        lengths = {rid: len(prompts[i]) for rid, i in order.items()}
        due = due_by_hand(spy.steps, lengths, {rid: hits[i] for rid, i in order.items()})
        for k, (step, (fill, end)) in enumerate(zip(spy.steps, due)):
            if step["kind"] is not BatchKind.DECODE:
                continue  # (a step with prefill rows visits every request)
            what = f"turn {turn}, step {k}: fed {step['fed']}"
            assert step["visits"] == sorted(fill | end), f"{what}: visited {step['visits']}"
            slots = step["slots"]
            # checkpoints only where a decode completed a page; on the first turn at
            # each (every request holds its prompt-end one: the rule pays on CPU)
            taken, filled = sorted(step["checkpoints"]), sorted(slots[rid] for rid in fill)
            assert taken == filled if turn == 0 else set(taken) <= set(filled), what
            assert set(step["inserts"]) <= {slots[rid] for rid in fill | end}, what
            assert {slots[rid] for rid in end} <= set(step["inserts"]), what
            steady += not (fill or end)
            fills += len(fill)
        extra = [torch.randint(0, VOCAB, (3,), generator=g).tolist() for _ in prompts]
        prompts = [p + o.output_ids + m for p, o, m in zip(prompts, outs, extra)]
    assert steady >= 8 and fills >= 10, (steady, fills)  # both kinds of step happened
    llm.alloc.check_integrity()
