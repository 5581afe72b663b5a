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
    stats = llm.alloc.parts.prefix.counters()
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
    params = SamplingParams(max_tokens=NEW_TOKENS)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = prefix_llm(path, ps, True, kv_cache_bytes=budget, max_model_len=48)
    for _ in range(2):
        assert [o.output_ids for o in llm.generate(prompts, params)] == want
    assert llm.scheduler.num_preemptions > 0
    stats = llm.alloc.parts.prefix.counters()
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
    with pytest.raises(TypeError, match="True or False"):
        LLM(hybrid, device="cpu", max_model_len=64, enable_prefix_caching="yes")


def test_llm_stats_count_the_hits_each_generate_made(tiny):
    """``llm.stats`` after a ``generate`` carries that call's prefix hits: the sum
    of its outputs' ``num_cached_tokens`` (an independent per-request count)."""
    path, _ = tiny
    llm = prefix_llm(path, 4, True)
    prompts = shared_prompts(4, seed=3)
    params = SamplingParams(max_tokens=4)
    llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    assert llm.stats.prefix_hit_tokens == sum(o.num_cached_tokens for o in again) > 0
    assert llm.stats.prefix_query_tokens == sum(len(p) - 1 for p in prompts)
