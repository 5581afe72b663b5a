"""Triton KV store: K and V rows of T new tokens written at kernel ids, one launch.

One program writes BLOCK_T tokens; a token's row is addressed with
``_ids.kernel_offset`` (dense view: ``kernel_id * row_stride``; page-strided
view: ``(kid // ps) * page_stride + (kid % ps) * row_stride``), plus
``h * head_stride + d``, every offset in int64, so the views of ``unikv.layout``
are written in place.
fp8 rows are bit-copied as bytes (the cache is uint8, K/V are viewed as uint8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.checks import (
    as_storage,
    check_cache,
    check_ids,
    check_same_device,
    next_pow2,
    view_strides,
)
from unikv.kernels.runtime.ids import kernel_offset

TILE_ELEMS = 16384  # elements of K (and of V) one program moves; tuned on the H200
NUM_WARPS = 4


@triton.jit
def _copy_rows(
    src,
    dst,
    ids,
    t0,
    T,
    s_st,
    s_sh,
    d_sb,
    d_sn,
    d_sh,
    H: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_C)
    h = offs_c // BLOCK_D
    d = offs_c % BLOCK_D
    mask_t = offs_t < T
    mask = mask_t[:, None] & ((h < H) & (d < D))[None, :]
    kids = tl.load(ids + offs_t, mask=mask_t, other=0)
    rows = kernel_offset(kids, PS, d_sb, d_sn)
    col_src = h.to(tl.int64) * s_sh + d
    col_dst = h.to(tl.int64) * d_sh + d
    vals = tl.load(src + offs_t.to(tl.int64)[:, None] * s_st + col_src[None, :], mask=mask)
    tl.store(dst + rows[:, None] + col_dst[None, :], vals, mask=mask)


@triton.jit
def _store_kv_kernel(
    k_cache,
    v_cache,
    ids,
    k,
    v,
    T,
    kc_sb,
    kc_sn,
    kc_sh,
    vc_sb,
    vc_sn,
    vc_sh,
    k_st,
    k_sh,
    v_st,
    v_sh,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_CK: tl.constexpr,
    BLOCK_CV: tl.constexpr,
):
    t0 = tl.program_id(0) * BLOCK_T
    _copy_rows(
        k, k_cache, ids, t0, T, k_st, k_sh, kc_sb, kc_sn, kc_sh,
        H, D, PS, BLOCK_T, BLOCK_D, BLOCK_CK,
    )  # fmt: skip
    _copy_rows(
        v, v_cache, ids, t0, T, v_st, v_sh, vc_sb, vc_sn, vc_sh,
        H, DV, PS, BLOCK_T, BLOCK_DV, BLOCK_CV,
    )  # fmt: skip


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kernel_ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write K and V rows of T tokens at kernel ids, in one launch (a bit copy).

    k_cache: (N, H, D) dense per-layer K view in storage dtype (uint8 for fp8),
    strided rows allowed, or an (E, ps, H, D) page-strided view (asymmetric K/V);
    v_cache: (N, H, Dv) or (E, ps, H, Dv), the same kind. kernel_ids: (T,) int32/int64
    kernel ids (sink ids are harmless). k: (T, H, D), v: (T, H, Dv) in the
    logical dtype; unit stride on the last dim.
    """
    check_ids("kernel_ids", kernel_ids)
    check_cache("k_cache", k_cache)
    check_cache("v_cache", v_cache, heads=k_cache.shape[-2])
    if k_cache.shape[:-2] != v_cache.shape[:-2]:
        raise ValueError(
            f"k_cache and v_cache must index the same kernel ids, got shapes "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens = kernel_ids.shape[0]
    heads, dim = k_cache.shape[-2], k_cache.shape[-1]
    dim_v = v_cache.shape[-1]
    page_size = k_cache.shape[1] if k_cache.dim() == 4 else 1  # a dense view: one row per id
    if k.shape != (num_tokens, heads, dim) or v.shape != (num_tokens, heads, dim_v):
        raise ValueError(
            f"k/v must be ({num_tokens}, {heads}, {dim}) / ({num_tokens}, {heads}, {dim_v}) to "
            f"match kernel_ids and the caches, got {tuple(k.shape)} / {tuple(v.shape)}"
        )
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"k/v need unit stride on head_dim, got {k.stride()} / {v.stride()}")
    check_same_device(k_cache, v_cache, kernel_ids, k, v)
    k, v = as_storage("k", k, k_cache), as_storage("v", v, v_cache)
    if num_tokens == 0:
        return
    block_d, block_dv = next_pow2(dim), next_pow2(dim_v)
    cols = next_pow2(heads) * max(block_d, block_dv)
    block_t = max(1, min(next_pow2(num_tokens), TILE_ELEMS // cols))
    grid = (triton.cdiv(num_tokens, block_t),)
    _store_kv_kernel[grid](
        k_cache,
        v_cache,
        kernel_ids,
        k,
        v,
        num_tokens,
        *view_strides("k_cache", k_cache, page_size),
        *view_strides("v_cache", v_cache, page_size),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        H=heads,
        D=dim,
        DV=dim_v,
        PS=page_size,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        BLOCK_CK=next_pow2(heads) * block_d,
        BLOCK_CV=next_pow2(heads) * block_dv,
        num_warps=min(NUM_WARPS, max(1, block_t * cols // 256)),
    )
