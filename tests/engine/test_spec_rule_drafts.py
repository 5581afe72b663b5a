"""Past the batch-size rule a draft costs nothing (issue 42: "at B = 64 speculation
is never slower than without"): the rule's steps run no draft forward and no
catch-up, also as requests leave with prefix caching on; a draft model catches up
only when the batch falls under the rule, and only for the requests that speculate.

Oracles: the same engine without ``speculative_config`` (ops per step, counted by
``test_spec_rule_ops.step_costs``), transformers' greedy tokens, and the target as
its own draft, which accepts every draft only when its rows are the target's.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread, save_tiny_model  # noqa: F401
from test_spec_rule_ops import step_costs

from unikv.engine import LLM, SamplingParams
from unikv.engine.speculative.draft import DraftModel
from unikv.engine.speculative.mtp import HiddenDraft

pytestmark = pytest.mark.usefixtures("one_thread")
LIMIT = 2
KW = {"device": "cpu", "dtype": torch.float32, "page_size": 4, "max_num_seqs": 4,
      "max_num_batched_tokens": 32, "max_model_len": 64, "kv_cache_bytes": 16 << 20}  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp("llama6"))
    return path, save_tiny_model("llama", path, num_hidden_layers=6)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 11, 9, 14)]


def draft_spec(path: str) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
            "disable_by_batch_size": LIMIT}  # fmt: skip


class Spy:
    """A draft's forwards and catch-up extends (with the requests they caught up)."""

    def __init__(self, m, cls) -> None:
        self.forwards, self.extends, self.caught = 0, 0, []
        forward, catch_up, extend = cls.forward_plan, cls.catch_up, cls._extend

        def spy_forward(draft, *a, **k):
            self.forwards += 1
            return forward(draft, *a, **k)

        def spy_catch_up(draft, requests, *a, **k):
            self.caught += [r.request_id for r in requests if r.draft_lag is not None]
            return catch_up(draft, requests, *a, **k)

        def spy_extend(draft, spans):
            self.extends += 1
            return extend(draft, spans)

        m.setattr(cls, "forward_plan", spy_forward)
        m.setattr(cls, "catch_up", spy_catch_up)
        m.setattr(cls, "_extend", spy_extend)


def test_rule_run_makes_no_draft_work(llama, monkeypatch):
    """Four requests, all decoding past the rule until they finish, prefix caching on
    (their pages are shared as they leave): no draft forward and no catch-up extend
    in the decode steps, finishes included; each decode step dispatches the plain
    engine's ops, plus at most 6 where a page fills (here most steps: four lengths):
    the draft sub-pool's page bound in the step's one table write (the torch reference writes each table apart; on
    CUDA it is the same launch). The draft's tables are neither built nor planned
    (``Scheduler._tables_for``; before, 43 more ops every step). Before that, the
    step where they finished ran a catch-up extend each (thousands of ops)."""
    path, hf = llama
    items = prompts()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = {**KW, "max_num_batched_tokens": 64}  # one prefill step: they decode together
    plain = step_costs(LLM(path, enable_prefix_caching=True, **kw), items, params, monkeypatch)
    llm = LLM(path, enable_prefix_caching=True, speculative_config=draft_spec(path), **kw)
    with monkeypatch.context() as m:
        spy = Spy(m, DraftModel)
        spec = step_costs(llm, items, params, monkeypatch)
    assert [c[:2] for c in spec] == [c[:2] for c in plain]
    decodes = [(s, p) for s, p in zip(spec, plain) if s[0] == "DECODE"]
    assert len(decodes) == 9 and all(s[1] == 4 for s, _ in decodes)
    extra = [s[2] - p[2] for s, p in decodes]  # a draft page bound as a page fills
    assert all(0 <= e <= 6 for e in extra), extra
    extends = len(spec) - len(decodes)  # the prefill step runs the draft (its invariant)
    assert spy.forwards == extends == 1 and spy.extends == 0 and not spy.caught
    assert [o.output_ids for o in llm.generate(items, params)] == [
        hf_greedy(hf, p, 10) for p in items
    ]


def test_catch_up_only_for_requests_that_speculate(llama, monkeypatch):
    """Lengths 4, 5, 20 and 24, caching on: the two short requests finish past the
    rule and are never caught up; the two long ones are, once, when the batch falls
    under the rule; every draft after that is accepted; tokens are transformers'."""
    path, hf = llama
    items = prompts()
    lengths = (4, 5, 20, 24)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    llm = LLM(path, enable_prefix_caching=True, speculative_config=draft_spec(path), **KW)
    with monkeypatch.context() as m:
        spy = Spy(m, DraftModel)
        outs = llm.generate(items, params)
    assert [o.output_ids for o in outs] == [
        hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(items, params)
    ]
    ids = [o.request_id for o in outs]
    assert sorted(spy.caught) == sorted(ids[2:]) and spy.extends >= 1
    s = llm.stats
    assert s.spec_verify_steps > 0 and s.spec_accepted_tokens == s.spec_draft_tokens > 0


def test_head_runs_nothing_for_requests_leaving_past_the_rule(tmp_path_factory, monkeypatch):
    """An EAGLE-3 head past the rule, prefix caching on (the pages stay): the four
    requests decode 9 lazy steps and finish there; the head neither runs nor catches
    up, as they leave too: their 4 x 9 lazy rows are zeroed (``spec_head_hole_rows``) and each
    one's first page holding one recorded (its pages are shared); tokens are
    transformers'. Before, they left through one catch-up extend."""
    from mtp_fixtures import save_tiny_eagle3

    target = str(tmp_path_factory.mktemp("llama6"))
    hf = save_tiny_model("llama", target, num_hidden_layers=6)
    head = str(tmp_path_factory.mktemp("eagle3"))
    save_tiny_eagle3(head, hf.config)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3,
            "disable_by_batch_size": LIMIT}  # fmt: skip
    kw = {**KW, "max_num_batched_tokens": 64}  # one prefill step: they finish together
    llm = LLM(target, enable_prefix_caching=True, speculative_config=spec, **kw)
    items = prompts()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with monkeypatch.context() as m:
        spy = Spy(m, HiddenDraft)
        got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, 10) for p in items]
    assert spy.forwards == 1 and spy.extends == 0 and not spy.caught  # (the prefill's)
    s = llm.stats
    assert s.spec_head_hole_rows == 4 * 9 and s.spec_head_hole_hits == 0
    assert len(llm.runner.draft.holes.stale) == 4
