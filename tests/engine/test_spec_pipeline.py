"""Verify steps planned ahead (``speculative/ahead.py``, ``Speculator.pipeline``):
step N + 1 is launched before step N's acceptance is on the host, planned for N's
full acceptance and moved on the device to where N's acceptance puts it
(``speculative/derive.py``); kept whatever N accepted, dropped only when a request
ended (``test_spec_derive.py`` covers partial acceptance in depth).

Oracles: transformers' greedy tokens and the same engine without pipelining
(forced acceptance, whose tokens are not the model's but are deterministic). A
spy on ``complete_verify`` counts the steps planned ahead that were kept and
dropped, so each case shows which path it took.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_fixtures import VOCAB, assert_pages_returned, hf_greedy, one_thread, save_tiny_model  # noqa: F401

from unikv.engine import LLM, SamplingParams
from unikv.engine.scheduler import Scheduler
from unikv.engine.speculative.config import allow_forced_acceptance

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return path, save_tiny_model("llama", path)


def repetitive(n: int, seed: int = 7) -> list[list[int]]:
    """Prompts of a repeated block: the n-gram lookup finds drafts, some kept."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4,), generator=g).tolist() * 4 for _ in range(n)]


def make_llm(path: str, ps: int, pipeline: bool, force: bool = False, **kw) -> LLM:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "force_accept": force, "pipeline": pipeline}  # fmt: skip
    kw = {"device": "cpu", "debug": True, "max_num_seqs": 4, "max_num_batched_tokens": 64,
          "max_model_len": 96, **kw}  # fmt: skip
    with allow_forced_acceptance():
        llm = LLM(path, dtype=torch.float32, page_size=ps, speculative_config=spec, **kw)
    assert llm.scheduler.spec.pipeline is pipeline
    return llm


def test_pipeline_key():
    """``pipeline`` (unikv's key, default false) takes a bool only."""
    from unikv.engine.speculative.config import speculative_config_of

    base = {"method": "ngram", "num_speculative_tokens": 3}
    assert speculative_config_of(base).pipeline is False
    assert speculative_config_of({**base, "pipeline": True}).pipeline is True
    with pytest.raises(ValueError, match=r"\['pipeline'\] must be a bool, got 'yes'"):
        speculative_config_of({**base, "pipeline": "yes"})


def run(llm: LLM, items, params, monkeypatch) -> tuple[list[list[int]], dict]:
    """(outputs, counts of the steps planned ahead kept / dropped, and the tokens each
    verify step emitted for the first request)."""
    count = {"kept": 0, "dropped": 0, "emitted": []}
    complete = Scheduler.complete_verify

    def spy(sched, batch, emitted, ahead=None):
        count["emitted"].append(len(emitted[0]))
        out = complete(sched, batch, emitted, ahead)
        if ahead is not None:
            count["kept" if sched.kept_ahead else "dropped"] += 1
        return out

    with monkeypatch.context() as m:
        m.setattr(Scheduler, "complete_verify", spy)
        out = [o.output_ids for o in llm.generate(items, params)]
    return out, count


@torch.no_grad()
def check_bonus(hf, prompt: list[int], out: list[int], emitted: list[int]) -> None:
    """Forced acceptance: every verify step's last token (after its drafts, whatever
    they were) is the target's greedy token after everything before it, which holds
    only if the step's rows sat at the right positions over the right K/V."""
    ids = torch.tensor([prompt + out])
    greedy = hf(ids).logits[0].argmax(-1).tolist()
    at = 0  # output 0 is the prefill's
    for n in emitted:
        at += n
        if at < len(out):
            assert out[at] == greedy[len(prompt) + at - 1], (at, out, emitted)


@pytest.mark.parametrize("ps", [1, 4])
def test_forced_acceptance_pipelines_every_step(llama, ps, monkeypatch):
    """One request at forced acceptance: after its first verify step every step is
    planned ahead and kept, and every step's bonus token is the target's."""
    path, hf = llama
    items, params = [repetitive(1)[0]], SamplingParams(max_tokens=40, temperature=0.0)
    llm = make_llm(path, ps, True, force=True)
    got, count = run(llm, items, params, monkeypatch)
    assert count["kept"] >= 6 and count["dropped"] == 0
    assert llm.stats.spec_verify_steps >= count["kept"] + 1
    check_bonus(hf, items[0], got[0], count["emitted"])
    assert_pages_returned(llm)


@pytest.mark.parametrize("ps", [1, 4])
def test_partial_acceptance_keeps_the_step_ahead(llama, ps, monkeypatch):
    """Real n-gram drafts for three requests (prefix caching on; the random model's
    greedy outputs fall into loops that the lookup finds): steps planned ahead are
    kept after partial acceptances too (none dropped: no request ends before its
    max_tokens); greedy tokens are transformers'; a second turn hits the cache and
    still matches."""
    path, hf = llama
    g = torch.Generator().manual_seed(9)
    items = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 13)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, ps, True, enable_prefix_caching=True)
    got, count = run(llm, items, params, monkeypatch)
    assert got == [hf_greedy(hf, p, 40) for p in items]
    assert count["kept"] > 0 and count["dropped"] == 0, count
    assert 1 in count["emitted"]  # a step that rejected its first draft, kept after
    turn = items[0] + got[0]
    again, _ = run(llm, [turn], SamplingParams(max_tokens=12, temperature=0.0), monkeypatch)
    assert again == [hf_greedy(hf, turn, 12)]
    assert llm.alloc.prefix.counters()["hit_tokens"] > 0
    assert_pages_returned(llm)


def test_request_ends_inside_an_accepted_run(llama, monkeypatch):
    """Forced acceptance, one request: a stop token that is a step's last token (the
    step after it was planned ahead, then dropped: the request ended), and a
    max_tokens inside a step: the stopped outputs are the unstopped run's, cut there,
    and the cut ones end at max_tokens with every step's last token the target's."""
    path, hf = llama
    items = repetitive(1, seed=3)
    base = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    full, count = run(make_llm(path, 4, True, force=True), items, base, monkeypatch)
    full = full[0]
    ends = np.cumsum(count["emitted"])  # output indices of the verify steps' last tokens
    at = next(int(e) for e in ends if e > 8 and full.index(full[e]) == e)
    stop = SamplingParams(
        max_tokens=60, temperature=0.0, ignore_eos=True, stop_token_ids=[full[at]]
    )
    llm = make_llm(path, 4, True, force=True)
    got, count = run(llm, items, stop, monkeypatch)
    assert got == [full[: at + 1]] and count["dropped"] >= 1 and count["kept"] > 0
    assert_pages_returned(llm)
    llm = make_llm(path, 4, True, force=True)
    length = SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)
    got, count = run(llm, items, length, monkeypatch)
    assert len(got[0]) == 23 and count["kept"] > 0  # (the last drafts: fewer, other ones)
    check_bonus(hf, items[0], got[0], count["emitted"])
    assert_pages_returned(llm)


def test_request_ended_between_steps_drops_its_row_of_the_step_ahead(llama, monkeypatch):
    """Forced acceptance, two requests: right after a step planned ahead was kept,
    one request is aborted between steps (as a stop string or an API abort would);
    its row of the step ahead goes with its pages, the other request applies the
    step (none dropped) and goes on with every step's last token the target's, and
    every page comes back."""
    path, hf = llama
    items = repetitive(2, seed=5)
    llm = make_llm(path, 4, True, force=True)
    aborted = []

    def on_step(llm, batch, logits):
        if llm.scheduler.kept_ahead and not aborted:
            aborted.append(batch.requests[1])
            llm.scheduler.finish(batch.requests[1], "abort")

    emitted0 = []  # the first request's tokens of each verify step (it stays lane 0)
    complete = Scheduler.complete_verify

    def spy(sched, batch, emitted, ahead=None):
        if batch.requests[0].prompt_ids == items[0]:
            emitted0.append(len(emitted[0]))
        return complete(sched, batch, emitted, ahead)

    params = SamplingParams(max_tokens=40, temperature=0.0)
    with monkeypatch.context() as m:
        m.setattr(Scheduler, "complete_verify", spy)
        out = llm.generate(items, params, on_step=on_step)
    assert aborted and out[1].outputs[0].finish_reason == "abort"
    assert len(out[0].output_ids) == 40 and llm.stats.spec_ahead_dropped == 0
    check_bonus(hf, items[0], out[0].output_ids, emitted0)
    assert_pages_returned(llm)


def test_request_finished_by_a_step_drops_only_its_row_ahead(llama, monkeypatch):
    """Forced acceptance, three requests: request 1 meets a stop token as the last
    token of verify step N (N + 1 already planned ahead for all three). Only its row
    of N + 1 is dropped: the others apply N + 1 (kept; no step dropped) with every
    step's last token the target's (their outputs are the unstopped run's up to N;
    later, forced drafts planned otherwise differ), and request 1's are the
    unstopped run's cut at its stop token."""
    path, hf = llama
    items = repetitive(3, seed=5)
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ends, complete = {i: [] for i in range(3)}, Scheduler.complete_verify
    finishing = []  # (kept_ahead) of the steps in which a request finished

    def spy(sched, batch, emitted, ahead=None):
        out = complete(sched, batch, emitted, ahead)
        for r, e in zip(batch.requests, emitted):
            ends[items.index(r.prompt_ids)].append(len(e))
        if out and ahead is not None:
            finishing.append(sched.kept_ahead)
        return out

    with monkeypatch.context() as m:
        m.setattr(Scheduler, "complete_verify", spy)
        full = [o.output_ids for o in make_llm(path, 4, True, force=True).generate(items, base)]
    steps = np.cumsum(ends[1])
    at = next(
        int(e) for e in steps[2:]
        if e < 30 and full[1].index(full[1][e]) == e and full[1][e] not in full[0] + full[2]
    )  # fmt: skip
    stop = SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[full[1][at]]
    )
    llm = make_llm(path, 4, True, force=True)
    ends, finishing = {i: [] for i in range(3)}, []
    with monkeypatch.context() as m:
        m.setattr(Scheduler, "complete_verify", spy)
        got = [o.output_ids for o in llm.generate(items, [base, stop, base])]
    assert got[1] == full[1][: at + 1] and all(len(got[i]) == 40 for i in (0, 2))
    assert all(got[i][: at + 1] == full[i][: at + 1] for i in (0, 2))
    assert finishing and finishing[0] is True  # request 1's finish kept N + 1 ...
    assert llm.stats.spec_ahead_dropped == 0  # ... and no step planned ahead was dropped
    for i in (0, 2):
        check_bonus(hf, items[i], got[i], ends[i])
    assert_pages_returned(llm)


def test_pipelined_under_preemption(llama, monkeypatch):
    """A pool that preempts: steps planned ahead where the pool holds their rows,
    tokens equal transformers'."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.placement import pool_bytes_for, worst_case_pages

    path, hf = llama
    configs = specs_from_hf_config(path, page_size=4, dtype=torch.float32)
    pages = worst_case_pages(configs[0].spec, 4, 96, 64) + 1
    items = repetitive(4, seed=11)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, 4, True, kv_cache_bytes=pool_bytes_for(configs, {"full": pages}))
    got, count = run(llm, items + items[::-1], params, monkeypatch)
    assert got == [hf_greedy(hf, p, 40) for p in items + items[::-1]]
    assert llm.stats.preemptions > 0 and count["kept"] + count["dropped"] > 0
    assert_pages_returned(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("ps", [1, 16])
def test_pipelined_on_gpu(llama, ps, monkeypatch):
    """On CUDA (verify graphs, pinned readbacks, fp32): steps planned ahead replay
    behind the step in flight. Forced acceptance: every step kept, each step's last
    token the target's (transformers on the CPU); real drafts: tokens equal the same
    engine's without pipelining, steps planned ahead kept."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path, hf = llama
    kw = {"device": "cuda", "debug": False, "max_num_seqs": 8, "kv_cache_bytes": 64 << 20}
    items = [repetitive(1)[0]]
    llm = make_llm(path, ps, True, force=True, **kw)
    assert llm.runner.verify_graphs is not None
    got, count = run(llm, items, SamplingParams(max_tokens=40, temperature=0.0), monkeypatch)
    assert count["kept"] >= 6 and count["dropped"] == 0
    check_bonus(hf, items[0], got[0], count["emitted"])
    g = torch.Generator().manual_seed(9)
    items = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 13)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want, _ = run(make_llm(path, ps, False, **kw), items, params, monkeypatch)
    got, count = run(make_llm(path, ps, True, **kw), items, params, monkeypatch)
    assert got == want and count["kept"] > 0
