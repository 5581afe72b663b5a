"""GPU tests of the Triton kernels at realistic sizes (``pytest -m gpu``).

Oracles: an fp32 attention computed from dense, un-paged K/V (kernel_cases), a
naive indexed write for the store, the torch page copy for page moves.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_cases import PagedCase, indptr_of, paged_decode, paged_extend, paged_oracle

from unikv import layout
from unikv.kernels import get_backend
from unikv.kernels.attention.fresh import CANDIDATES as FRESH_CANDIDATES
from unikv.kernels.attention.ref import copy_pages as torch_copy_pages

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LENS = [1, 1000, 4097, 300, 64]
HQ, HKV, DIM = 32, 8, 128
_ORACLES: dict[str, torch.Tensor] = {}  # oracle outputs shared by page-size parametrizations


def _once(key: str, case, q, compute):
    """``compute()``, once per key and inputs (a PagedCase's dense K/V and the
    queries drawn after it are the same at every page size); the inputs' sums
    are part of the key, so different data never share an oracle."""
    sums = [float(sum(t.sum() for t in case.dense_k)), float(sum(t.sum() for t in case.dense_v))]
    key = f"{key} {sums} {float(q.float().sum())}"
    if key not in _ORACLES:
        _ORACLES[key] = compute()
    return _ORACLES[key]


@pytest.mark.parametrize("kw", [{}, {"window": 700}, {"sinks": "rand"}, {"soft_cap": 30.0}])
def test_decode_page_size_parity(kw):
    """Page sizes 1, 16 and 64 give the same answer as the dense fp32 oracle."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(LENS), HQ, DIM, generator=gen).bfloat16()
    if kw.get("sinks") == "rand":
        kw = {"sinks": torch.randn(HQ, generator=gen)}
    outs, want = [], None
    for ps in (1, 16, 64):
        case = PagedCase(LENS, HKV, DIM, ps, dtype=torch.bfloat16, device="cuda", seed=3)
        gkw = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in kw.items()}
        got = paged_decode(get_backend("cuda"), case, q.cuda(), sm_scale=DIM**-0.5, **gkw)
        got = got.float().cpu()
        if want is None:  # the case's dense K/V do not depend on the page size
            want = paged_oracle(case, q, sm_scale=DIM**-0.5, **kw)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        outs.append(got)
    torch.testing.assert_close(outs[0], outs[2], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("group,dim", [(1, 64), (8, 128), (4, 256), (6, 128)])
def test_decode_shapes(group, dim):
    case = PagedCase([513, 77, 2048], 2, dim, 16, dtype=torch.float16, device="cuda", seed=5)
    q = torch.randn(3, 2 * group, dim, dtype=torch.float16)
    got = paged_decode(get_backend("cuda"), case, q.cuda(), sm_scale=dim**-0.5).float().cpu()
    want = paged_oracle(case, q, sm_scale=dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_decode_cuda_graph_replay():
    """Captured once with fixed buffers; new lengths and tables are seen on replay."""
    case = PagedCase(LENS, HKV, DIM, 16, dtype=torch.bfloat16, device="cuda", seed=7)
    ops = get_backend("cuda")
    q = torch.randn(len(LENS), HQ, DIM, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros_like(case.block_table)
    lens = torch.ones_like(case.seq_lens)
    out = torch.empty(len(LENS), HQ, DIM, device="cuda", dtype=torch.bfloat16)
    ws = torch.empty(1 << 22, device="cuda")

    def step():
        ops.decode_attention(
            q,
            case.k_cache,
            case.v_cache,
            table,
            lens,
            page_size=16,
            sm_scale=DIM**-0.5,
            out=out,
            workspace=ws,
        )

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    table.copy_(case.block_table)
    lens.copy_(case.seq_lens)
    graph.replay()
    torch.testing.assert_close(
        out.float().cpu(), paged_oracle(case, q, sm_scale=DIM**-0.5), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("kw", [{}, {"window": 300, "sinks": "rand"}])
def test_extend_against_oracle(ps, kw):
    lens, new = [700, 1300, 96], [200, 513, 96]
    gen = torch.Generator().manual_seed(2)
    if kw.get("sinks") == "rand":
        kw = dict(kw, sinks=torch.randn(HQ, generator=gen))
    case = PagedCase(lens, HKV, DIM, ps, dtype=torch.bfloat16, device="cuda", seed=4)
    q = torch.randn(sum(new), HQ, DIM, generator=gen).bfloat16()
    gkw = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in kw.items()}
    got = paged_extend(get_backend("cuda"), case, q.cuda(), new, sm_scale=DIM**-0.5, **gkw)
    got = got.float().cpu()
    want = _once(
        f"extend {sorted(kw)}",
        case,
        q,
        lambda: paged_oracle(case, q, new, sm_scale=DIM**-0.5, **kw),
    )
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_store_matches_indexed_write(dtype):
    ops = get_backend("cuda")
    case = PagedCase([4096], HKV, DIM, 16, dtype=dtype, device="cuda")
    mirror = case.pool.buffer.clone()
    sub = case.pool["full"]
    tokens = torch.randperm(4096, device="cuda")[:3000] + 16
    ids = layout.kernel_ids(tokens, 16, sub.blocks_per_page)
    k = torch.randn(3000, HKV, DIM, device="cuda").to(dtype)
    v = torch.randn(3000, HKV, DIM, device="cuda").to(dtype)
    ops.store_kv(case.k_cache, case.v_cache, ids, k, v)
    typed = layout._typed(mirror, case.k_cache.dtype)  # a second buffer, written naively
    kv = typed.as_strided(case.k_cache.shape, case.k_cache.stride(), case.k_cache.storage_offset())
    vv = typed.as_strided(case.v_cache.shape, case.v_cache.stride(), case.v_cache.storage_offset())
    kv[ids] = k.view(kv.dtype)
    vv[ids] = v.view(vv.dtype)
    assert torch.equal(case.pool.buffer, mirror)


def test_copy_pages_large():
    ops = get_backend("cuda")
    page_bytes = (1 << 20) + 48
    buf = torch.randint(0, 256, (300 * page_bytes,), dtype=torch.uint8, device="cuda")
    perm = torch.randperm(299, device="cuda") + 1
    src, dst = perm[:100], perm[100:200]
    want = buf.clone()
    torch_copy_pages(want, src, dst, page_bytes)
    ops.copy_pages(buf, src, dst, page_bytes, disjoint=True)
    assert torch.equal(buf, want)
    chain_src, chain_dst = perm[:50], perm[1:51]  # overlapping: a page is both
    torch_copy_pages(want, chain_src, chain_dst, page_bytes)
    ops.copy_pages(buf, chain_src, chain_dst, page_bytes)
    assert torch.equal(buf, want)


@pytest.mark.parametrize("ps", [1, 16])
def test_asymmetric_192_128_heads_without_padding(ps):
    """MiMo-V2-Flash heads (K 192, V 128) on page-strided views: decode and extend
    against the fp32 oracle of the dense K/V the case wrote."""
    lens, new, dim, dim_v = [1000, 77, 300], [100, 77, 1], 192, 128
    case = PagedCase(lens, 4, dim, ps, dim_v=dim_v, dtype=torch.bfloat16, device="cuda", seed=9)
    assert case.k_cache.dim() == 4 and case.pool["full"].blocks_per_page == 1
    gen = torch.Generator().manual_seed(9)
    ops, scale = get_backend("cuda"), dim**-0.5
    q = torch.randn(len(lens), 16, dim, generator=gen).bfloat16()
    got = paged_decode(ops, case, q.cuda(), sm_scale=scale)
    want = _once("asymmetric decode", case, q, lambda: paged_oracle(case, q, sm_scale=scale))
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
    qx = torch.randn(sum(new), 16, dim, generator=gen).bfloat16()
    got = paged_extend(ops, case, qx.cuda(), new, sm_scale=scale)
    want = _once("asymmetric extend", case, qx, lambda: paged_oracle(case, qx, new, sm_scale=scale))
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("config", [None, *FRESH_CANDIDATES])
def test_extend_fresh_against_sdpa(config):
    """The fresh-prompt path (K/V read contiguous, every candidate tile, pointer and
    TMA loads) on ragged prompts without prefix, against fp32 SDPA per request, and
    against the paged path over the same K/V stored in the pool."""
    import torch.nn.functional as F

    lens = [4096, 1000, 77]
    case = PagedCase(lens, HKV, DIM, 16, dtype=torch.bfloat16, device="cuda", seed=8)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens), HQ, DIM, generator=gen).bfloat16().cuda()
    k = torch.cat(case.dense_k).bfloat16().cuda()  # (T, Hkv, D): the values the pool holds
    v = torch.cat(case.dense_v).bfloat16().cuda()
    ops = get_backend("cuda")
    got = paged_extend(ops, case, q, lens, sm_scale=DIM**-0.5, config=config, fresh_kv=(k, v))
    got = got.float()
    paged = paged_extend(ops, case, q, lens, sm_scale=DIM**-0.5).float()
    rows = []
    for s, e in itertools.pairwise(indptr_of(lens).tolist()):
        qh = q[s:e].float().transpose(0, 1)  # (Hq, L, D)
        kh = k[s:e].float().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        vh = v[s:e].float().transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        rows.append(F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1))
    want = torch.cat(rows)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, paged, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dim", [128, 64])
def test_extend_one_fresh_prompt_through_sdpa(dim):
    """A step of one fresh prompt through ``extend_sdpa``'s op (the CUDA backend's
    where ``UNIKV_EXTEND_SDPA=1``): SDPA's fused attention runs (no Triton attention
    kernel, no softmax kernel), against fp32 SDPA on repeated K/V and the Triton fresh
    kernel (a tile override keeps the op on Triton)."""
    import dataclasses

    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from unikv.kernels.attention import sdpa as extend_sdpa

    lens = [4096]
    case = PagedCase(lens, HKV, dim, 16, dtype=torch.bfloat16, device="cuda", seed=9)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(4096, HQ, dim, generator=gen).bfloat16().cuda()
    k = torch.cat(case.dense_k).bfloat16().cuda()
    v = torch.cat(case.dense_v).bfloat16().cuda()
    ops = dataclasses.replace(get_backend("cuda"), extend_attention=extend_sdpa.extend_attention)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = paged_extend(ops, case, q, lens, sm_scale=dim**-0.5, fresh_kv=(k, v))
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert not [n for n in names if "_fresh_kernel" in n or "_extend_kernel" in n], names
    # a fused attention kernel, not SDPA's math path (a softmax between two GEMMs)
    assert not [n for n in names if "softmax" in n.lower()], names
    assert [n for n in names if any(w in n.lower() for w in ("sdpa", "fmha", "flash"))], names
    triton = paged_extend(ops, case, q, lens, sm_scale=dim**-0.5, fresh_kv=(k, v),
                          config=FRESH_CANDIDATES[-1])  # fmt: skip
    qh, kh, vh = (x.float().transpose(0, 1) for x in (q, k, v))
    g = HQ // HKV
    want = F.scaled_dot_product_attention(qh, kh.repeat_interleave(g, 0), vh.repeat_interleave(g, 0),
                                          is_causal=True, scale=dim**-0.5).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), triton.float(), atol=2e-2, rtol=2e-2)
