"""Triton rope + K/V store: one launch rotates a step's q and k and writes the
rotated K and V rows into the cache (``reference.rope_store_kv`` is its torch twin).

One program per token: it reads the token's cos/sin row once, rotates every q
head and every k head (NeoX "rotate half" of the first R dims, the products
rounded to the model dtype as ``elementwise.rope_qk`` rounds them), writes q and
k back in place (an extend step's fresh-prompt kernel reads the step's own K
rows), and writes the rotated K row and the V row at the token's kernel id
(``_ids.kernel_offset``, as ``store.store_kv`` addresses rows). Dims R..D of k
pass through to the cache unchanged.

It replaces two launches a layer (rope, store) by one on the decode and extend
paths. fp8 caches keep the two-op path: the cache's bytes are a quantisation of
the rotated rows, done on the host side of the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.linear.elementwise import _cos_sin, _rotate_heads
from unikv.kernels.runtime import pdl
from unikv.kernels.runtime.checks import (
    check_cache,
    check_ids,
    check_same_device,
    next_pow2,
    view_strides,
)
from unikv.kernels.runtime.ids import kernel_offset


@triton.jit
def _rope_store_kv_kernel(
    q,
    k,
    v,
    k_cache,
    v_cache,
    ids,
    cos,
    sin,
    pos,
    sq0,
    sq1,
    sk0,
    sk1,
    sv0,
    sv1,
    sc0,
    kc_sb,
    kc_sn,
    kc_sh,
    vc_sb,
    vc_sn,
    vc_sh,
    HQ,
    HALF,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pdl.wait(PDL)  # q, k and v are the projection's output
    pdl.trigger(PDL)  # one short wave: the attention may launch and wait
    c, s = _cos_sin(cos, sin, pos, t, sc0, HALF, BLOCK_R, q.dtype.element_ty)
    _rotate_heads(q + t * sq0, sq1, HQ, c, s, BLOCK_HQ, BLOCK_R, HALF)  # q: in place
    # k: rotated in place and into the cache row of the token's kernel id
    kid = tl.load(ids + t)
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_R)
    mask, a, b = _rotate_heads(k + t * sk0, sk1, H, c, s, BLOCK_H, BLOCK_R, HALF)
    k_row = k_cache + kernel_offset(kid, PS, kc_sb, kc_sn)
    c1 = k_row + heads.to(tl.int64)[:, None] * kc_sh + offs[None, :]
    tl.store(c1, a, mask=mask)
    tl.store(c1 + HALF, b, mask=mask)
    if BLOCK_P > 0:  # partial rotary: dims 2 * HALF .. D pass through
        rest = tl.arange(0, BLOCK_P)
        mask_p = (heads < H)[:, None] & (rest < D - 2 * HALF)[None, :]
        src = k + t * sk0 + heads.to(tl.int64)[:, None] * sk1 + 2 * HALF + rest[None, :]
        vals = tl.load(src, mask=mask_p)
        dst = k_row + heads.to(tl.int64)[:, None] * kc_sh + 2 * HALF + rest[None, :]
        tl.store(dst, vals, mask=mask_p)
    # v: copied into the cache
    offs_v = tl.arange(0, BLOCK_DV)
    mask_v = (heads < H)[:, None] & (offs_v < DV)[None, :]
    vals = tl.load(v + t * sv0 + heads.to(tl.int64)[:, None] * sv1 + offs_v[None, :], mask=mask_v)
    v_row = v_cache + kernel_offset(kid, PS, vc_sb, vc_sn)
    tl.store(v_row + heads.to(tl.int64)[:, None] * vc_sh + offs_v[None, :], vals, mask=mask_v)


def check_store_args(op, k_cache, v_cache, kernel_ids, q, k, v, positions=None) -> None:
    """ValueError unless the arguments fit ``op``, a launch storing the step's K/V rows
    beside its q (``rope_store_kv``, the fused decode ops): shapes, one dtype, unit
    head-dim strides (and ``positions`` (T,) where given)."""
    check_ids("kernel_ids", kernel_ids)
    check_cache("k_cache", k_cache)
    check_cache("v_cache", v_cache, heads=k_cache.shape[-2])
    num_tokens, heads, dim = kernel_ids.shape[0], k_cache.shape[-2], k_cache.shape[-1]
    dim_v = v_cache.shape[-1]
    if (
        q.dim() != 3
        or q.shape[0] != num_tokens
        or q.shape[2] != dim
        or k.shape != (num_tokens, heads, dim)
        or v.shape != (num_tokens, heads, dim_v)
        or (positions is not None and positions.shape != (num_tokens,))
    ):
        pos = "" if positions is None else f" and positions ({num_tokens},)"
        got = "" if positions is None else f", positions {tuple(positions.shape)}"
        raise ValueError(
            f"{op} needs q ({num_tokens}, Hq, {dim}), k ({num_tokens}, {heads}, {dim}), "
            f"v ({num_tokens}, {heads}, {dim_v}){pos} to match kernel_ids and the caches, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}{got}"
        )
    if not (q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"{op} needs q, k, v and the caches in one dtype, got {q.dtype}, {k.dtype}, "
            f"{v.dtype}, {k_cache.dtype}, {v_cache.dtype}; quantise for an fp8 cache and use "
            "store_kv (after rope_qk) then the attention"
        )
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(
            f"{op} needs unit stride on the head dim; got q {q.stride()}, k {k.stride()}, "
            f"v {v.stride()}: pass .contiguous() rows"
        )


def check_rope_store_args(k_cache, v_cache, kernel_ids, q, k, v, cos, positions) -> None:
    """ValueError unless the arguments fit ``rope_store_kv`` (``check_store_args``, and
    the rotated dims within the head)."""
    check_store_args("rope_store_kv", k_cache, v_cache, kernel_ids, q, k, v, positions)
    if 2 * cos.shape[-1] > k_cache.shape[-1]:
        raise ValueError(
            f"rope_store_kv needs 2 * {cos.shape[-1]} rotated dims <= the head dim "
            f"{k_cache.shape[-1]}; fix the rope tables' width"
        )


def rope_store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kernel_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope of q and k at ``positions``, then K and V rows stored at kernel ids, in
    one launch. q and k are rotated in place; returns (q, k), the same tensors.

    k_cache / v_cache: (N, H, D) / (N, H, Dv) dense per-layer views or (E, ps, H, D) /
    (E, ps, H, Dv) page-strided views, in k's dtype (an fp8 cache is quantised by
    the caller: use ``rope_qk`` then ``store_kv`` there); kernel_ids: (T,) int32/int64;
    q: (T, Hq, D), k: (T, H, D), v: (T, H, Dv), one float dtype, unit stride on
    the last dim; cos, sin: (P, R/2) fp32, R <= D even; positions: (T,) int."""
    check_rope_store_args(k_cache, v_cache, kernel_ids, q, k, v, cos, positions)
    check_same_device(k_cache, v_cache, kernel_ids, q, k, v, cos, sin, positions)
    num_tokens, heads, dim = kernel_ids.shape[0], k_cache.shape[-2], k_cache.shape[-1]
    dim_v, half = v_cache.shape[-1], cos.shape[-1]
    if num_tokens == 0:
        return q, k
    page_size = k_cache.shape[1] if k_cache.dim() == 4 else 1  # a dense view: one row per id
    rest = dim - 2 * half
    on = pdl.enabled(q)
    _rope_store_kv_kernel[(num_tokens,)](
        q, k, v, k_cache, v_cache, kernel_ids, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0),
        *view_strides("k_cache", k_cache, page_size),
        *view_strides("v_cache", v_cache, page_size),
        q.shape[1], half,
        H=heads, D=dim, DV=dim_v, PS=page_size,
        BLOCK_HQ=next_pow2(q.shape[1]), BLOCK_H=next_pow2(heads), BLOCK_R=next_pow2(half),
        BLOCK_P=next_pow2(rest) if rest else 0, BLOCK_DV=next_pow2(dim_v),
        PDL=on, num_warps=4, enable_fp_fusion=False, **pdl.launch_options(on),
    )  # fmt: skip
    return q, k
