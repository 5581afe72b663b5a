"""Triton kernels of two output activations that the unfused torch formula runs as two
launches each; one launch here, with the rounding of their torch references
(``ref.sigmoid_mul``, ``ref.relu_square``):

- ``sigmoid_mul``: ``x * sigmoid(gate)``, the per-head output gate of Qwen3.5's and
  Qwen3-Next's gated attention (the gate a strided view of the q|gate GEMM output,
  read in place: no copy) and Qwen3-Next's shared-expert gate (one gate per row,
  broadcast by a zero stride), with an optional addend ``add + x * sigmoid(gate)``
  (the shared expert's output added to the routed experts' in the same launch).
- ``relu_square``: ``relu(x) ** 2``, NemotronH's MLP and shared-expert activation.

The sigmoid is rounded to the model dtype before the product, as ``torch.sigmoid``
then ``*`` round it; the square is one fp32 product rounded once, as ``square`` in
the model dtype. Floating-point contraction is left off (the fp32 references).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.checks import check_same_device, next_pow2
from unikv.kernels.runtime.interpret import patch_interpreter

patch_interpreter()  # the interpreter's bf16 casts round as the GPU's do

BLOCK_MAX = 1024  # columns one program covers


@triton.jit
def _sigmoid_mul_kernel(
    x, g, a, out, n1, sx0, sx1, sx2, sg0, sg1, sg2, sa0, sa1, sa2, D,
    HAS_ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    t, h = row // n1, row % n1
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    dt = out.dtype.element_ty
    xv = tl.load(x + t * sx0 + h * sx1 + cols * sx2, mask=mask, other=0.0).to(tl.float32)
    gv = tl.load(g + t * sg0 + h * sg1 + cols * sg2, mask=mask, other=0.0).to(tl.float32)
    s = tl.div_rn(1.0, 1.0 + tl.exp(-gv)).to(dt).to(tl.float32)
    y = (xv * s).to(dt)
    if HAS_ADD:  # the product rounded to the dtype, then the sum, as torch's two ops
        av = tl.load(a + t * sa0 + h * sa1 + cols * sa2, mask=mask, other=0.0).to(tl.float32)
        y = (av + y.to(tl.float32)).to(dt)
    tl.store(out + row * D + cols, y, mask=mask)


def sigmoid_mul(
    x: torch.Tensor, gate: torch.Tensor, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``x * sigmoid(gate)``, or ``add + x * sigmoid(gate)`` given ``add``
    (``ref.sigmoid_mul``), one launch.

    x: (T, N) or (T, H, D) float; gate and add: x's shape and dtype; all any strides
    (the gate a strided view, or a zero stride broadcasting it). Returns a new
    contiguous tensor of x's shape and dtype."""
    operands = {"gate": gate} if add is None else {"gate": gate, "add": add}
    for name, t in operands.items():
        if x.dim() not in (2, 3) or t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(
                f"sigmoid_mul needs x (T, N) or (T, H, D) and a {name} of its shape and "
                f"dtype, got x {tuple(x.shape)} {x.dtype}, {name} {tuple(t.shape)} {t.dtype}"
            )
        check_same_device(x, t)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x3 = x if x.dim() == 3 else x[:, None]
    g3 = gate if gate.dim() == 3 else gate[:, None]
    a3 = g3 if add is None else add if add.dim() == 3 else add[:, None]  # (unread: no add)
    t, n1, d = x3.shape
    block = min(BLOCK_MAX, next_pow2(d))
    _sigmoid_mul_kernel[(t * n1, triton.cdiv(d, block))](
        x3, g3, a3, out, n1, *x3.stride(), *g3.stride(), *a3.stride(), d,
        HAS_ADD=add is not None, BLOCK=block, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out


@triton.jit
def _relu_square_kernel(x, out, sx0, sx1, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    v = tl.load(x + row * sx0 + cols * sx1, mask=mask, other=0.0).to(tl.float32)
    v = tl.where(v < 0.0, 0.0, v)  # NaN stays NaN, as torch.relu keeps it
    tl.store(out + row * N + cols, (v * v).to(out.dtype.element_ty), mask=mask)


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (``ref.relu_square``), one launch.

    x: (T, N) float, any strides. Returns a new contiguous (T, N) tensor in x.dtype."""
    if x.dim() != 2:
        raise ValueError(f"relu_square needs a (T, N) tensor, got shape {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    t, n = x.shape
    block = min(BLOCK_MAX, next_pow2(n))
    _relu_square_kernel[(t, triton.cdiv(n, block))](
        x, out, *x.stride(), n, BLOCK=block, num_warps=4, enable_fp_fusion=False
    )
    return out
