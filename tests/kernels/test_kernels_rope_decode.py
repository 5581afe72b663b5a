"""Rope + store inside decode attention (``decode.rope_store_decode_attention``, Triton
under the CPU interpreter, and its torch twin) against the two ops it replaces and an
fp32 oracle.

Each request's last cached row is the decode token's: before the call it is NaN
(never written), so a split that read it before writing it would poison its output.
The oracle rotates q and the new k with ``elementwise_ref.rope_qk`` and attends over
the dense K/V with that row replaced (``kernel_cases.oracle_attention``).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import PagedCase, oracle_attention

from unikv.kernels import get_backend
from unikv.kernels.linear import ref as elementwise_ref

TRITON = get_backend("cpu", "triton")
TORCH = get_backend("cpu", "torch")
LENS = [1, 37, 20, 64]


def _case(dtype, heads, group, dim, half, ps, seed=0):
    """A paged case whose last rows are NaN, the step's q / k / v as strided views of
    one projection output, cos / sin tables and the tokens' write ids."""
    case = PagedCase(LENS, heads, dim, ps, dtype=dtype, seed=seed)
    sub = case.pool["full"]
    paged_k, paged_v = sub.paged_views[1]
    gen = torch.Generator().manual_seed(seed + 5)
    last = torch.tensor(LENS) - 1
    entries = case.block_table[torch.arange(len(LENS)), last // ps].long()
    write_ids = entries * ps + last % ps  # the kernel id of each request's last row
    page = entries // sub.blocks_per_page
    paged_k[page, last % ps], paged_v[page, last % ps] = float("nan"), float("nan")
    b, hq = len(LENS), heads * group
    proj = torch.randn(b, (hq + 2 * heads) * dim, generator=gen).to(dtype)
    q, k, v = proj.split([hq * dim, heads * dim, heads * dim], dim=-1)
    q, k, v = q.view(b, hq, dim), k.view(b, heads, dim), v.view(b, heads, dim)
    cos, sin = torch.randn(80, half, generator=gen), torch.randn(80, half, generator=gen)
    return case, (q, k, v), cos, sin, last + 3, write_ids  # positions: any table rows


def _call(ops, case, qkv, cos, sin, positions, write_ids, **kw):
    q, k, v = qkv
    return ops.rope_store_decode_attention(
        case.k_cache, case.v_cache, write_ids, q, k, v, cos, sin, positions,
        case.block_table, case.seq_lens, page_size=case.page_size, sm_scale=0.3, **kw,
    )  # fmt: skip


# 16-bit cases in fp16: the interpreter's bf16 dot is wrong (its own decode attention too)
CASES = [  # (dtype, H, group, D, rotated half, page size, decode keywords)
    (torch.float16, 2, 4, 16, 8, 4, {"num_splits": 3}),
    (torch.float16, 2, 2, 16, 8, 16, {"num_splits": 8}),  # empty splits at short requests
    (torch.float16, 1, 3, 12, 4, 1, {"num_splits": 1}),  # partial rotary, 4 dims pass
    (torch.float16, 2, 2, 16, 8, 4, {"window": 11, "num_splits": 2}),
    (torch.float32, 2, 2, 16, 8, 4, {"sinks": "rand", "num_splits": 3}),
]


def _kw(extra, hq):
    kw = dict(extra)
    if kw.get("sinks") == "rand":
        kw["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(3))
    return kw


@pytest.mark.parametrize("dtype,heads,group,dim,half,ps,extra", CASES)
def test_fused_launch_equals_rope_store_then_decode(dtype, heads, group, dim, half, ps, extra):
    """The pool's bytes after the fused launch equal those after Triton's rope + store
    then decode attention, byte for byte; the output within 1e-5 (fp32) or bit for bit
    (fp16: the interpreter has no fp fusion to turn off). q and k stay unrotated."""
    kw = _kw(extra, heads * group)
    case, qkv, cos, sin, pos, ids = _case(dtype, heads, group, dim, half, ps)
    before = [t.clone() for t in qkv]
    got = _call(TRITON, case, qkv, cos, sin, pos, ids, **kw)
    assert all(torch.equal(a, b) for a, b in zip(qkv, before))
    two, (q2, k2, v2), *_ = _case(dtype, heads, group, dim, half, ps)
    q2, _ = TRITON.rope_store_kv(two.k_cache, two.v_cache, ids, q2, k2, v2, cos, sin, pos)
    want = TRITON.decode_attention(q2, two.k_cache, two.v_cache, two.block_table, two.seq_lens,
                                   page_size=ps, sm_scale=0.3, **kw)  # fmt: skip
    assert torch.equal(case.pool.buffer, two.pool.buffer)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype,heads,group,dim,half,ps,extra", CASES)
def test_fused_launch_matches_the_oracle(backend, dtype, heads, group, dim, half, ps, extra):
    """Against fp32 attention over the dense K/V whose last row is the rotated new k
    (and the new v), with q rotated by the torch rope; the last rows land in the pool."""
    kw = _kw(extra, heads * group)
    case, (q, k, v), cos, sin, pos, ids = _case(dtype, heads, group, dim, half, ps)
    splits = {} if backend == "torch" else {"num_splits": kw["num_splits"]}
    kw.pop("num_splits")
    got = _call(get_backend("cpu", backend), case, (q, k, v), cos, sin, pos, ids, **kw, **splits)
    rq, rk = elementwise_ref.rope_qk(q, k, cos, sin, pos)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for b, n in enumerate(LENS):
        keys, values = case.dense_k[b].clone(), case.dense_v[b].clone()
        keys[-1], values[-1] = rk[b].float(), v[b].float()
        want = oracle_attention(rq[b : b + 1], keys, values, [n - 1], sm_scale=0.3, **kw)
        torch.testing.assert_close(got[b : b + 1].float(), want, rtol=tol, atol=tol)
    stored = case.k_cache[ids]
    torch.testing.assert_close(stored.float(), rk.float(), rtol=tol, atol=tol)
    assert torch.equal(case.v_cache[ids], v)


def test_fused_launch_rejects_bad_input():
    """Mismatched dtypes (an fp8 cache takes the two-op path) and row counts."""
    case, (q, k, v), cos, sin, pos, ids = _case(torch.float16, 2, 2, 16, 8, 4)
    with pytest.raises(ValueError, match="one dtype"):
        _call(TRITON, case, (q.float(), k, v), cos, sin, pos, ids)
    with pytest.raises(ValueError, match="to match"):
        _call(TRITON, case, (q, k, v), cos, sin, pos, ids[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lens", [[644], [1, 300, 17, 4096, 64, 9, 700, 2000]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_launch_on_the_gpu_equals_the_two_ops(lens, dtype):
    """On the GPU at Llama-3.2-1B's heads (32 / 8, head dim 64, page 16) with the split
    count the planner picks: the split holding the new row writes it while the other
    splits run, then reads it back. The pool's bytes equal those of Triton's rope +
    store then decode attention; the output is theirs within rounding (the fused launch
    compiles without fp fusion, the plain one with)."""
    cuda = get_backend("cuda")

    def run(fused: bool):
        case = PagedCase(lens, 8, 64, 16, dtype=dtype, device="cuda", seed=4)
        gen = torch.Generator().manual_seed(9)
        last = torch.tensor(lens) - 1
        entries = case.block_table.cpu()[torch.arange(len(lens)), last // 16].long()
        ids = (entries * 16 + last % 16).cuda()
        q, k, v = (torch.randn(len(lens), h, 64, generator=gen).to(dtype).cuda()
                   for h in (32, 8, 8))  # fmt: skip
        cos = torch.randn(8192, 32, generator=gen).cuda()
        sin = torch.randn(8192, 32, generator=gen).cuda()
        pos = last.cuda()
        kw = {"page_size": 16, "sm_scale": 0.3}
        if fused:
            out = _call(cuda, case, (q, k, v), cos, sin, pos, ids)
        else:
            q, _ = cuda.rope_store_kv(case.k_cache, case.v_cache, ids, q, k, v, cos, sin, pos)
            out = cuda.decode_attention(q, case.k_cache, case.v_cache, case.block_table,
                                        case.seq_lens, **kw)  # fmt: skip
        torch.cuda.synchronize()
        return out, case.pool.buffer

    got, got_pool = run(True)
    want, want_pool = run(False)
    assert torch.equal(got_pool, want_pool)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the fused launch keeps fp fusion off
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
