"""The fused MoE over block-scaled FP8 experts (``fp8_gemm_ref.moe_fp8``, the backends'
``moe_fp8``), on CPU.

Oracle: each expert's gate, up and down matrices dequantised one scalar scale at a time
by the naive block loop (``test_kernels_fp8_gemm.naive_dequant``), stacked, and run by
the 16-bit MoE reference (``moe_ref.fused_moe``). Block sizes leave partial edge blocks
and an intermediate width that is not a multiple of the row block, so gate and up each
carry their own scale rows.

- one chunk: equal to the oracle bit for bit (fp32), SwiGLU and relu2;
- several chunks (a small ``chunk_bytes``: experts outside a chunk get zero routing
  weight): equal to the oracle to fp32 rounding;
- the Triton backend's ``moe_fp8`` (the fused MoE dequantising each FP8 tile,
  ``kernels/moe/fp8.py``, under the interpreter; these 8 x 12 blocks take a multiplier
  per element) matches the torch backend's, fp32 and bf16;
- 16-bit experts are refused with what was given.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels_fp8_gemm import naive_dequant

from unikv.kernels.backend import get_backend
from unikv.kernels.linear import fp8_gemm_ref
from unikv.kernels.moe import ref as moe_ref

FP8_MAX = 448.0
BLOCK = (8, 12)


def _quantised(e: int, rows: int, cols: int, parts: int, g) -> tuple:
    """(FP8 stack (E, parts * rows, cols), scales (E, parts * ceil(rows / bn), .),
    the oracle's fp32 stack)."""
    ws, ss, real = [], [], []
    for _ in range(e):
        qs, scales, deq = [], [], []
        for _ in range(parts):
            q = (torch.randn(rows, cols, generator=g) * 80).clamp(-FP8_MAX, FP8_MAX)
            q = q.to(torch.float8_e4m3fn)
            shape = (math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1]))
            s = torch.rand(shape, generator=g) * 0.004 + 1e-4
            qs.append(q), scales.append(s), deq.append(naive_dequant(q, s, BLOCK))
        ws.append(torch.cat(qs)), ss.append(torch.cat(scales)), real.append(torch.cat(deq))
    return torch.stack(ws), torch.stack(ss), torch.stack(real)


def _case(activation: str, tokens: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    e, d, i, k = 5, 20, 18, 2  # i: two row blocks and a partial one per part
    parts = 1 if activation == "relu2" else 2
    w1, s1, r1 = _quantised(e, i, d, parts, g)
    w2, s2, r2 = _quantised(e, d, i, 1, g)
    x = torch.randn(tokens, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return x, weights, ids, (w1, s1, w2, s2), (r1, r2)


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_one_chunk_equals_the_dequantised_moe(activation):
    x, weights, ids, (w1, s1, w2, s2), (r1, r2) = _case(activation)
    got = fp8_gemm_ref.moe_fp8(x, weights, ids, w1, s1, w2, s2, block=BLOCK, activation=activation)
    want = moe_ref.fused_moe(x, weights, ids, r1, r2, activation=activation)
    assert torch.equal(got, want)
    assert want.abs().max() > 0


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_chunks_of_experts_sum_to_the_dequantised_moe(activation):
    x, weights, ids, (w1, s1, w2, s2), (r1, r2) = _case(activation)
    one_expert = (w1[0].numel() + w2[0].numel()) * 4
    got = fp8_gemm_ref.moe_fp8(
        x,
        weights,
        ids,
        w1,
        s1,
        w2,
        s2,
        block=BLOCK,
        activation=activation,
        chunk_bytes=2 * one_expert,
    )  # fmt: skip  (3 chunks of 2, 2 and 1 experts)
    want = moe_ref.fused_moe(x, weights, ids, r1, r2, activation=activation)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_the_torch_backend(dtype):
    x, weights, ids, (w1, s1, w2, s2), _ = _case("silu", tokens=5, seed=1)
    x, weights = x.to(dtype), weights.to(dtype)
    args = (x, weights, ids, w1, s1, w2, s2)
    want = get_backend("cpu", "torch").moe_fp8(*args, block=BLOCK)
    got = get_backend("cpu", "triton").moe_fp8(*args, block=BLOCK)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def test_16_bit_experts_are_refused():
    x, weights, ids, (_, s1, w2, s2), (r1, _) = _case("silu")
    with pytest.raises(ValueError, match="float8_e4m3fn") as err:
        fp8_gemm_ref.moe_fp8(x, weights, ids, r1, s1, w2, s2, block=BLOCK)
    assert "torch.float32" in str(err.value)
