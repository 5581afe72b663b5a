"""MiMo-V2-Flash through the engine on a CUDA GPU: the Triton decode and extend
kernels over asymmetric K/V (K heads wider than V heads) in the "full" and "swa"
sub-pools, sinks and the sliding window, CUDA-graph decode, fp32 and bf16, against
transformers' eager model on the same weights (run with ``pytest -m gpu``).

Models: the tiny one of ``test_engine_mimo.tiny_mimo_config`` (K 36, V 20, window 7)
and one at the release's head widths (K 192, V 128, 8 query heads, 2 / 4 KV heads,
window 37), so the kernels run their real tile sizes with padding lanes.

- fp32 (Triton dots in IEEE fp32): greedy tokens identical to transformers, with
  and without CUDA graphs, at page sizes 1, 4 and 16 (the wide model: page 16 with
  graphs only, since every page size compiles its own kernels at the wide tiles and
  one wide test took over 100 s on the H200); under preemption with tiny chunks
  (graphs replayed over recycled pages; tiny model);
- bf16, teacher-forced as ``test_engine_gemma_gpu.py``: every engine token is
  transformers' bf16 argmax over the engine's own sequence up to a near-tie (MoE
  routing may flip a tie in bf16, so the bound is DeepSeek's), and unikv-bf16 stays
  as close to transformers-fp32 as transformers-bf16 is.

On the H200 (2026-12-01) the tiny model's tests passed; the wide model has not
completed yet.
"""

from __future__ import annotations

import pytest
import torch
from gpu_fixtures import (
    NEW_TOKENS,
    assert_bf16_close,
    assert_fp32_greedy,
    assert_pool_empty,
    bf16_token_checks,
    engine_prompts,
    gpu_llm,
    refs_fixture,
)
from test_engine_mimo import save_tiny_mimo

pytestmark = pytest.mark.gpu

WIDE = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 192,
    "v_head_dim": 128,
    "sliding_window": 37,
    "initializer_range": 0.05,
}
MODELS = {"tiny": {}, "wide": WIDE}
BF16_TIE = 0.25


@pytest.fixture(scope="module")
def saved(request, tmp_path_factory):  # parametrized indirectly by each test: "tiny", "wide"
    path = str(tmp_path_factory.mktemp(f"mimo_{request.param}"))
    save_tiny_mimo(path, **MODELS[request.param])
    return request.param, path


refs = refs_fixture()


FP32_CASES = [("tiny", ps, g) for ps in (1, 4, 16) for g in (True, False)] + [("wide", 16, True)]


@pytest.mark.parametrize("saved,page_size,graphs", FP32_CASES, indirect=["saved"])
def test_fp32_greedy_identical_with_triton_and_graphs(refs, page_size, graphs):
    llm = gpu_llm(refs.path, torch.float32, page_size=page_size, cuda_graphs=graphs)
    assert sorted(llm.pool.subpools) == ["full", "swa"]
    assert all(s.spec.is_asymmetric for s in llm.pool.subpools.values())
    assert_fp32_greedy(llm, refs, graphs)


@pytest.mark.parametrize("saved", ["tiny"], indirect=True)
def test_fp32_graphs_under_preemption_and_tiny_chunks(refs):
    from unikv.engine import SamplingParams
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(refs.path, page_size=16, dtype=torch.float32)
    # 8 pages per sub-pool for 451 prompt tokens: preempts (12 did not on CPU or GPU)
    budget = pool_bytes_for(configs, {c.name: 8 for c in configs})
    prompts = engine_prompts(11)
    llm = gpu_llm(
        refs.path,
        torch.float32,
        kv_cache_bytes=budget,
        max_num_batched_tokens=7,
        max_model_len=160,
    )
    assert llm.runner.graphs is not None
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in outputs] == refs.greedy(prompts, NEW_TOKENS)
    assert llm.stats.preemptions > 0
    assert_pool_empty(llm)


@pytest.mark.parametrize("saved", list(MODELS), indirect=True)
def test_bf16_teacher_forced(refs):
    hf16, hf32 = refs.model(torch.bfloat16), refs.model(torch.float32)
    llm = gpu_llm(refs.path, torch.bfloat16)
    assert llm.runner.graphs is not None
    checks = bf16_token_checks(llm, hf16, hf32, engine_prompts(), NEW_TOKENS)
    assert_bf16_close(checks, BF16_TIE)
