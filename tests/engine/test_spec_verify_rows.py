"""A verify step's rows held to the end of their page (``speculative/headroom.py``):
in steady speculative decode the allocator extends a request only where its rows
cross a page end, not every step; tokens equal plain decoding's and transformers';
a step that stops speculating cuts the held rows first; under memory pressure the
engine preempts as before, tokens unchanged, every page back (debug allocator:
``check_integrity`` after every verb)."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (  # noqa: F401  (a fixture)
    VOCAB,
    assert_pages_returned,
    hf_greedy,
    one_thread,
    save_tiny_model,
)

from unikv.allocator.allocator import PoolAllocator
from unikv.engine import LLM, SamplingParams
from unikv.engine.speculative.config import allow_forced_acceptance
from unikv.engine.speculative.headroom import VerifyRows
from unikv.hf_config import specs_from_hf_config
from unikv.placement import pool_bytes_for, worst_case_pages

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return path, save_tiny_model("llama", path)


def make_llm(path: str, ps: int, spec: dict | None, **kw) -> LLM:
    kw = {
        "device": "cpu",
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "max_model_len": 96,
        **kw,
    }
    with allow_forced_acceptance():
        return LLM(path, dtype=torch.float32, page_size=ps, debug=True,
                   speculative_config=spec, **kw)  # fmt: skip


def count_extends(monkeypatch) -> list[int]:
    calls = []
    real = PoolAllocator.alloc_extend
    monkeypatch.setattr(
        PoolAllocator, "alloc_extend", lambda self, *a: calls.append(1) or real(self, *a)
    )
    return calls


def test_forced_steps_extend_only_at_page_ends(llama, monkeypatch):
    """One request, every draft accepted (k = 3: 4 rows a step), pages of 16: the
    verify steps extend the allocator about once per page (not once per step), and
    every step's last token is still the target's greedy token."""
    path, hf = llama
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (10,), generator=g).tolist()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "force_accept": True}
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, 16, spec)
    calls = count_extends(monkeypatch)
    out = llm.generate([prompt], params)[0].output_ids
    s = llm.stats
    assert s.spec_verify_steps >= 12 and s.spec_accepted_tokens == s.spec_draft_tokens
    pages = -(-(len(prompt) + len(out)) // 16)
    assert len(calls) <= pages + 1, f"{len(calls)} extends for {s.spec_verify_steps} steps"
    with torch.no_grad():
        greedy = hf(torch.tensor([prompt + out])).logits[0].argmax(-1).tolist()
    at = 0
    for _ in range(s.spec_verify_steps):  # each step emits its 3 drafts and the target's
        at += 4
        if at < len(out):
            assert out[at] == greedy[len(prompt) + at - 1]
    assert_pages_returned(llm)


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_real_drafts_equal_plain_decoding(llama, monkeypatch, ps):
    """Real n-gram drafts (accepts and rejects), three requests, some steps without a
    draft (the plain decode step after held rows cuts them first): tokens are
    transformers'; with pages of 16, fewer extends than verify steps (a plain step
    between two cuts the held rows, so the next verify step extends again)."""
    path, hf = llama
    g = torch.Generator().manual_seed(9)
    items = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 13)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}  # fmt: skip
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, ps, spec)
    trims, trim = [], VerifyRows.trim
    monkeypatch.setattr(VerifyRows, "trim", lambda self, reqs: trims.append(1) or trim(self, reqs))
    calls = count_extends(monkeypatch)
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, 30) for p in items]
    assert len(calls) >= llm.scheduler.verify_rows.extends + len(items)  # (+ the prefills)
    s = llm.stats
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    assert trims, "no plain step after a verify step: the cut was not exercised"
    extends = llm.scheduler.verify_rows.extends  # the verify steps' own
    if ps == 16:  # (4 rows a step cross a page of 4 about every step)
        assert extends < s.spec_verify_steps
    assert_pages_returned(llm)


def test_under_pressure_tokens_unchanged(llama):
    """A pool that cannot hold every request's rows: the engine preempts (rows held
    ahead included), tokens equal transformers', every page comes back."""
    path, hf = llama
    configs = specs_from_hf_config(path, page_size=4, dtype=torch.float32)
    pages = worst_case_pages(configs[0].spec, 4, 96, 64) + 1
    g = torch.Generator().manual_seed(11)
    items = [torch.randint(0, VOCAB, (4,), generator=g).tolist() * 4 for _ in range(4)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, 4, spec, kv_cache_bytes=pool_bytes_for(configs, {"full": pages}))
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, 40) for p in items]
    assert llm.stats.preemptions > 0 and llm.stats.spec_verify_steps > 0
    assert_pages_returned(llm)


@pytest.mark.gpu
def test_verify_rows_on_gpu(llama):
    """On a CUDA GPU with CUDA graphs (``pytest -m gpu``; fp32): real n-gram drafts
    with rows held ahead give plain decoding's tokens, fewer extends than steps at
    pages of 16, every page back."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path, _ = llama
    g = torch.Generator().manual_seed(9)
    items = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 13)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}  # fmt: skip
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    kw = {"device": "cuda", "cuda_graphs": True}
    want = [o.output_ids for o in make_llm(path, 16, None, **kw).generate(items, params)]
    llm = make_llm(path, 16, spec, **kw)
    assert [o.output_ids for o in llm.generate(items, params)] == want
    s = llm.stats
    assert 0 < llm.scheduler.verify_rows.extends < s.spec_verify_steps
    assert_pages_returned(llm)
