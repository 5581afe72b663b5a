"""Fused MoE in Triton: only the routed experts run, MXFP4 weights stay packed.

Semantics and argument layouts: ``kernels/moe_ref.py`` (same signature).

    topk_ids (T, k) ──align──> sorted_ids (num_blocks * BLOCK_M,)  assignment ids t*k+j,
                               grouped by expert, each expert's run padded to BLOCK_M
                               (padding = M, the sentinel); block_experts (num_blocks,)
                               the expert of each BLOCK_M rows, -1 past the last block
    _gate_up_kernel  grid (num_blocks, cdiv(I, BLOCK_N)): gathers x rows, one grouped
                     GEMM tile for gate and up of the block's expert, the activation,
                     -> act (num_blocks * BLOCK_M, I) in x.dtype (sorted order)
    _down_kernel     grid (num_blocks, cdiv(d, BLOCK_N)): act @ W_down^T (+ bias), times
                     the routing weight -> y (M, d) fp32 at the assignment's row
    out = y.view(T, k, d).sum(1).to(x.dtype)

The alignment is torch ops with no host sync: ``num_blocks`` is an upper bound from
the host ints (T, k, E), so shapes depend only on T (CUDA-graph safe). MXFP4 tiles
are dequantised in registers: each element's byte (k // 2) and scale (k // 32) are
loaded (repeated addresses hit the cache), never a dequantised copy in memory.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from unikv.kernels._interpret import patch_interpreter
from unikv.kernels.moe_ref import check_moe_args

patch_interpreter()  # run-time loop bounds under TRITON_INTERPRET=1 (no-op otherwise)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # fixed at import
ACT_CODES = {"silu": 0, "gpt_oss": 1, "relu2": 2}
BLOCK_N = 64
BLOCK_K = 64  # a multiple of the MXFP4 group (32)
NUM_WARPS = 4


@triton.jit
def _weight_tile(
    w_ptr, s_ptr, expert, rows, ks, mask, s_we, s_wn, s_wk, s_se, s_sn, s_sk, MXFP4: tl.constexpr
):
    """(BLOCK_K, BLOCK_N) tile of expert's weight: W[rows[n], ks[k]] as fp32 (MXFP4)
    or in the weight dtype; masked elements are 0."""
    base = expert.to(tl.int64) * s_we + rows[None, :].to(tl.int64) * s_wn
    if MXFP4:
        byte = tl.load(w_ptr + base + (ks[:, None] // 2) * s_wk, mask=mask, other=0)
        code = (byte.to(tl.int32) >> ((ks[:, None] % 2) * 4)) & 0x0F
        exp = (code >> 1) & 3
        mant = (code & 1).to(tl.float32)
        mag = tl.where(exp == 0, mant * 0.5, (2.0 + mant) * tl.exp2(exp.to(tl.float32) - 2.0))
        value = tl.where((code & 8) != 0, -mag, mag)
        s_base = expert.to(tl.int64) * s_se + rows[None, :].to(tl.int64) * s_sn
        scale = tl.load(s_ptr + s_base + (ks[:, None] // 32) * s_sk, mask=mask, other=127)
        tile = value * tl.exp2(scale.to(tl.float32) - 127.0)
    else:  # one return: Triton compiles a return after a taken constexpr branch too
        tile = tl.load(w_ptr + base + ks[:, None].to(tl.int64) * s_wk, mask=mask, other=0.0)
    return tile


@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr):
    """acc + a @ w: fp32 products when IEEE (fp32 models; the interpreter, whose
    dot is wrong on bf16/fp16), else in a's dtype with fp32 accumulation."""
    if IEEE:
        acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w.to(a.dtype), acc)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, act_ptr, sorted_ids_ptr, block_experts_ptr,
    num_assign, top_k, K, I,
    s_xm, s_xk, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_be, s_bn, s_am, s_an,
    row_step, up_offset, alpha, limit,
    ACT: tl.constexpr, MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + pos)
    valid = assign < num_assign
    token = (assign // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate features j
    col_ok = cols < I
    gate_rows, up_rows = cols * row_step, cols * row_step + up_offset
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            x_ptr + token[:, None] * s_xm + ks[None, :] * s_xk,
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_ok = k_ok[:, None] & col_ok[None, :]
        wu = _weight_tile(w_ptr, s_ptr, expert, up_rows, ks, w_ok, s_we, s_wn, s_wk, s_se, s_sn,
                          s_sk, MXFP4)  # fmt: skip
        acc_u = _dot(a, wu, acc_u, IEEE)
        if ACT != 2:
            wg = _weight_tile(w_ptr, s_ptr, expert, gate_rows, ks, w_ok, s_we, s_wn, s_wk, s_se,
                              s_sn, s_sk, MXFP4)  # fmt: skip
            acc_g = _dot(a, wg, acc_g, IEEE)
    if HAS_BIAS:
        b_base = b_ptr + expert.to(tl.int64) * s_be
        acc_u += tl.load(b_base + up_rows * s_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(b_base + gate_rows * s_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACT == 0:  # silu(gate) * up
        out = acc_g * tl.sigmoid(acc_g) * acc_u
    elif ACT == 1:  # gpt-oss: clamped gate and up, (up + 1) * gate * sigmoid(alpha gate)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        out = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    else:  # relu(up) ** 2
        r = tl.maximum(acc_u, 0.0)
        out = r * r
    dst = act_ptr + pos[:, None].to(tl.int64) * s_am + cols[None, :] * s_an
    tl.store(dst, out.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ids_ptr, block_experts_ptr,
    num_assign, N, K,
    s_am, s_ak, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_be, s_bn, s_ym, s_yn,
    MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + pos)
    valid = assign < num_assign
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden features
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            act_ptr + pos[:, None].to(tl.int64) * s_am + ks[None, :] * s_ak,
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = _weight_tile(w_ptr, s_ptr, expert, cols, ks, k_ok[:, None] & col_ok[None, :], s_we,
                         s_wn, s_wk, s_se, s_sn, s_sk, MXFP4)  # fmt: skip
        acc = _dot(a, w, acc, IEEE)
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert.to(tl.int64) * s_be + cols * s_bn, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    weight = tl.load(tw_ptr + assign, mask=valid, other=0.0).to(tl.float32)
    dst = y_ptr + assign[:, None].to(tl.int64) * s_ym + cols[None, :] * s_yn
    tl.store(dst, acc * weight[:, None], mask=valid[:, None] & col_ok[None, :])


def block_m_for(num_assign: int, num_experts: int) -> int:
    """Rows per tile: about the mean tokens per expert, 16..64 (host ints only)."""
    mean = num_assign // max(num_experts, 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids: (T, k) expert ids -> (sorted_ids (num_blocks * block_m,) int32
    assignment ids (t * k + j) grouped by expert, each run padded to block_m with M =
    T * k; block_experts (num_blocks,) int32 expert of each block, -1 for unused).
    Device ops only, no host sync; num_blocks is a host bound on the blocks used."""
    flat = topk_ids.reshape(-1).long()
    m = flat.numel()
    num_blocks = max(1, min(m, (m + num_experts * (block_m - 1)) // block_m))
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    starts = counts.cumsum(0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(m, device=flat.device) - starts[sorted_experts]
    dest = padded_ends[sorted_experts] - padded[sorted_experts] + rank
    sorted_ids = torch.full((num_blocks * block_m,), m, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_ids, block_experts.to(torch.int32)


def _w_strides(w: torch.Tensor, scales: torch.Tensor | None) -> tuple[torch.Tensor, tuple]:
    """(scales or a dummy, strides (we, wn, wk, se, sn, sk)) in elements of one K step."""
    if scales is None:
        return w, (*w.stride(), 0, 0, 0)
    return scales, (w.stride(0), w.stride(1), 1, scales.stride(0), scales.stride(1), 1)


def _check_mxfp4_contiguous(w: torch.Tensor, scales: torch.Tensor | None) -> None:
    if scales is not None and (w.stride(3) != 1 or w.stride(2) != 16 or scales.stride(2) != 1):
        raise ValueError("MXFP4 blocks must have contiguous (G, 16) rows and scales (G,) rows")


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    w1_scales: torch.Tensor | None = None,
    w2_scales: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    gate_up: str = "concat",
    alpha: float = 1.702,
    limit: float = 7.0,
    sum_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x: (T, d) model dtype; topk_weights: (T, k); topk_ids: (T, k) int32/int64 in
    [0, E) -> (T, d) in x.dtype. Layouts: ``moe_ref.fused_moe``. Accumulates in fp32
    whatever ``sum_dtype`` (kept for the reference's signature)."""
    num_experts, inter = check_moe_args(
        x, topk_weights, topk_ids, w1, w2, w1_scales, w2_scales, activation, gate_up
    )
    _check_mxfp4_contiguous(w1, w1_scales)
    _check_mxfp4_contiguous(w2, w2_scales)
    t, d = x.shape
    m = topk_ids.numel()
    if m == 0:
        return torch.zeros_like(x)
    block_m = block_m_for(m, num_experts)
    sorted_ids, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_experts.shape[0]
    act = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32 or INTERPRETED
    s1, st1 = _w_strides(w1, w1_scales)
    bias1 = b1 if b1 is not None else x
    interleaved = gate_up == "interleaved"
    row_step = 2 if interleaved and activation != "relu2" else 1
    up_offset = 0 if activation == "relu2" else (1 if interleaved else inter)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, BLOCK_N))](
        x, w1, s1, bias1, act, sorted_ids, block_experts,
        m, topk_ids.shape[1], d, inter,
        *x.stride(), *st1, bias1.stride(0), bias1.stride(-1), *act.stride(),
        row_step, up_offset, float(alpha), float(limit),
        ACT=ACT_CODES[activation], MXFP4=w1_scales is not None, HAS_BIAS=b1 is not None,
        IEEE=ieee, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
    )  # fmt: skip
    y = torch.empty(m, d, dtype=torch.float32, device=x.device)
    tw = topk_weights.reshape(-1)
    s2, st2 = _w_strides(w2, w2_scales)
    bias2 = b2 if b2 is not None else x
    _down_kernel[(num_blocks, triton.cdiv(d, BLOCK_N))](
        act, w2, s2, bias2, tw, y, sorted_ids, block_experts,
        m, d, inter,
        *act.stride(), *st2, bias2.stride(0), bias2.stride(-1), *y.stride(),
        MXFP4=w2_scales is not None, HAS_BIAS=b2 is not None, IEEE=ieee,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
    )  # fmt: skip
    return y.view(t, -1, d).sum(1).to(x.dtype)
