"""Prefix caching end to end on CPU (fp32, torch reference kernels): greedy
tokens with hits identical to the same run without the cache and to
transformers' ``generate`` on the same weights, at page sizes 4 and 16, for
repeated prompts, prompts sharing only part of a page, and a tight pool where
cached pages are evicted and requests preempted (a recompute may hit the pages
it cached when preempted). Hybrids with recurrent state are served (their
tokens: test_prefix_hybrid.py); models with no attention sub-pool are refused
with a ValueError; sliding windows: test_prefix_swa.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_fixtures import hf_greedy, one_thread, save_tiny_model  # noqa: F401
from prefix_fixtures import (
    partial_hit,
    pool_budget,
    prefix_llm,
    run_without_and_with_cache,
    shared_prompts,
    tight_pool_prompts,
)

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return path, save_tiny_model("llama", path)


@pytest.mark.parametrize("ps", [4, 16])
def test_hits_give_the_tokens_of_no_cache_and_of_transformers(tiny, ps):
    path, hf = tiny
    run = run_without_and_with_cache(path, hf, ps, NEW_TOKENS, seed=3)  # whole pages hit
    llm = run.llm
    assert all(o.num_cached_tokens == 0 for o in run.plain)
    stats = llm.alloc.prefix.counters()
    assert stats["hit_tokens"] >= sum(run.whole_pages)
    for name in llm.pool.subpools:  # only cached pages outlive their requests
        assert llm.alloc.parts.books[name].num_live == stats["pages"] == stats["evictable"]
    llm.alloc.check_integrity()
    _, part = partial_hit(path, ps, run)
    assert part.num_cached_tokens == 2 * ps and part.output_ids == run.want[3]


def test_tight_pool_evicts_and_preempts_with_the_same_tokens(tiny):
    from unikv.hf_config import specs_from_hf_config

    path, hf = tiny
    ps = 4
    prompts = tight_pool_prompts(seed=5)
    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    budget = pool_budget(configs, 22)  # 88 tokens
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = prefix_llm(path, ps, True, kv_cache_bytes=budget, max_model_len=48)
    for _ in range(2):
        assert [o.output_ids for o in llm.generate(prompts, params)] == want
    assert llm.scheduler.num_preemptions > 0
    stats = llm.alloc.prefix.counters()
    assert stats["evicted_pages"] > 0 and stats["hit_tokens"] > 0
    # one lookup per admission: every request once per generate, once more per preemption
    # (admissions the pool turned away and retried later are not counted)
    assert stats["queries"] == 2 * len(prompts) + llm.scheduler.num_preemptions, stats
    llm.alloc.check_integrity()


def test_hybrids_are_served_and_models_without_attention_refused(tmp_path):
    from engine_fixtures import save_tiny_hybrid, save_tiny_nemotron_h

    hybrid, mamba = str(tmp_path / "hybrid"), str(tmp_path / "mamba")
    save_tiny_hybrid("qwen3_5", hybrid)  # Gated DeltaNet + full attention: state checkpoints
    llm = LLM(hybrid, device="cpu", max_model_len=64, enable_prefix_caching=True)
    assert llm.alloc.parts.prefix.states is not None
    save_tiny_nemotron_h(mamba, "M-M-")  # Mamba-2 and MLPs only: no page to share
    with pytest.raises(ValueError, match="needs an attention sub-pool .full, MLA or sliding"):
        LLM(mamba, device="cpu", max_model_len=64, enable_prefix_caching=True)
    with pytest.raises(TypeError, match="True, False or None"):
        LLM(hybrid, device="cpu", max_model_len=64, enable_prefix_caching="yes")


def test_llm_stats_count_the_hits_each_generate_made(tiny):
    """``llm.stats`` after a ``generate`` carries that call's prefix hits: the sum
    of its outputs' ``num_cached_tokens`` (an independent per-request count)."""
    path, _ = tiny
    llm = prefix_llm(path, 4, True)
    prompts = shared_prompts(4, seed=3)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    assert llm.stats.prefix_hit_tokens == sum(o.num_cached_tokens for o in again) > 0
    assert llm.stats.prefix_query_tokens == sum(len(p) - 1 for p in prompts)


def test_on_by_default_for_full_attention_off_where_it_costs_memory(tiny, tmp_path):
    """The default (None): a full-attention model caches (a repeated prompt hits with
    transformers' tokens); a sliding-window model (gpt-oss) and a recurrent hybrid
    (Qwen3.5) do not; False and True are kept as given."""
    from engine_fixtures import save_tiny_hybrid

    path, hf = tiny
    prompt = shared_prompts(4, seed=3)[0]
    llm = LLM(path, device="cpu", page_size=4, max_model_len=64)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    (first,), (again,) = llm.generate([prompt], params), llm.generate([prompt], params)
    assert llm.prefix_caching and llm.scheduler.prefix.enabled
    assert again.num_cached_tokens == (len(prompt) - 1) // 4 * 4 > 0
    assert first.output_ids == again.output_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    off = LLM(path, device="cpu", page_size=4, max_model_len=64, enable_prefix_caching=False)
    assert not off.prefix_caching and not off.scheduler.prefix.enabled
    assert [off.generate([prompt], params)[0].num_cached_tokens for _ in range(2)] == [0, 0]
    windowed, hybrid = str(tmp_path / "gpt_oss"), str(tmp_path / "qwen3_5")
    save_tiny_model("gpt_oss", windowed)
    save_tiny_hybrid("qwen3_5", hybrid)
    for other in (windowed, hybrid):
        assert not LLM(other, device="cpu", max_model_len=64).prefix_caching
        assert LLM(other, device="cpu", max_model_len=64, enable_prefix_caching=True).prefix_caching


def test_window_caching_runs_where_the_old_rule_refused_it(tmp_path):
    """Mistral (SWA only, window 7) in a pool of 10 pages of 4 tokens with
    max_model_len 80: the old rule (a request kept its cached prompt pages bound in
    its window sub-pool) refused caching there, as one 80-token request could not run
    alone. Now a request holds only its window; the window bindings that left it are
    the cache's, evicted alone under pressure. The 45-token prompt, served three
    times with caching, gives transformers' tokens each time, the window bindings are
    evicted alone, and no request's window ever holds more pages than the window plus
    a chunk needs (sampled after every verb of the allocator, debug mode)."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.placement import worst_case_pages

    path = str(tmp_path)
    hf = save_tiny_model("mistral", path)
    configs = specs_from_hf_config(path, page_size=4, dtype=torch.float32)
    prompt = torch.randint(0, 200, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    kw = {"device": "cpu", "page_size": 4, "max_model_len": 80, "max_num_batched_tokens": 16}
    small = pool_budget(configs, 10)
    want = hf_greedy(hf, prompt, NEW_TOKENS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    llm = LLM(path, kv_cache_bytes=small, enable_prefix_caching=True, debug=True, **kw)
    alloc = llm.alloc
    swa = next(c for c in configs if c.spec.kind == "swa")
    bound = worst_case_pages(swa.spec, 4, 80, 16)
    peaks = []
    check = alloc.check_integrity

    def sampled():  # debug mode runs it after every mutating verb
        check()
        req, wrefs = alloc.parts.requests, alloc.parts.prefix.wrefs
        for slot in np.flatnonzero(req.in_use):
            held = req.held_pages(int(slot))
            peaks.append(len(held) - int(req.window_lo[swa.name][slot]))
        assert wrefs[swa.name].max(initial=0) <= int(req.in_use.sum())

    alloc.check_integrity = sampled
    outs = [llm.generate([prompt], params)[0] for _ in range(3)]
    assert [o.output_ids for o in outs] == [want] * 3
    assert LLM(path, kv_cache_bytes=small, **kw).generate([prompt], params)[0].output_ids == want
    stats = alloc.prefix.counters()
    assert stats["evicted_windows"] > 0 and stats["evicted_pages"] == 0
    # the chain end's window suffix was kept: the repeats hit 11 of 11 whole pages
    assert [o.num_cached_tokens for o in outs] == [0, 44, 44]
    assert peaks and max(peaks) <= bound < -(-len(prompt) // 4)
