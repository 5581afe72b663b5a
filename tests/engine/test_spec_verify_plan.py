"""A steady verify step's plan updated in place (``plan_steady.SteadyVerify``, issue
42): steady speculative decoding builds the verify plan's host arrays from the
requests only at its first verify step, advancing them afterwards; every advanced
plan's bytes equal a full rebuild of the same batch (a second description), over
runs whose acceptance varies, with a finish and an admission in the middle, at
pages 1, 4 and 16; the tokens stay transformers'. Verify graphs run as their eager
stand-in (``capture=False``: the same padded plans)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_fixtures import (  # noqa: F401  (a fixture)
    VOCAB,
    assert_pages_returned,
    hf_greedy,
    one_thread,
    save_tiny_model,
)

from unikv.engine import LLM, SamplingParams
from unikv.engine.plan_upload import SOME, StepUpload
from unikv.engine.speculative.config import allow_forced_acceptance
from unikv.hf_config import specs_from_hf_config
from unikv.placement import pool_bytes_for, worst_case_pages

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3
FIELDS = ("input_ids", "positions", "logits_indices", "seq_lens", "slots", "q_indptr")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return path, save_tiny_model("llama", path)


def make_llm(path: str, spec: dict, ps: int = 4, seqs: int = 4, kv_cache_bytes=8 << 20) -> LLM:
    with allow_forced_acceptance():
        llm = LLM(path, device="cpu", dtype=torch.float32, page_size=ps, max_num_seqs=seqs,
                  max_num_batched_tokens=32, max_model_len=80, kv_cache_bytes=kv_cache_bytes,
                  speculative_config=spec, debug=True)  # fmt: skip
    llm.runner.capture_verify(K + 1, seqs, capture=False)  # the graphs' eager stand-in
    llm.scheduler.spec.pad_drafts = True
    return llm


def watch_builds(monkeypatch) -> list[bool]:
    """Per full build of the step arrays: whether its batch was a verify step."""
    builds, real = [], StepUpload.build

    def build(self, batch, *a, **k):
        builds.append(batch.drafts is not None)
        return real(self, batch, *a, **k)

    monkeypatch.setattr(StepUpload, "build", build)
    return builds


def test_steady_verify_steps_build_nothing(llama, monkeypatch):
    """One request, every draft accepted (steady from its first verify step): the
    full builder runs for the first verify step only, every later one is advanced."""
    path, hf = llama
    spec = {"method": "ngram", "num_speculative_tokens": K, "force_accept": True}
    llm = make_llm(path, spec)
    builds = watch_builds(monkeypatch)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params)[0].output_ids
    steps = llm.stats.spec_verify_steps
    assert steps >= 9 and llm.stats.spec_accepted_tokens == llm.stats.spec_draft_tokens
    assert sum(builds) == 1, f"{sum(builds)} full builds for {steps} verify steps"
    assert llm.runner.planner.upload.steady.advanced == steps - 1
    with torch.no_grad():  # each step's bonus is the target's greedy token
        greedy = hf(torch.tensor([prompt + out])).logits[0].argmax(-1).tolist()
    for at in range(K + 1, len(out), K + 1):
        assert out[at] == greedy[len(prompt) + at - 1]


def compare_with_rebuild(monkeypatch, planner) -> dict:
    """After every advanced upload: its host and device bytes (the fields a verify
    step reads; ``lanes`` only one-token steps read) and placeholder kind equal a
    full build of the same batch by a fresh ``StepUpload``."""
    seen = {"advanced": 0, "deltas": set(), "pending": set()}
    real, steady, build = StepUpload.upload, planner.upload.steady, StepUpload.build

    def upload(self, batch, rows, pad_q=1):
        before, starts = steady.advanced, getattr(steady, "starts", None)
        dev, host, pending = real(self, batch, rows, pad_q)
        if steady.advanced == before:
            return dev, host, pending
        seen["advanced"] += 1
        seen["deltas"].update((steady.starts - starts).tolist())
        ref = StepUpload(torch.device("cpu"), max_seqs=self.max_seqs,
                         max_tokens=self.max_tokens, pin=False)  # fmt: skip
        ref_dev, ref_host, ref_pending = build(ref, batch, rows, pad_q)
        assert pending == ref_pending
        seen["pending"].add(pending)
        for name in FIELDS:
            want = ref_host[name].tobytes()
            assert host[name].tobytes() == want, f"{name}: advanced != rebuilt"
            assert dev[name].numpy().tobytes() == want, f"{name} on the device"
            assert ref_dev[name].numpy().tobytes() == want
        return dev, host, pending

    monkeypatch.setattr(StepUpload, "upload", upload)
    return seen


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_advanced_plans_equal_a_rebuild(llama, monkeypatch, ps):
    """Real n-gram drafts (acceptance varies), two seats for three requests: the
    first finishes early and the third is admitted in its seat mid-run. Every
    advanced verify plan equals a full rebuild byte for byte; the tokens are
    transformers'."""
    path, hf = llama
    g = torch.Generator().manual_seed(4)
    pattern = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    items = [pattern * 3 + [7, 9], pattern * 2 + [3], pattern[::-1] * 3]
    limits = [10, 28, 20]
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    llm = make_llm(path, spec, ps, seqs=2)
    seen = compare_with_rebuild(monkeypatch, llm.runner.planner)
    builds = watch_builds(monkeypatch)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in limits]
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, n) for p, n in zip(items, limits)]
    s = llm.stats
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens  # accepts and rejects
    assert seen["advanced"] >= 4 and len(seen["deltas"]) > 1, seen  # acceptance varied
    assert seen["advanced"] + sum(builds) == s.spec_verify_steps
    assert sum(builds) >= 2  # the batch changed (a finish, an admission): built again
    assert np.all(np.asarray(sorted(seen["deltas"])) >= 1)


def test_advanced_plans_under_pressure(llama, monkeypatch):
    """A pool too small for every request's rows: the engine preempts and readmits
    (recompute), the batch changes under the kept arrays; every advanced plan still
    equals a full rebuild and the tokens are transformers'."""
    path, hf = llama
    configs = specs_from_hf_config(path, page_size=4, dtype=torch.float32)
    pages = worst_case_pages(configs[0].spec, 4, 80, 32) + 1
    g = torch.Generator().manual_seed(11)
    items = [torch.randint(0, VOCAB, (4,), generator=g).tolist() * 4 for _ in range(4)]
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}  # fmt: skip
    llm = make_llm(path, spec, kv_cache_bytes=pool_bytes_for(configs, {"full": pages}))
    seen = compare_with_rebuild(monkeypatch, llm.runner.planner)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, 40) for p in items]
    assert llm.stats.preemptions > 0 and seen["advanced"] > 0
    assert_pages_returned(llm)


def test_advanced_plans_with_device_drafts(llama, monkeypatch):
    """A draft model (the target as its own draft): the verify step's drafts are on
    the device, its arrays hold placeholders for them; the advanced plans equal a
    rebuild (placeholders included) and the tokens are transformers'."""
    path, hf = llama
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    llm = make_llm(path, spec)
    seen = compare_with_rebuild(monkeypatch, llm.runner.planner)
    g = torch.Generator().manual_seed(5)
    items = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 11)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, 24) for p in items]
    assert seen["advanced"] >= 3 and llm.stats.spec_verify_steps > seen["advanced"]
    assert seen["pending"] == {SOME}  # (the drafts' placeholders, filled on the device)


@pytest.mark.gpu
def test_steady_verify_plans_on_gpu(llama, monkeypatch):
    """On a CUDA GPU with CUDA graphs (``pytest -m gpu``; fp32): forced acceptance,
    one request, real verify graphs: one full build for all its verify steps, the
    tokens of the same engine's eager verify steps (no graphs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path, _ = llama
    spec = {"method": "ngram", "num_speculative_tokens": K, "force_accept": True}
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True)
    kw = {"device": "cuda", "dtype": torch.float32, "page_size": 4, "max_num_seqs": 4,
          "max_num_batched_tokens": 32, "max_model_len": 80, "kv_cache_bytes": 8 << 20,
          "speculative_config": spec}  # fmt: skip
    with allow_forced_acceptance():
        want = LLM(path, cuda_graphs=False, **kw).generate([prompt], params)[0].output_ids
        llm = LLM(path, cuda_graphs=True, **kw)
    assert llm.runner.verify_graphs is not None and llm.runner.verify_graphs.graphs
    builds = watch_builds(monkeypatch)
    assert llm.generate([prompt], params)[0].output_ids == want
    assert sum(builds) == 1 and llm.stats.spec_verify_steps >= 9
