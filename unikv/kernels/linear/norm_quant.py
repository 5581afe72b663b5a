"""The pre-norm of an FP8 linear's prefill variant with its activation quantisation,
in one Triton launch (``add_rms_norm_quant``; torch reference: ``ref.add_rms_norm_quant``).

The unfused path reads x twice: ``add_rms_norm`` writes the normed rows in the model
dtype, then the FP8 GEMM's ``quantize_act`` reads them back and writes FP8 codes and
scales. Here one program per row does both: the residual add and the norm exactly as
``elementwise._rms_norm_kernel`` (same tile, warps and helper), the normed row rounded
to the model dtype, then split in groups of ``group`` columns, each scaled so its
largest |value| maps to 448 (``fp8_gemm._act_quant_kernel``'s arithmetic, IEEE
divisions: scale = max(amax / 448, 1e-12), code = e4m3(clamp(v / scale))). The codes
and scales are those of the two-kernel path bit for bit; the normed rows are never
written.

The same fp32 sum of squares also needs the same register layout: a thread adds the
elements it holds first, so the layout sets the order. Triton derives it from the
memory ops around the row; the norm kernel's bf16 loads and stores give 8 elements a
thread, and this kernel's one-byte FP8 store alone would give 16 at rows of 5,120 and
7,168 (the codes differed from the two-kernel path on the H100). The store's columns
are declared contiguous in runs of 8 only (``tl.max_contiguous``: 8-byte stores), so
the whole row keeps the norm kernel's layout; ``tests/norm_layouts.py`` compiles both
for sm_90a and compares the layouts at the models' widths.

Shapes: a row width N that is not a multiple of ``group`` ends in a partial group
(zeros past N count for nothing in its amax, as ``quantize_act``'s masked lanes);
``group`` must be a power of two (a row's groups are a reshape of its registers): the
FP8 checkpoints' 128 is. A layer whose group is not one never asks (``Fp8BlockLinear.
fuses_norm``); given one, this op refuses it. Rows are independent (any T).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.linear.elementwise import MAX_ROW, rms_normed
from unikv.kernels.linear.fp8_gemm import e4m3_groups
from unikv.kernels.runtime.checks import check_same_device, next_pow2
from unikv.kernels.runtime.interpret import patch_interpreter

patch_interpreter()


@triton.jit
def _add_rms_norm_quant_kernel(
    x, res, w, q, s,
    sx0, sr0, sq0, ss0, ss1, N, n_groups, eps, offset,
    HAS_RES: tl.constexpr, W_FP32: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    dt = x.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    xv = tl.load(x + row * sx0 + cols, mask=mask, other=0.0)
    if HAS_RES:
        rv = tl.load(res + row * sr0 + cols, mask=mask, other=0.0)
        xv = (rv.to(tl.float32) + xv.to(tl.float32)).to(dt)
        tl.store(res + row * sr0 + cols, xv, mask=mask)
    y = rms_normed(xv.to(tl.float32), w, cols, mask, N, eps, offset, dt, W_FP32)
    groups = tl.reshape(y.to(tl.float32), (BLOCK // GROUP, GROUP))  # lanes past N: 0
    codes, scale = e4m3_groups(groups, 1)
    q_cols = tl.max_contiguous(cols, 8)  # 8-byte stores: the norm kernel's layout (above)
    tl.store(q + row * sq0 + q_cols, tl.reshape(codes, (BLOCK,)).to(q.dtype.element_ty), mask=mask)
    g = tl.arange(0, BLOCK // GROUP)
    tl.store(s + row * ss0 + g * ss1, scale, mask=g < n_groups)


def add_rms_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    group: int,
    m_major: bool = False,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xq, xs, x + residual) as ``ref.add_rms_norm_quant``, one launch. x, residual:
    (T, N) bf16 or fp16, unit stride on N (``residual`` None: the norm of x alone,
    x returned as the residual). ``residual`` is overwritten with the sum and
    returned; xq (T, N) float8_e4m3fn and xs (T, ceil(N / group)) fp32 (M-major
    with ``m_major``: strides (1, T)) are new."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or x.stride(-1) != 1:
        raise ValueError(
            f"add_rms_norm_quant: x must be (T, N) bf16 or fp16 with unit stride on N (FP8 "
            f"activations are quantised from 16-bit rows), got {x.dtype} {tuple(x.shape)} "
            f"strides {x.stride()}"
        )
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1
    ):
        raise ValueError(
            f"add_rms_norm_quant: residual must be x's shape {tuple(x.shape)} and dtype "
            f"{x.dtype} with unit stride on N, got {residual.dtype} {tuple(residual.shape)} "
            f"strides {residual.stride()}"
        )
    t, n = x.shape
    if group < 1 or group & (group - 1):
        raise ValueError(
            f"add_rms_norm_quant: group must be a power of two (a row's groups are one "
            f"reshape of its tile), got {group}; run add_rms_norm, then the FP8 linear "
            f"(which quantises any group)"
        )
    if weight.shape != (n,) or n > MAX_ROW:
        raise ValueError(f"weight must be ({n},) with {n} <= {MAX_ROW}, got {tuple(weight.shape)}")
    check_same_device(x, residual, weight)
    groups = triton.cdiv(n, group)
    xq = torch.empty((t, n), dtype=torch.float8_e4m3fn, device=x.device)
    if m_major:
        xs = torch.empty((groups, t), dtype=torch.float32, device=x.device).t()
    else:
        xs = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    out_residual = x if residual is None else residual
    if t == 0:
        return xq, xs, out_residual
    norm_block = next_pow2(n)  # the norm's tile and warps: ``elementwise._norm``'s
    _add_rms_norm_quant_kernel[(t,)](
        x, out_residual, weight, xq, xs,
        x.stride(0), out_residual.stride(0), xq.stride(0), xs.stride(0), xs.stride(1),
        n, groups, float(eps), float(offset),
        HAS_RES=residual is not None, W_FP32=bool(weight_in_fp32),
        BLOCK=max(norm_block, group), GROUP=group,
        num_warps=min(16, max(1, norm_block // 256)), enable_fp_fusion=False,
    )  # fmt: skip
    return xq, xs, out_residual
