"""Triton sandwich norm: a block's post-norm, the residual add and the next block's
pre-norm in one launch (Gemma's layers, where every block's output is normed before
it joins the residual stream):

    y = rms_norm(x, post_weight) ; residual = residual + y ; out = rms_norm(residual, pre_weight)

One program per row holds the row in registers (both norms need its whole sum of
squares). Each value the unfused torch formula (``ref.sandwich_rms_norm``: ``rms_norm``
then ``add_rms_norm``) rounds to the model dtype is rounded here too: the post-norm's
output, the sum (written back into ``residual`` in place) and the pre-norm's output;
the statistics are fp32, contraction (FMA) is off, as ``elementwise.py``'s norms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.linear.elementwise import MAX_ROW, rms_normed
from unikv.kernels.runtime.checks import check_same_device, next_pow2
from unikv.kernels.runtime.interpret import patch_interpreter

patch_interpreter()  # the interpreter's bf16 casts round as the GPU's do


@triton.jit
def _sandwich_norm_kernel(
    x, res, wa, wb, out, sx0, sr0, N, eps, offset,
    W_FP32: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    dt = out.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    h = tl.load(x + row * sx0 + cols, mask=mask, other=0.0).to(tl.float32)
    y = rms_normed(h, wa, cols, mask, N, eps, offset, dt, W_FP32)
    rv = tl.load(res + row * sr0 + cols, mask=mask, other=0.0)
    s = (rv.to(tl.float32) + y.to(tl.float32)).to(dt)
    tl.store(res + row * sr0 + cols, s, mask=mask)
    o = rms_normed(s.to(tl.float32), wb, cols, mask, N, eps, offset, dt, W_FP32)
    tl.store(out + row * N + cols, o, mask=mask)


def sandwich_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    pre_weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + rms_norm(x, post_weight), pre_weight), that sum), one launch
    (``ref.sandwich_rms_norm``). x, residual: (T, N), one dtype, unit stride on N (x's
    rows may be strided); both weights (N,), one eps, ``offset`` and ``weight_in_fp32``.
    ``residual`` is overwritten with the sum and returned; the normed rows are new."""
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"sandwich_rms_norm needs x and residual of one (T, N) shape and dtype, got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}"
        )
    n = x.shape[1]
    if post_weight.shape != (n,) or pre_weight.shape != (n,) or n > MAX_ROW:
        raise ValueError(
            f"sandwich_rms_norm needs post and pre weights ({n},) with N {n} <= {MAX_ROW}, "
            f"got {tuple(post_weight.shape)} and {tuple(pre_weight.shape)}"
        )
    if x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError(
            f"sandwich_rms_norm needs unit stride on N, got x {x.stride()} and residual "
            f"{residual.stride()}: pass contiguous rows"
        )
    check_same_device(x, residual, post_weight, pre_weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out, residual
    block = next_pow2(n)
    _sandwich_norm_kernel[(x.shape[0],)](
        x, residual, post_weight, pre_weight, out, x.stride(0), residual.stride(0),
        n, float(eps), float(offset), W_FP32=bool(weight_in_fp32), BLOCK=block,
        num_warps=min(16, max(1, block // 256)), enable_fp_fusion=False,
    )  # fmt: skip
    return out, residual
