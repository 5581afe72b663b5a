"""DeepSeek-V2 / V3 on a CUDA GPU: the Triton MLA kernels over the pool's MLA
sub-pool, CUDA-graph decode, against transformers on the same weights (run with
``pytest -m gpu``).

Models: the tiny V2 and V3 of ``engine_fixtures.tiny_deepseek_config`` (rank 24,
rope 8) and a V3 at DeepSeek's real MLA widths (rank 512, rope 64, nope 128, v 128,
16 heads) so the kernels run their tuned tile sizes.

- fp32: greedy tokens identical to transformers, with and without CUDA graphs,
  pages 1 and 16; chunked prefill that cuts prompts mid-way under a pool small
  enough to preempt (graphs replay over recycled pages).
- bf16, teacher-forced as in ``test_engine_hybrid_gpu.py``: every engine token is
  transformers' bf16 argmax over the engine's own sequence up to a near-tie (MoE
  routing may flip a tie in bf16, so the tie bound is loose), and unikv-bf16 stays
  as close to transformers-fp32 as transformers-bf16 is.
- the decode step (scheduler, allocator, graph replay) makes no host sync.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import hf_greedy, save_tiny_deepseek
from gpu_fixtures import bf16_token_checks, hf_model, mean, seeded_prompts

pytestmark = pytest.mark.gpu

WIDE = {
    "hidden_size": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": 96,
    "num_hidden_layers": 2,
    "initializer_range": 0.05,
}
MODELS = {"v2": (2, {}), "v3": (3, {}), "v3_wide": (3, WIDE)}
PROMPT_LENS = [3, 17, 30, 45, 64, 100]
NEW_TOKENS = 32
BF16_TIE = 0.25


def _prompts(seed=7):
    return seeded_prompts(PROMPT_LENS, seed)


@pytest.fixture(scope="module", params=list(MODELS))
def saved(request, tmp_path_factory):
    version, overrides = MODELS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    save_tiny_deepseek(version, path, **overrides)
    return request.param, path


_hf = hf_model


def _llm(path, dtype, **kw):
    from unikv.engine import LLM

    kw.setdefault("page_size", 16)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_model_len", 256)
    return LLM(path, device="cuda", dtype=dtype, max_num_seqs=8, **kw)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("graphs", [True, False])
def test_fp32_greedy_identical_with_triton_and_graphs(saved, page_size, graphs):
    from unikv.engine import SamplingParams

    _, path = saved
    hf, prompts = _hf(path, torch.float32), _prompts()
    llm = _llm(path, torch.float32, page_size=page_size, cuda_graphs=graphs)
    assert llm.backend.name == "triton" and (llm.runner.graphs is not None) == graphs
    assert list(llm.pool.subpools) == ["mla"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [o.output_ids for o in outputs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert llm.stats.decode_steps > 0


def test_fp32_graphs_under_preemption_and_tiny_chunks(saved):
    from unikv.engine import SamplingParams
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    _, path = saved
    configs = specs_from_hf_config(path, page_size=16, dtype=torch.float32)
    prompts = _prompts(11)
    budget = pool_bytes_for(configs, {"mla": 12})  # 192 token slots for 451 tokens
    llm = _llm(
        path, torch.float32, kv_cache_bytes=budget, max_num_batched_tokens=7, max_model_len=160
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    hf = _hf(path, torch.float32)
    assert [o.output_ids for o in outputs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert llm.stats.preemptions > 0
    llm.alloc.check_integrity()
    assert llm.alloc.subpool("mla").num_live == 0


def test_bf16_teacher_forced(saved):
    _, path = saved
    hf16, hf32 = _hf(path, torch.bfloat16), _hf(path, torch.float32)
    llm = _llm(path, torch.bfloat16)
    assert llm.runner.graphs is not None
    checks = bf16_token_checks(llm, hf16, hf32, _prompts(), NEW_TOKENS)
    gap = max(c.gap for c in checks)
    assert gap <= BF16_TIE, f"a token is not transformers' bf16 argmax (gap {gap})"
    ours_mean, hf_mean = mean(c.ours_vs_fp32 for c in checks), mean(c.hf16_vs_fp32 for c in checks)
    assert ours_mean <= 1.5 * hf_mean + 0.02, (ours_mean, hf_mean)


def test_decode_step_makes_no_host_sync(saved):
    """Scheduling, the allocator's decode_step and the graph replay of MLA decode
    steps run with sync debug mode set to error."""
    from unikv.engine import SamplingParams
    from unikv.engine.scheduler import BatchKind

    _, path = saved
    llm = _llm(path, torch.float32)
    sched, runner = llm.scheduler, llm.runner
    for r in llm.make_requests(_prompts()[:4], SamplingParams(max_tokens=8)):
        sched.add(r)
    while any(r.num_pending != 1 for r in sched.running) or sched.waiting:  # prefill first
        batch = sched.schedule()
        sched.complete(batch, runner.step(batch)[0])
    prev = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            batch = sched.schedule()
            assert batch.is_decode and batch.kind is BatchKind.DECODE
            launched = runner.launch(batch, prev)
            sched.complete_ahead(batch)
            prev = launched
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sched.resolve(prev.batch, prev.tokens())
