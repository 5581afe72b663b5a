"""The K/V store inside decode attention without rope (``decode.store_decode_attention``,
Triton under the CPU interpreter, and its torch twin) against the two ops it replaces
(``store_kv`` then ``decode_attention``) and an fp32 oracle.

NemotronH's attention blocks, Granite-4.0-H's nope layers and the models that rotate q
and k themselves (Zamba2's shared block without rope, MiMo-V2) store a decode step's
K/V rows and attend in this one launch. Each request's last cached row is the decode
token's: NaN before the call (never written), so a split that read it before writing
it would poison its output. The oracle attends in fp32 over the dense K/V with that
row replaced by the step's k and v (``kernel_cases.oracle_attention``). Head dims 6
(under tl.dot's 16 the engine runs the reference, ``runtime/widths.py``; the kernel
runs here under the interpreter) and 40 (padded to 64 lanes), an asymmetric V, page
sizes 1, 4 and 16, with and without the pre-wait loads (``decode.PRELOAD``).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import PagedCase, oracle_attention

from unikv.kernels import get_backend
from unikv.layout import as_paged

TRITON = get_backend("cpu", "triton")
TORCH = get_backend("cpu", "torch")
LENS = [1, 37, 20, 64]


def _case(dtype, heads, group, dim, dim_v, ps, lens=LENS, seed=0, device="cpu"):
    """A paged case whose last rows are NaN, the step's q / k / v as strided views of
    one projection output (NemotronH's q|k|v GEMM) and the tokens' write ids."""
    case = PagedCase(lens, heads, dim, ps, dim_v=dim_v, dtype=dtype, seed=seed, device=device)
    sub = case.pool["full"]
    gen = torch.Generator().manual_seed(seed + 5)
    last = torch.tensor(lens) - 1
    entries = case.block_table.cpu()[torch.arange(len(lens)), last // ps].long()
    page = (entries // sub.blocks_per_page).to(device)
    for view in sub.paged_views[1]:
        view[page, (last % ps).to(device)] = float("nan")  # the new rows: never written yet
    b, hq = len(lens), heads * group
    proj = torch.randn(b, hq * dim + heads * (dim + dim_v), generator=gen).to(dtype).to(device)
    q, k, v = proj.split([hq * dim, heads * dim, heads * dim_v], dim=-1)
    qkv = (q.view(b, hq, dim), k.view(b, heads, dim), v.view(b, heads, dim_v))
    return case, qkv, (entries * ps + last % ps).to(device)  # each request's last row's id


def _call(ops, case, qkv, write_ids, **kw):
    q, k, v = qkv
    return ops.store_decode_attention(
        case.k_cache, case.v_cache, write_ids, q, k, v, case.block_table, case.seq_lens,
        page_size=case.page_size, sm_scale=0.3, **kw,
    )  # fmt: skip


# 16-bit cases in fp16: the interpreter's bf16 dot is wrong (its own decode attention too)
CASES = [  # (dtype, H, group, D, Dv, page size, decode keywords)
    (torch.float16, 2, 4, 40, 40, 4, {"num_splits": 3}),
    (torch.float16, 2, 2, 6, 6, 1, {"num_splits": 2}),
    (torch.float16, 1, 3, 40, 24, 16, {"num_splits": 8}),  # empty splits at short requests
    (torch.float16, 2, 2, 6, 10, 4, {"window": 11, "num_splits": 2}),
    (torch.float32, 2, 2, 40, 40, 16, {"sinks": "rand", "soft_cap": 4.0, "num_splits": 1}),
]


def _kw(extra, hq):
    kw = dict(extra)
    if kw.get("sinks") == "rand":
        kw["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(3))
    return kw


@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("dtype,heads,group,dim,dim_v,ps,extra", CASES)
def test_fused_launch_equals_store_then_decode(dtype, heads, group, dim, dim_v, ps, extra,
                                               preload):  # fmt: skip
    """The pool's bytes after the fused launch equal those after Triton's ``store_kv``
    then ``decode_attention``, and so does the output, bit for bit (the same loads and
    arithmetic; with the preload, the new row joins the first tile from registers)."""
    kw = _kw(extra, heads * group)
    case, qkv, ids = _case(dtype, heads, group, dim, dim_v, ps)
    before = [t.clone() for t in qkv]
    got = _call(TRITON, case, qkv, ids, preload=preload, **kw)
    assert all(torch.equal(a, b) for a, b in zip(qkv, before))
    two, (q, k, v), _ = _case(dtype, heads, group, dim, dim_v, ps)
    TRITON.store_kv(two.k_cache, two.v_cache, ids, k, v)
    want = TRITON.decode_attention(q, two.k_cache, two.v_cache, two.block_table, two.seq_lens,
                                   page_size=ps, sm_scale=0.3, preload=False, **kw)  # fmt: skip
    assert torch.equal(case.pool.buffer, two.pool.buffer)
    assert torch.equal(got, want) and not got.isnan().any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype,heads,group,dim,dim_v,ps,extra", CASES)
def test_fused_launch_matches_the_oracle(backend, dtype, heads, group, dim, dim_v, ps, extra):
    """Against fp32 attention over the dense K/V whose last row is the step's k and v;
    those rows land in the pool at the write ids, bit for bit."""
    kw = _kw(extra, heads * group)
    case, (q, k, v), ids = _case(dtype, heads, group, dim, dim_v, ps)
    splits = {} if backend == "torch" else {"num_splits": kw["num_splits"]}
    kw.pop("num_splits")
    got = _call(get_backend("cpu", backend), case, (q, k, v), ids, **kw, **splits)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for b, n in enumerate(LENS):
        keys, values = case.dense_k[b].clone(), case.dense_v[b].clone()
        keys[-1], values[-1] = k[b].float(), v[b].float()
        want = oracle_attention(q[b : b + 1], keys, values, [n - 1], sm_scale=0.3, **kw)
        torch.testing.assert_close(got[b : b + 1].float(), want, rtol=tol, atol=tol)
    rows = [as_paged(view, ps)[ids // ps, ids % ps] for view in (case.k_cache, case.v_cache)]
    assert torch.equal(rows[0], k) and torch.equal(rows[1], v)


def test_fused_launch_rejects_bad_input():
    """Mismatched dtypes (an fp8 cache takes the two-op path), row counts, and rows
    without unit stride on the head dim, each named."""
    case, (q, k, v), ids = _case(torch.float16, 2, 2, 40, 40, 4)
    with pytest.raises(ValueError, match="store_decode_attention needs q, k, v and the caches"):
        _call(TRITON, case, (q.float(), k, v), ids)
    with pytest.raises(ValueError, match="to match"):
        _call(TRITON, case, (q, k, v), ids[:2])
    k_wide = torch.zeros(k.shape[0], k.shape[1], 2 * k.shape[2], dtype=k.dtype)[..., ::2]
    with pytest.raises(ValueError, match="unit stride"):
        _call(TRITON, case, (q, k_wide, v), ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lens", [[644], [1, 300, 17, 4096, 64, 9, 700, 2000]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_launch_on_the_gpu_equals_the_two_ops(lens, dtype):
    """On the GPU at NemotronH-8B's heads (32 / 8, head dim 128, page 16) with the split
    count the planner picks (one request: the preload too, under PDL on Hopper): the
    split holding the new row writes it while the other splits run, then reads it
    back. The pool's bytes equal those of Triton's store then decode attention, and the
    output theirs (the same arithmetic; 1e-6 for a compiler's own scheduling)."""
    cuda = get_backend("cuda")
    results = []
    for fused in (True, False):
        case, (q, k, v), ids = _case(dtype, 8, 4, 128, 128, 16, lens=lens, seed=4, device="cuda")
        if fused:
            out = _call(cuda, case, (q, k, v), ids)
        else:
            cuda.store_kv(case.k_cache, case.v_cache, ids, k, v)
            out = cuda.decode_attention(q, case.k_cache, case.v_cache, case.block_table,
                                        case.seq_lens, page_size=16, sm_scale=0.3)  # fmt: skip
        torch.cuda.synchronize()
        results.append((out, case.pool.buffer))
    (got, got_pool), (want, want_pool) = results
    assert torch.equal(got_pool, want_pool) and not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
