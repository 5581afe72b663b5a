"""The Triton GEMV (``kernels/gemv.py``, on CPU through the interpreter) against
``F.linear`` on the same operands: 1-4 rows, K a multiple of the K tile and not, N
not a multiple of the row tile, strided rows of x (a slice of a wider activation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unikv.kernels import gemv


@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("n, k, cfg", [(40, 64, (8, 32, 4, 2)), (37, 100, (16, 32, 4, 1)),
                                       (9, 256, (4, 128, 4, 3))])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_linear(m, n, k, cfg, dtype):
    g = torch.Generator().manual_seed(m * n + k)
    wide = torch.randn(m, k + 24, generator=g).to(dtype)
    x = wide[:, 5 : 5 + k]  # row stride k + 24
    w = torch.randn(n, k, generator=g).to(dtype)
    want = F.linear(x.float(), w.float())
    got = gemv.gemv(x, w, config=cfg)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


def test_gemv_refuses_what_it_cannot_take():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="F.linear"):
        gemv.gemv(torch.randn(5, 16), w)  # too many rows
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        gemv.gemv(torch.randn(1, 12), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv.gemv(torch.randn(1, 16).bfloat16(), w)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_fused_silu_mul_and_bias_match_the_two_ops(m, bias):
    """SwiGLU fused into the GEMV's loads, with a bias: against the torch reference's
    ``F.linear(silu_mul(gate_up)) + b`` in bf16, and the fp32 case to 1e-5."""
    from unikv.kernels import elementwise_ref

    g = torch.Generator().manual_seed(m + 2 * bias)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        gu = (torch.randn(m, 2 * 72, generator=g) * 3).to(dtype)
        w = torch.randn(40, 72, generator=g).to(dtype)
        b = torch.randn(40, generator=g).to(dtype) if bias else None
        act = elementwise_ref.silu_mul(gu)
        want = F.linear(act.float(), w.float(), None if b is None else b.float())
        got = gemv.gemv(gu, w, b, (16, 32, 4, 2), silu_mul_input=True)
        assert (got.float() - want).abs().max() <= tol * want.abs().max()


def test_backend_linear_ops_route_by_rows():
    """The Triton backend's ``linear`` / ``silu_mul_linear`` equal the torch
    backend's at one row (the GEMV) and at more rows than ROUTE_ROWS (cuBLAS)."""
    from unikv.kernels.backend import get_backend

    tri, ref = get_backend("cpu", "triton"), get_backend("cpu", "torch")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 64, generator=g).bfloat16()
    for rows in (1, gemv.ROUTE_ROWS + 3):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        gu = torch.randn(rows, 128, generator=g).bfloat16()
        for op, arg in (("linear", x), ("silu_mul_linear", gu)):
            want = getattr(ref, op)(arg, w).float()
            got = getattr(tri, op)(arg, w).float()
            assert (got - want).abs().max() <= 1e-2 * want.abs().max(), (op, rows)
