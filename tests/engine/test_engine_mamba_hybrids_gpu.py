"""Bamba, Granite-4.0-H and Zamba2 on a CUDA GPU: Triton state kernels in place in
the pool's slot views, CUDA-graph decode, against transformers on the same weights
(run with ``pytest -m gpu``); the tiny models of ``mamba_hybrid_fixtures``.

- fp32: greedy tokens identical to transformers, with and without CUDA graphs,
  pages 1 and 16; a pool small enough to preempt, with graphs replaying over
  recycled state slots.
- bf16, teacher-forced as in ``test_engine_hybrid_gpu.py``: unikv-bf16 within 1.5x
  of transformers-bf16's mean row error against transformers-fp32, no row further
  off than transformers-bf16's worst (x2), at most 5 % of tokens off
  transformers-bf16's argmax up to a near-tie (Granite's MoE may flip a bf16
  routing tie: no bound on its tokens, as NemotronH's).
- the decode step (scheduler, allocator, graph replay) makes no host sync.
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
    decode_without_host_sync,
    engine_prompts,
    llms_fixture,
    refs_fixture,
    run_preempting,
)
from mamba_hybrid_fixtures import bamba_config, granite_config, save_hf, zamba2_config

pytestmark = pytest.mark.gpu

CONFIGS = {"bamba": bamba_config, "granitemoehybrid": granite_config, "zamba2": zamba2_config}
BF16_TIE = 0.1
FP32_TIE = 2e-3  # TF32 accumulation in the chunked recurrent kernels


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    save_hf(CONFIGS[request.param](), path)
    return request.param, path


refs = refs_fixture()
llms = llms_fixture()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("graphs", [True, False])
def test_fp32_greedy_identical_with_triton_and_graphs(refs, llms, page_size, graphs):
    assert_fp32_greedy(llms(torch.float32, page_size=page_size, cuda_graphs=graphs), refs, graphs)


def test_fp32_graphs_under_preemption_and_tiny_chunks(saved, refs):
    run_preempting(saved[1], refs, FP32_TIE, max_num_batched_tokens=24)


def test_bf16_teacher_forced(saved, refs, llms):
    arch, _ = saved
    hf16, hf32 = refs.model(torch.bfloat16), refs.model(torch.float32)
    llm = llms(torch.bfloat16)
    assert llm.runner.graphs is not None
    checks = bf16_token_checks(llm, hf16, hf32, engine_prompts(), NEW_TOKENS)
    off = 1.0 if arch == "granitemoehybrid" else 0.05
    assert_bf16_close(checks, BF16_TIE, off_fraction=off)


def test_decode_step_makes_no_host_sync(llms):
    llm = llms(torch.float32, page_size=16, cuda_graphs=True)
    decode_without_host_sync(llm, engine_prompts()[:4])
    assert_pool_empty(llm)
