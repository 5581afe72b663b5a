"""Triton rope of interleaved pairs (DeepSeek's MLA rope dims), q and k in one launch
(``ref.rope_pairs`` is its torch twin, the rounding it keeps).

Pairs (x[2i], x[2i+1]) of each head's R rope dims are rotated by the (cos_i, sin_i)
of the token's position, in one of two layouts (``deepseek.py``'s docstring):

- "complex" (DeepSeek-V2, transformers' complex product): in fp32, kept interleaved,
  each rotated value rounded once to the model dtype;
- "interleave" (DeepSeek-V3): in the model dtype, cos / sin cast to it, each product
  and the sum rounded to it as torch's ops round them, written ``[evens' | odds']``.

One program per token rotates every q head and k's head(s) from one read of its cos /
sin row. The unfused torch form was 16 launches (two gathers of the tables, then four
products, a difference, a sum and a stack for each of q and k). Floating-point
contraction is left off (the references' separate roundings).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.checks import check_same_device, next_pow2
from unikv.kernels.runtime.interpret import patch_interpreter

patch_interpreter()  # the interpreter's bf16 casts round as the GPU's do

LAYOUTS = ("complex", "interleave")


@triton.jit
def _rotate_pairs(x, s0, s1, out, T, H, c, s, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_R: tl.constexpr, FP32: tl.constexpr):  # fmt: skip
    """Token T's H heads of x (rows s0, heads s1 apart) rotated into out (T, H, 2 HALF)."""
    heads = tl.arange(0, BLOCK_H)
    lanes = tl.arange(0, BLOCK_R)
    mask = (heads < H)[:, None] & (lanes < HALF)[None, :]
    src = x + T * s0 + heads.to(tl.int64)[:, None] * s1 + 2 * lanes[None, :]
    even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    dt = out.dtype.element_ty
    dst = out + (T * H + heads.to(tl.int64))[:, None] * (2 * HALF)
    if FP32:  # "complex": fp32 products and sums, stored interleaved
        a = even * c[None, :] - odd * s[None, :]
        b = even * s[None, :] + odd * c[None, :]
        tl.store(dst + 2 * lanes[None, :], a.to(dt), mask=mask)
        tl.store(dst + 2 * lanes[None, :] + 1, b.to(dt), mask=mask)
    else:  # "interleave": each product and sum rounded to dt, stored [evens' | odds']
        a = (even * c[None, :]).to(dt).to(tl.float32) - (odd * s[None, :]).to(dt).to(tl.float32)
        b = (odd * c[None, :]).to(dt).to(tl.float32) + (even * s[None, :]).to(dt).to(tl.float32)
        tl.store(dst + lanes[None, :], a.to(dt), mask=mask)
        tl.store(dst + HALF + lanes[None, :], b.to(dt), mask=mask)


@triton.jit
def _rope_pairs_kernel(q, k, q_out, k_out, cos, sin, pos, sq0, sq1, sk0, sk1, sc0, HQ, HK,
                       HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                       BLOCK_R: tl.constexpr, FP32: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos + t).to(tl.int64)
    lanes = tl.arange(0, BLOCK_R)
    c = tl.load(cos + p * sc0 + lanes, mask=lanes < HALF, other=0.0)
    s = tl.load(sin + p * sc0 + lanes, mask=lanes < HALF, other=0.0)
    if not FP32:  # the tables cast to the model dtype first
        c = c.to(q_out.dtype.element_ty).to(tl.float32)
        s = s.to(q_out.dtype.element_ty).to(tl.float32)
    _rotate_pairs(q, sq0, sq1, q_out, t, HQ, c, s, HALF, BLOCK_HQ, BLOCK_R, FP32)
    _rotate_pairs(k, sk0, sk1, k_out, t, HK, c, s, HALF, BLOCK_HK, BLOCK_R, FP32)


def rope_pairs(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref.rope_pairs`` in one launch: q (T, Hq, R), k (T, Hk, R) one float dtype,
    unit stride on R (rows and heads may be strided: views of a projection's output);
    cos, sin (P, R / 2) fp32; positions (T,) int; layout "complex" or "interleave".
    Returns new contiguous rotated (q, k)."""
    if layout not in LAYOUTS:
        raise ValueError(f"rope_pairs layout must be one of {LAYOUTS}, got {layout!r}")
    half = cos.shape[-1]
    num_tokens = positions.shape[0] if positions.dim() == 1 else -1
    if (
        q.dim() != 3
        or k.dim() != 3
        or q.shape[0] != num_tokens
        or k.shape[0] != num_tokens
        or q.shape[2] != 2 * half
        or k.shape[2] != 2 * half
        or sin.shape != cos.shape
    ):
        raise ValueError(
            f"rope_pairs needs q (T, Hq, 2 * {half}), k (T, Hk, 2 * {half}) and positions "
            f"(T,) for cos / sin tables of {half} columns; got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}, positions {tuple(positions.shape)}, sin {tuple(sin.shape)}"
        )
    if q.dtype != k.dtype or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(
            f"rope_pairs needs q and k of one dtype with unit stride on the rope dim, got "
            f"{q.dtype} {q.stride()}, {k.dtype} {k.stride()}"
        )
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError(
            f"rope_pairs needs cos and sin with one layout and unit column stride, got "
            f"{cos.stride()} and {sin.stride()}"
        )
    check_same_device(q, k, cos, sin, positions)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _rope_pairs_kernel[(num_tokens,)](
        q, k, q_out, k_out, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), cos.stride(0), q.shape[1], k.shape[1],
        HALF=half, BLOCK_HQ=next_pow2(q.shape[1]), BLOCK_HK=next_pow2(k.shape[1]),
        BLOCK_R=next_pow2(half), FP32=layout == "complex", num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return q_out, k_out
