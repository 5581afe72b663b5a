"""Prefix caching of windowed models under pressure (issue 41 item 2), on CPU in fp32:
tiny gpt-oss (full + window 6) and Gemma-2 (alternating window 7 / full), pages 4 and
16, a pool that preempts (by recompute and by swap) and evicts. Greedy tokens with the
cache equal transformers' and a run without the cache in the same pool; the cache both
hit and lost pages or window bindings to pressure. The smallest pool in which one
request of ``max_model_len`` runs alone also runs it with caching on (no start-up
refusal for windowed models)."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import hf_greedy, one_thread, save_tiny_gemma, save_tiny_model  # noqa: F401
from prefix_fixtures import tight_llm, tight_prompts

from unikv.engine import LLM, SamplingParams

NEW_TOKENS = 10
MAX_LEN = 48  # prefix_fixtures.tight_llm's max_model_len
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    out["gpt_oss"] = (path, save_tiny_model("gpt_oss", path))
    path = str(tmp_path_factory.mktemp("gemma2"))
    out["gemma2"] = (path, save_tiny_gemma("gemma2", path, tie_word_embeddings=False))
    return out


CASES = [  # arch, page size, token pages a sub-pool (sized to preempt and evict)
    ("gpt_oss", 4, 14),
    ("gpt_oss", 16, 4),
    ("gemma2", 4, 14),
    ("gemma2", 16, 4),
]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("arch,ps,pages", CASES)
def test_windowed_cache_under_pressure_keeps_the_tokens(models, arch, ps, pages, preemption):
    path, hf = models[arch]
    prompts = tight_prompts()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    plain = tight_llm(path, ps, pages, preemption, caching=False, debug=False)
    assert [o.output_ids for o in plain.generate(prompts, params)] == want
    llm = tight_llm(path, ps, pages, preemption, caching=True)
    outs = llm.generate(prompts, params)
    assert [o.output_ids for o in outs] == want
    # the next turn of each, the latest first: it hits the chain end its answer left
    turns = [p + o.output_ids + [1, 2, 3] for p, o in zip(prompts, outs)][::-1]
    turns = [t for t in turns if len(t) + NEW_TOKENS <= MAX_LEN]  # tight_llm's max_model_len
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in turns]
    assert [o.output_ids for o in llm.generate(turns, params)] == want
    stats = llm.alloc.parts.prefix.counters()
    assert llm.scheduler.num_preemptions > 0, "the pool is sized to preempt"
    assert stats["hit_tokens"] > 0, stats
    assert stats["evicted_pages"] + stats["evicted_windows"] > 0, stats
    if preemption == "swap":
        assert llm.scheduler.swap.counters()["swap_swapped_out"] > 0
    llm.alloc.check_integrity()


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma2"])
def test_one_max_len_request_runs_alone_with_caching_on(models, arch):
    from unikv.engine.budget import one_request_bytes
    from unikv.hf_config import specs_from_hf_config

    path, hf = models[arch]
    ps, max_len, chunk = 4, 40, 8
    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    budget = one_request_bytes(configs, max_len, chunk)
    prompt = tight_prompts()[3][: max_len - NEW_TOKENS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = hf_greedy(hf, prompt, NEW_TOKENS)
    llm = LLM(
        path, device="cpu", dtype=torch.float32, page_size=ps, kv_cache_bytes=budget,
        max_model_len=max_len, max_num_batched_tokens=chunk, max_num_seqs=2,
        enable_prefix_caching=True, debug=True,
    )  # fmt: skip
    assert llm.prefix_caching
    for _ in range(2):  # the second run hits what the first left cached
        (out,) = llm.generate([prompt], params)
        assert out.output_ids == want
    assert out.num_cached_tokens > 0
    llm.alloc.check_integrity()
