"""The fused rope + K/V store (``kernels/attention/rope_store.py``, Triton under the CPU
interpreter) against the two ops it replaces, and the Triton greedy argmax
(``kernels/linear/argmax.py``) against ``torch.argmax``.

rope + store: the pool's bytes after one fused launch equal, byte for byte, those
after the Triton ``rope_qk`` then ``store_kv``; against the torch references
(``elementwise_ref.rope_qk`` then a naive indexed write through the (page, slot)
oracle view) within the elementwise tests' tolerance. q and k are rotated in
place; v is never written.
"""

from __future__ import annotations

import pytest
import torch

from unikv import layout
from unikv.kernels.backend import get_backend
from unikv.kernels.linear import ref as elementwise_ref
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

TRITON = get_backend("cpu", "triton")
TORCH = get_backend("cpu", "torch")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(spec, ps, pages=6):
    cfg = [SubPoolConfig("full", spec, page_size=ps)]
    pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"full": pages}), "cpu")
    pool.buffer.copy_(
        torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=_gen(0))
    )
    return pool


def _step(dtype, hq, hk, d, dv, half, t=7, seed=1):
    """q/k/v as strided views of one fused GEMM output, cos/sin tables, positions."""
    gen = _gen(seed)
    qkv = torch.randn(t, hq * d + hk * d + hk * dv, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * dv], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, dv)
    cos, sin = torch.randn(40, half, generator=gen), torch.randn(40, half, generator=gen)
    positions = torch.randint(0, 40, (t,), generator=gen)
    return qkv, (q, k, v), cos, sin, positions


CASES = [  # (dtype, Hq, H, D, Dv, rotated half, page size)
    (torch.bfloat16, 6, 2, 16, 16, 8, 4),  # full rotary, GQA 3
    (torch.float32, 4, 4, 16, 16, 8, 1),  # MHA, page 1
    (torch.bfloat16, 3, 1, 12, 12, 4, 4),  # partial rotary: 8 of 12 dims, 4 pass through
    (torch.float16, 4, 2, 16, 8, 8, 16),  # asymmetric K/V (page-strided views)
]


@pytest.mark.parametrize("dtype,hq,hk,d,dv,half,ps", CASES)
def test_fused_launch_writes_the_bytes_of_rope_then_store(dtype, hq, hk, d, dv, half, ps):
    spec = MHASpec(num_layers=3, num_kv_heads=hk, head_dim=d, v_head_dim=dv, dtype=dtype)
    pools = [_pool(spec, ps) for _ in range(3)]
    sub = pools[0]["full"]
    physical = torch.randperm(sub.usable_pages * ps, generator=_gen(2))[:7] + sub.first_page * ps
    ids = layout.kernel_ids(physical, ps, sub.blocks_per_page)
    qkv, (q, k, v), cos, sin, pos = _step(dtype, hq, hk, d, dv, half)
    before = qkv.clone()

    # 1) the fused launch, in place on the GEMM output's views
    got_q, got_k = TRITON.rope_store_kv(*pools[0]["full"].views[1], ids, q, k, v, cos, sin, pos)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    v_cols = slice(hq * d + hk * d, None)
    assert torch.equal(qkv[:, v_cols], before[:, v_cols])  # v: read, never written

    # 2) the two Triton ops it replaces, on a copy of the inputs
    _, (q2, k2, v2), *_ = _step(dtype, hq, hk, d, dv, half)
    q2, k2 = TRITON.rope_qk(q2, k2, cos, sin, pos)
    TRITON.store_kv(*pools[1]["full"].views[1], ids, k2, v2)
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    assert torch.equal(got_q, q2) and torch.equal(got_k, k2)

    # 3) the torch references: rope_qk, then a naive write through the (page, slot) view
    _, (q3, k3, v3), *_ = _step(dtype, hq, hk, d, dv, half)
    want_q, want_k = elementwise_ref.rope_qk(q3, k3, cos, sin, pos)
    paged_k, paged_v = pools[2]["full"].paged_views[1]
    page, slot = physical // ps, physical % ps
    paged_k[page, slot], paged_v[page, slot] = want_k, v3
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    got_paged_k, got_paged_v = pools[0]["full"].paged_views[1]
    torch.testing.assert_close(got_paged_k[page, slot], want_k, **tol)
    assert torch.equal(got_paged_v[page, slot], v3)
    for p in (pools[0], pools[2]):  # nothing but the seven rows changed
        pk, pv = p["full"].paged_views[1]
        pk[page, slot], pv[page, slot] = 0, 0
    assert torch.equal(pools[0].buffer, pools[2].buffer)


def test_torch_reference_is_a_complex_rotation_then_an_indexed_write():
    """The torch twin against a second description: each (x1, x2) pair of a head is
    the complex number x1 + i x2 turned by e^(i theta) (fp32), and the rows land
    where a naive write through the (page, slot) view puts them."""
    spec = MHASpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    pool = _pool(spec, 4)
    sub = pool["full"]
    physical = torch.arange(7) + sub.first_page * 4 + 3
    ids = layout.kernel_ids(physical, 4, sub.blocks_per_page)
    _, (q, k, v), cos, sin, pos = _step(torch.float32, 4, 2, 16, 16, 8)
    got_q, got_k = TORCH.rope_store_kv(*sub.views[1], ids, q, k, v, cos, sin, pos)
    turn = torch.complex(cos[pos], sin[pos])[:, None, :]  # (T, 1, R/2)

    def rotated(x):
        z = torch.complex(x[..., :8], x[..., 8:]) * turn
        return torch.cat([z.real, z.imag], dim=-1)

    torch.testing.assert_close(got_q, rotated(q), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, rotated(k), rtol=1e-6, atol=1e-6)
    paged_k, paged_v = sub.paged_views[1]
    page, slot = physical // 4, physical % 4
    torch.testing.assert_close(paged_k[page, slot], rotated(k), rtol=1e-6, atol=1e-6)
    assert torch.equal(paged_v[page, slot], v)


def test_fused_rope_store_rejects_bad_input():
    spec = MHASpec(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    sub = _pool(spec, 4)["full"]
    ids = torch.zeros(7, dtype=torch.int64)
    _, (q, k, v), cos, sin, pos = _step(torch.bfloat16, 4, 2, 16, 16, 8)
    with pytest.raises(ValueError, match="one dtype"):
        TRITON.rope_store_kv(*sub.views[0], ids, q.float(), k, v, cos, sin, pos)
    with pytest.raises(ValueError, match="to match"):
        TRITON.rope_store_kv(*sub.views[0], ids[:5], q, k, v, cos, sin, pos)
    fp8 = MHASpec(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="quantise"):
        TRITON.rope_store_kv(*_pool(fp8, 4)["full"].views[0], ids, q, k, v, cos, sin, pos)


# -- greedy argmax ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 5000), (3, 1024), (40, 3001), (1, 130)])
def test_argmax_is_torch_argmax_with_ties_across_chunks(dtype, rows, vocab):
    logits = torch.randn(rows, vocab + 7, generator=_gen(3)).to(dtype)[:, 3 : 3 + vocab]
    top = logits.max().item() + 1.0
    logits[0, vocab // 2], logits[0, vocab - 1] = top, top  # a tie: the first index wins
    if rows > 1:
        logits[1] = float("-inf")  # nothing finite: index 0
        logits[-1, [vocab - 3, 2, vocab // 3]] = top  # ties in three chunks
    got = TRITON.argmax(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(logits, dim=-1))
    assert got[0] == vocab // 2
    if rows > 1:
        assert got[1] == 0 and got[-1] == 2


def test_argmax_rejects_bad_input():
    with pytest.raises(ValueError, match="unit stride"):
        TRITON.argmax(torch.randn(4, 6).t())
    with pytest.raises(ValueError, match="empty vocabulary"):
        TRITON.argmax(torch.randn(2, 0))
    assert TRITON.argmax(torch.randn(0, 9)).shape == (0,)
