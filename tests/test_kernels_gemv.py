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
    got = gemv.gemv(x, w, cfg)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


def test_gemv_refuses_what_it_cannot_take():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="F.linear"):
        gemv.gemv(torch.randn(5, 16), w)  # too many rows
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        gemv.gemv(torch.randn(1, 12), w)
    with pytest.raises(ValueError, match="cast"):
        gemv.gemv(torch.randn(1, 16).bfloat16(), w)
