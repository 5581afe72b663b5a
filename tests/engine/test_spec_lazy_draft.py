"""A draft model past the batch-size rule is lazy (``speculative/draft.py``): the
rule's plain decode steps run no draft forward, and the missed rows are written by
one extend (``DraftModel.catch_up``) when speculation resumes, or before the pages
are shared with the prefix cache.

The oracle of "resumption is exact": the target as its own draft accepts every
greedy draft only when the draft's K/V rows are the target's, rows the lazy steps
skipped included; tokens equal transformers' greedy ones. A spy on the draft's
forwards shows none during the rule's steps.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, assert_pages_returned, hf_greedy, one_thread, save_tiny_model  # noqa: F401

from unikv.engine import LLM, SamplingParams
from unikv.engine.request import BatchKind
from unikv.engine.speculative.draft import DraftModel
from unikv.placement import pool_bytes_for, worst_case_pages

pytestmark = pytest.mark.usefixtures("one_thread")
LIMIT = 2  # disable_by_batch_size: 3 or 4 requests decoding are past it


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("llama"))
    return path, save_tiny_model("llama", path)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 11, 9, 14)]


def make_llm(path: str, ps: int, **kw) -> LLM:
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
            "disable_by_batch_size": LIMIT}  # fmt: skip
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, **kw}
    return LLM(path, device="cpu", dtype=torch.float32, page_size=ps, debug=True,
               speculative_config=spec, **kw)  # fmt: skip


class Spy:
    """Counts the draft's forwards per launched step (and where they ran: a plain
    decode step past the rule, or elsewhere) and its catch-up extends."""

    def __init__(self, llm: LLM, m) -> None:
        self.rule_steps = self.rule_forwards = self.forwards = self.catch_ups = 0
        runner, launch = llm.runner, llm.runner.launch
        forward, catch_up = DraftModel.forward_plan, DraftModel.catch_up

        def spy_forward(draft, *a, **k):
            self.forwards += 1
            return forward(draft, *a, **k)

        def spy_catch_up(draft, requests):
            runs = catch_up(draft, requests)
            self.catch_ups += runs
            return runs

        def spy_launch(batch, prev=None):
            before = self.forwards
            out = launch(batch, prev)
            if batch.kind is BatchKind.DECODE and len(batch.requests) > LIMIT:
                self.rule_steps += 1
                self.rule_forwards += self.forwards - before
            return out

        m.setattr(DraftModel, "forward_plan", spy_forward)
        m.setattr(DraftModel, "catch_up", spy_catch_up)
        m.setattr(runner, "launch", spy_launch)


def run(llm: LLM, items, params, monkeypatch):
    with monkeypatch.context() as m:
        spy = Spy(llm, m)
        out = [o.output_ids for o in llm.generate(items, params)]
    return out, spy


def exact(llm: LLM) -> None:
    """The target as its own draft: every draft accepted, some drafted."""
    s = llm.stats
    assert s.spec_verify_steps > 0 and s.spec_accepted_tokens == s.spec_draft_tokens > 0, (
        s.spec_accepted_tokens,
        s.spec_draft_tokens,
    )


@pytest.mark.parametrize("ps", [1, 4])
def test_rule_steps_run_no_draft_and_resumption_is_exact(llama, ps, monkeypatch):
    """Lengths 6, 8, 20 and 24: while more than 2 decode, no draft forward runs;
    once 2 are left the draft catches up and every draft is accepted."""
    path, hf = llama
    items = prompts()
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 8, 20, 24)
    ]
    llm = make_llm(path, ps, enable_prefix_caching=False)
    got, spy = run(llm, items, params, monkeypatch)
    assert got == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(items, params)]
    assert spy.rule_steps >= 4 and spy.rule_forwards == 0
    assert spy.catch_ups > 0
    exact(llm)
    assert_pages_returned(llm)


def test_shared_pages_hold_caught_up_rows(llama, monkeypatch):
    """Prefix caching on: four requests finish past the rule (their draft rows
    lagging) and share their pages unwritten (no catch-up: the pages are marked
    stale); the next turn, alone, hits those pages, catches the stale rows up before
    its first proposal and accepts every draft."""
    path, hf = llama
    items = prompts()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, 4, enable_prefix_caching=True)
    got, spy = run(llm, items, params, monkeypatch)
    assert got == [hf_greedy(hf, p, 10) for p in items]
    assert spy.rule_forwards == 0 and spy.catch_ups == 0 and llm.stats.spec_verify_steps == 0
    turn = items[1] + got[1] + [5]
    again, spy = run(llm, [turn], params, monkeypatch)
    assert spy.catch_ups > 0  # the hit's stale rows, before its first proposal
    assert again == [hf_greedy(hf, turn, 10)]
    assert llm.alloc.prefix.counters()["hit_tokens"] >= 16
    exact(llm)
    assert_pages_returned(llm)


def test_lazy_draft_under_preemption(llama, monkeypatch):
    """A pool that preempts (recompute, prefix caching on) while the rule holds:
    eight requests, same tokens as transformers, every draft accepted."""
    path, hf = llama
    items = prompts() + prompts()[::-1]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    configs = llm_configs(path)
    pages = worst_case_pages(configs[0].spec, 4, 64, 32) + 1  # one request alone, barely
    budget = pool_bytes_for(configs, {"full": pages, "draft_full": pages})
    llm = make_llm(path, 4, kv_cache_bytes=budget, enable_prefix_caching=True)
    got, spy = run(llm, items, params, monkeypatch)
    assert got == [hf_greedy(hf, p, 24) for p in items]
    assert llm.stats.preemptions > 0 and spy.rule_steps > 0 and spy.rule_forwards == 0
    exact(llm)
    assert_pages_returned(llm)


def llm_configs(path: str) -> list:
    from unikv.engine.speculative.draft import draft_subpool_configs
    from unikv.hf_config import specs_from_hf_config

    target = specs_from_hf_config(path, page_size=4, dtype=torch.float32)
    return target + draft_subpool_configs(path, target, 4, torch.float32)


@pytest.mark.gpu
def test_lazy_draft_and_head_on_gpu(llama, monkeypatch, tmp_path):
    """On CUDA (decode graphs in the rule's steps, fp32): the target as its own lazy
    draft accepts every draft after resumption, and a lazy EAGLE-3 head (its stash
    written from the graphs' exported hidden states) gives the tokens of plain
    decoding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mtp_fixtures import save_tiny_eagle3

    path, hf = llama
    items = prompts()
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 8, 20, 24)
    ]
    kw = {"device": "cuda", "debug": False, "enable_prefix_caching": False}
    llm = LLM(path, dtype=torch.float32, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=64, speculative_config={"method": "draft_model", "model": path,
              "num_speculative_tokens": 3, "disable_by_batch_size": LIMIT}, **kw)  # fmt: skip
    assert llm.runner.graphs is not None
    got, spy = run(llm, items, params, monkeypatch)
    assert got == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(items, params)]
    assert spy.rule_steps >= 4 and spy.rule_forwards == 0
    exact(llm)
    target = str(tmp_path / "llama6")
    hf6 = save_tiny_model("llama", target, num_hidden_layers=6)
    head = str(tmp_path / "eagle3")
    save_tiny_eagle3(head, hf6.config)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3,
            "disable_by_batch_size": LIMIT}  # fmt: skip
    llm = LLM(target, dtype=torch.float32, page_size=4, max_num_seqs=4, max_model_len=64,
              max_num_batched_tokens=32, speculative_config=spec, **kw)  # fmt: skip
    out = [o.output_ids for o in llm.generate(items, params)]
    assert out == [hf_greedy(hf6, p, sp.max_tokens) for p, sp in zip(items, params)]
    assert llm.stats.spec_verify_steps > 0
