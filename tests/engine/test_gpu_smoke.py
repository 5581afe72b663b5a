"""A two-minute GPU smoke (``pytest -m smoke``, one process, JIT included): the code
of the latest changes that the CPU suite only runs through Triton's interpreter.

- store / decode / extend (Triton) against the torch backend and the dense fp32
  oracle of ``kernel_cases``, on a symmetric pool (K = V = 128) and an ASYMMETRIC one
  (K 192 / V 128, rows stored without padding), pages 1 and 16; the store also
  against a naive indexed write;
- the allocator's fused ``decode_step`` (Triton table kernels) against a twin
  allocator on the torch backend: tables, write ids and every device table;
- the fused MoE kernel against ``moe_ref`` (fp32, bf16, MXFP4 experts);
- the fused elementwise kernels against ``elementwise_ref``;
- the MLA decode kernel against ``mla_ref`` at DeepSeek's widths (rank 512, rope 64);
- two ``unikv.LLM`` runs on CUDA with graphs in fp32, token-exact against
  transformers: a tiny Llama (page 16, mixed prefill+decode batches, preemption
  under a tight pool) and a tiny Qwen3.5 hybrid (state slots recycled under
  preemption).

Shapes are small so that the JIT dominates and stays inside the budget.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import PagedCase, paged_decode, paged_extend, paged_oracle

from unikv import layout
from unikv.kernels import get_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.smoke,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HKV, GROUP = 2, 4  # KV heads, query heads per KV head
GEOMETRIES = {"symmetric": (128, 128), "asymmetric": (192, 128)}  # (K, V) head dims
NEW_TOKENS = 16


def _ops(name: str):
    return get_backend("cuda", name)


def _case(geometry: str, ps: int) -> PagedCase:
    """bf16 K/V of requests of 1, 77 and 300 tokens; rows stored without padding."""
    dim, dim_v = GEOMETRIES[geometry]
    case = PagedCase([1, 77, 300], HKV, dim, ps, dim_v=dim_v, dtype=torch.bfloat16,
                     device="cuda", seed=5)  # fmt: skip
    assert case.k_cache.shape[-1] == dim and case.v_cache.shape[-1] == dim_v
    itemsize = torch.finfo(torch.bfloat16).bits // 8
    assert case.pool["full"].page_bytes == 2 * ps * HKV * (dim + dim_v) * itemsize, "no padding"
    return case


def _close_to(got, want, name):
    torch.testing.assert_close(
        got.float().cpu(), want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}"
    )


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_decode_and_extend_against_torch_and_oracle(geometry, ps):
    dim = GEOMETRIES[geometry][0]
    lens, new, case = [1, 77, 300], [1, 40, 33], _case(geometry, ps)
    gen = torch.Generator().manual_seed(ps)
    scale = dim**-0.5
    q = torch.randn(len(lens), HKV * GROUP, dim, generator=gen).bfloat16().cuda()
    want = paged_oracle(case, q, sm_scale=scale)
    outs = {n: paged_decode(_ops(n), case, q, sm_scale=scale) for n in ("triton", "torch")}
    for name, out in outs.items():
        _close_to(out, want, f"{name} decode vs the oracle")
    _close_to(outs["triton"], outs["torch"].float().cpu(), "Triton decode vs torch")

    qx = torch.randn(sum(new), HKV * GROUP, dim, generator=gen).bfloat16().cuda()
    want = paged_oracle(case, qx, new, sm_scale=scale)
    for name in ("triton", "torch"):
        got = paged_extend(_ops(name), case, qx, new, sm_scale=scale)
        _close_to(got, want, f"{name} extend vs the oracle")


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_store_against_torch_and_indexed_write(geometry, ps):
    """Both backends' stores leave every pool byte as a naive indexed write does."""
    from test_kernels_store import _naive_write

    dim, dim_v = GEOMETRIES[geometry]
    case = _case(geometry, ps)
    sub = case.pool["full"]
    tokens = torch.randperm(sub.usable_pages * ps, device="cuda")[:50] + sub.first_page * ps
    ids = layout.kernel_ids(tokens, ps, sub.blocks_per_page)
    k = torch.randn(50, HKV, dim, device="cuda").bfloat16()
    v = torch.randn(50, HKV, dim_v, device="cuda").bfloat16()
    before = case.pool.buffer.clone()
    buffers = {}
    for name in ("triton", "torch"):
        case.pool.buffer.copy_(before)
        _ops(name).store_kv(*sub.views[1], ids, k, v)
        buffers[name] = case.pool.buffer.clone()
    case.pool.buffer.copy_(before)
    _naive_write(case.pool, 1, tokens, k, v)
    assert torch.equal(buffers["triton"], case.pool.buffer), "Triton store != indexed write"
    assert torch.equal(buffers["torch"], case.pool.buffer), "torch store != indexed write"


def _chain(ps: int, backend: str):
    from allocator_fixtures import full_config, mamba_config, swa_config

    from unikv.allocator import PoolAllocator
    from unikv.pool import UnifiedPool, pool_bytes_for

    configs = [full_config(ps), swa_config(ps), mamba_config()]
    pages = {"full": 24 * 64 // ps + 8, "swa": 24 * 64 // ps + 8, "mamba": 24}
    pool = UnifiedPool(configs, pool_bytes_for(configs, pages), "cuda", backend=_ops(backend))
    return PoolAllocator(pool, max_requests=24, max_context=64, backend=_ops(backend))


@pytest.mark.parametrize("ps", [1, 16])
def test_fused_decode_step_equals_the_torch_backend(ps):
    """The same decode steps on twin allocators, Triton vs torch table ops: the
    returned tables and write ids and every device table agree after each step."""
    fused, ref = _chain(ps, "triton"), _chain(ps, "torch")
    rng = np.random.default_rng(ps)
    prompts = rng.integers(1, 40, 24)
    for alloc in (fused, ref):
        slots = np.array([alloc.new_request() for _ in range(24)])
        assert alloc.alloc_extend(slots, np.zeros(24, np.int64), prompts) is not None
    for step in range(20):
        batch = np.sort(rng.choice(24, int(rng.integers(1, 25)), replace=False))
        lens = ref.parts.requests.lens[batch].copy()
        got, want = (a.decode_step(batch, lens) for a in (fused, ref))
        assert got is not None and want is not None, f"step {step}: the pool is large enough"
        assert torch.equal(got.virtual_ids.data, want.virtual_ids.data), step
        for name in ("full", "swa"):
            assert torch.equal(got.block_tables[name].data, want.block_tables[name].data), (
                f"step {step} {name}: block table"
            )
            assert torch.equal(got.write_ids[name].data, want.write_ids[name].data), (
                f"step {step} {name}: write ids"
            )
            for table in ("v2p", "p2v"):
                a, b = (getattr(x.parts.books[name], table) for x in (fused, ref))
                assert torch.equal(a, b), f"step {step} {name}: {table}"
        assert torch.equal(fused.parts.requests.req_to_token, ref.parts.requests.req_to_token), (
            f"step {step}: req_to_token"
        )
    torch.cuda.synchronize()
    fused.check_integrity()
    ref.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_against_reference(dtype):
    from test_kernels_moe import _close as close
    from test_kernels_moe import _dense_case, _mxfp4, _routing

    from unikv.kernels.moe import fused as moe
    from unikv.kernels.moe import ref as moe_ref

    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for case in [("silu", "concat", 8, 2, 72, 70, 37), ("gpt_oss", "interleaved", 5, 2, 40, 24, 5)]:
        args, kw = _dense_case(*case, dtype)
        args = {n: v.cuda() for n, v in args.items()}
        close(moe.fused_moe(**args, **kw), moe_ref.fused_moe(**args, **kw), tol)
    g = torch.Generator().manual_seed(1)
    e, k, d, i, t = 4, 2, 64, 96, 7
    w1, s1, _ = _mxfp4(g, e, 2 * i, d)
    w2, s2, _ = _mxfp4(g, e, d, i)
    x = torch.randn(t, d, generator=g).to(dtype)
    weights, ids = _routing(g, t, e, k)
    b1, b2 = (torch.randn(e, n, generator=g).to(dtype) for n in (2 * i, d))
    args = [v.cuda() for v in (x, weights, ids, w1, w2)]
    kw = {"activation": "gpt_oss", "gate_up": "interleaved", "b1": b1.cuda(), "b2": b2.cuda()}
    kw.update(w1_scales=s1.cuda(), w2_scales=s2.cuda())
    close(moe.fused_moe(*args, **kw), moe_ref.fused_moe(*args, **kw), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_elementwise_against_reference(dtype):
    """Odd shapes: 37 rows of 200, GQA 6/2 heads of 40 with rotary dim 24, I 88."""
    from test_kernels_elementwise import _close

    from unikv.kernels.linear import elementwise, ref

    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).cuda()

    x, r, w = randn(37, 200), randn(37, 200), randn(200)
    for kw in ({}, {"offset": 1.0, "weight_in_fp32": True}):
        _close(elementwise.rms_norm(x, w, 1e-6, **kw), ref.rms_norm(x, w, 1e-6, **kw))
        got, want = (
            elementwise.add_rms_norm(x, r.clone(), w, 1e-6, **kw),
            ref.add_rms_norm(x, r, w, 1e-6, **kw),
        )
        _close(got[0], want[0])
        assert torch.equal(got[1], want[1]), "the residual sum is the reference's"
    qkv = randn(37, 10 * 40)
    q, k = qkv[:, : 6 * 40].view(37, 6, 40), qkv[:, 6 * 40 : 8 * 40].view(37, 2, 40)
    cos, sin = (
        torch.randn(512, 12, generator=gen).cuda(),
        torch.randn(512, 12, generator=gen).cuda(),
    )
    pos = torch.randint(0, 512, (37,), generator=gen).cuda()
    want = ref.rope_qk(q.clone(), k.clone(), cos, sin, pos)
    got = elementwise.rope_qk(q.clone(), k.clone(), cos, sin, pos)
    _close(got[0], want[0])
    _close(got[1], want[1])
    gate_up = randn(37, 2 * 88)
    _close(elementwise.silu_mul(gate_up), ref.silu_mul(gate_up))


@pytest.mark.parametrize(
    "dtype,ps,heads", [(torch.float32, 16, 16), (torch.bfloat16, 1, 128)], ids=["fp32", "bf16"]
)
def test_mla_decode_against_reference(dtype, ps, heads):
    from test_kernels_mla_decode import Case, indptr, queries

    from unikv.kernels.mla import decode as mla_decode
    from unikv.kernels.mla import ref as mla_ref

    lens = [1, 300, 1500]
    case = Case(lens, 512, 64, ps, dtype=dtype, device="cuda", seed=ps + heads)
    q_lat, q_rope = queries(len(lens), heads, 512, 64, dtype=dtype, device="cuda", seed=heads)
    args = (case.cache, case.block_table, indptr([1] * len(lens), "cuda"), case.seq_lens)
    opts = {"max_q_len": 1, "page_size": ps, "sm_scale": 192**-0.5}
    got = mla_decode.mla_attention(q_lat, q_rope, *args, **opts)
    want = mla_ref.mla_attention(q_lat.float(), q_rope.float(), case.cache.float(), *args[1:],
                                 **opts)  # fmt: skip
    assert got.dtype == dtype and torch.isfinite(got).all()
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < (2e-5 if dtype == torch.float32 else 2e-2), err


def _mixed(batch) -> bool:
    """A prefill chunk in the same step as a decode token (a request whose output
    already held a token before this step)."""
    has_chunk = any(n > 1 for n in batch.num_new)
    return has_chunk and any(
        n == 1 and len(r.output_ids) >= 2 for r, n in zip(batch.requests, batch.num_new)
    )


def _tight_run(path: str, pages_of) -> tuple:
    """fp32 graphs at page 16 on a pool of ``pages_of(subpool config)`` pages."""
    from gpu_fixtures import engine_prompts, gpu_llm

    from unikv.engine import SamplingParams
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(path, page_size=16, dtype=torch.float32)
    budget = pool_bytes_for(configs, {c.name: pages_of(c) for c in configs})
    llm = gpu_llm(path, torch.float32, kv_cache_bytes=budget, max_model_len=160, cuda_graphs=True)
    assert llm.backend.name == "triton" and llm.runner.graphs is not None
    prompts, mixed = engine_prompts(11), []
    outputs = llm.generate(
        prompts,
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
        on_step=lambda llm, batch, logits: mixed.append(_mixed(batch)),
    )
    return llm, prompts, [o.output_ids for o in outputs], any(mixed)


def _check_run(llm, prompts, got, path) -> None:
    from gpu_fixtures import References, assert_pool_empty

    refs = References(path)
    try:
        assert got == refs.greedy(prompts, NEW_TOKENS), "tokens differ from transformers'"
    finally:
        refs.close()
    assert llm.stats.preemptions > 0, "the pool is meant to preempt"
    assert llm.stats.decode_steps > 0, "decode steps ran (under graphs)"
    assert_pool_empty(llm)


def test_llama_engine_fp32_graphs_mixed_batches_and_preemption(tmp_path):
    from engine_fixtures import save_tiny_model

    save_tiny_model("llama", str(tmp_path))
    llm, prompts, got, mixed = _tight_run(str(tmp_path), lambda c: 12)
    assert mixed, "some step ran a prefill chunk beside decode tokens"
    _check_run(llm, prompts, got, str(tmp_path))


def test_qwen3_5_hybrid_engine_fp32_graphs_under_preemption(tmp_path):
    from engine_fixtures import save_tiny_hybrid

    save_tiny_hybrid("qwen3_5", str(tmp_path))
    llm, prompts, got, _ = _tight_run(str(tmp_path), lambda c: 2 if c.spec.kind == "mamba" else 11)
    _check_run(llm, prompts, got, str(tmp_path))
