"""DeepSeek-V2 / V3 on a CUDA GPU: the Triton MLA kernels over the pool's MLA
sub-pool, CUDA-graph decode, against transformers on the same weights (run with
``pytest -m gpu``).

Models: the tiny V2 and V3 of ``engine_fixtures.tiny_deepseek_config`` (rank 24,
rope 8) and a V3 at DeepSeek's real MLA widths (rank 512, rope 64, nope 128, v 128,
16 heads) so the kernels run their tuned tile sizes.

- fp32: greedy tokens identical to transformers, with and without CUDA graphs,
  pages 1 and 16; chunked prefill that cuts prompts mid-way under a pool small
  enough to preempt (graphs replay over recycled pages).
- bf16, teacher-forced (``gpu_fixtures.assert_bf16_close``): unikv-bf16 stays as
  close to transformers-fp32 as transformers-bf16 is (mean and worst row), and at
  most 5 % of the engine's tokens lie more than a near-tie below transformers-bf16's
  argmax over the engine's own sequence. The first H200 run (9a7cb9e) had one token
  0.52 (V2) and one 1.25 (V3) below it: the absorbed bf16 MLA rounds in another
  order than transformers' expanded form, and MoE routing can flip a bf16 tie.
- the decode step (scheduler, allocator, graph replay) makes no host sync.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import save_tiny_deepseek
from gpu_fixtures import (
    NEW_TOKENS,
    assert_bf16_close,
    assert_fp32_greedy,
    assert_pool_empty,
    bf16_token_checks,
    decode_without_host_sync,
    engine_prompts,
    gpu_llm,
    llms_fixture,
    refs_fixture,
)
from test_mla_expanded import WIDE  # DeepSeek's MLA widths, 16 heads

pytestmark = pytest.mark.gpu

MODELS = {"v2": (2, {}), "v3": (3, {}), "v3_wide": (3, WIDE)}
BF16_TIE = 0.25


@pytest.fixture(scope="module", params=list(MODELS))
def saved(request, tmp_path_factory):
    version, overrides = MODELS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    save_tiny_deepseek(version, path, **overrides)
    return request.param, path


refs = refs_fixture()
llms = llms_fixture()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("graphs", [True, False])
def test_fp32_greedy_identical_with_triton_and_graphs(refs, llms, page_size, graphs):
    llm = llms(torch.float32, page_size=page_size, cuda_graphs=graphs)
    assert list(llm.pool.subpools) == ["mla"]
    assert_fp32_greedy(llm, refs, graphs)


def test_fp32_graphs_under_preemption_and_tiny_chunks(saved, refs):
    from unikv.engine import SamplingParams
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    _, path = saved
    configs = specs_from_hf_config(path, page_size=16, dtype=torch.float32)
    prompts = engine_prompts(11)
    budget = pool_bytes_for(configs, {"mla": 12})  # 192 token slots for 451 tokens
    llm = gpu_llm(
        path, torch.float32, kv_cache_bytes=budget, max_num_batched_tokens=7, max_model_len=160
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in outputs] == refs.greedy(prompts, NEW_TOKENS)
    assert llm.stats.preemptions > 0
    assert_pool_empty(llm)


def test_bf16_teacher_forced(refs, llms):
    hf16, hf32 = refs.model(torch.bfloat16), refs.model(torch.float32)
    llm = llms(torch.bfloat16)
    assert llm.runner.graphs is not None
    checks = bf16_token_checks(llm, hf16, hf32, engine_prompts(), NEW_TOKENS)
    assert_bf16_close(checks, BF16_TIE)


def test_decode_step_makes_no_host_sync(llms):
    """Scheduling, the allocator's decode_step and the graph replay of MLA decode
    steps run with sync debug mode set to error (on the fp32 page-16 graph LLM of
    the greedy test, run to the end and checked empty afterwards)."""
    llm = llms(torch.float32, page_size=16, cuda_graphs=True)
    decode_without_host_sync(llm, engine_prompts()[:4])
    assert_pool_empty(llm)
