"""Pieces shared by the decode and extend attention kernels.

``load_rows`` gathers a tile of K/V rows through the block table
(``_ids.row_offset``; dense views have ``block_stride == ps * row_stride``):

    entry(i) = block_table[b, i // ps]
    K row(i) = entry(i) * k_block_stride + (i % ps) * k_row_stride    (int64 elements)
    K tile   = k_cache[K row, kv_head, :D]                            (BLOCK_N, BLOCK_D)

``attn_tile`` is one online-softmax step in base 2 (logits pre-scaled by log2 e),
with optional soft-capping ``cap * tanh(x / cap)`` of the natural-unit logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.checks import check_cache, check_same_device
from unikv.kernels.runtime.ids import row_offset


@triton.jit
def load_rows(
    k_cache,
    v_cache,
    bt_row,
    offs_n,
    mask_n,
    kvh,
    k_sb,
    k_sn,
    k_sh,
    v_sb,
    v_sn,
    v_sh,
    offs_d,
    offs_dv,
    D: tl.constexpr,
    DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    if MASKED:
        entry = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
    else:  # every key of the tile is live
        entry = tl.load(bt_row + offs_n // PAGE_SIZE)
    k_rows = row_offset(entry, offs_n, PAGE_SIZE, k_sb, k_sn)
    v_rows = row_offset(entry, offs_n, PAGE_SIZE, v_sb, v_sn)
    k_ptr = k_cache + k_rows[:, None] + kvh * k_sh + offs_d[None, :]
    v_ptr = v_cache + v_rows[:, None] + kvh * v_sh + offs_dv[None, :]
    if MASKED or D != BLOCK_D:
        kt = tl.load(k_ptr, mask=mask_n[:, None] & (offs_d[None, :] < D), other=0.0)
    else:
        kt = tl.load(k_ptr)
    if MASKED or DV != BLOCK_DV:
        vt = tl.load(v_ptr, mask=mask_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
    else:
        vt = tl.load(v_ptr)
    return kt, vt


@triton.jit
def attn_tile(
    qv,
    kt,
    vt,
    mask,
    m_i,
    l_i,
    acc,
    qk_scale,
    soft_cap,
    HAS_CAP: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    s = tl.dot(qv, tl.trans(kt.to(qv.dtype)), input_precision=PRECISION)  # (M, BLOCK_N) fp32
    if HAS_CAP:
        x = s * (qk_scale / 1.4426950408889634) / soft_cap
        e = tl.exp2(x * (2.0 * 1.4426950408889634))
        s = (soft_cap * 1.4426950408889634) * (1.0 - 2.0 / (e + 1.0))  # cap * tanh(x), base 2
        scale = 1.0
    else:
        scale = qk_scale  # folded into the exponent's FMA below
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale)  # scale > 0
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    else:
        m_safe = m_new  # every row saw a live key: finite
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(qv.dtype), vt.to(qv.dtype), acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def finish_rows(acc, m_i, l_i, sinks, h, HAS_SINKS: tl.constexpr):
    """Normalised output rows (M, Dv) fp32 of one head ``h``: the online softmax's
    ``acc / l``, with the head's sink logit (natural units) in the denominator."""
    if HAS_SINKS:
        sink = tl.load(sinks + h).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        scale = tl.exp2(m_i - m_f)
        l_i = l_i * scale + tl.exp2(sink - m_f)
        acc = acc * scale[:, None]
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


def dot_precision(q: torch.Tensor) -> str:
    """fp32 queries get exact fp32 dots (no TF32); 16-bit dtypes ignore this."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None,
    page_size: int,
) -> None:
    """Shapes, dtypes and strides of the attention launchers' arguments (host only)."""
    check_cache("k_cache", k_cache)
    check_cache("v_cache", v_cache, heads=k_cache.shape[-2])
    if k_cache.dim() != v_cache.dim():
        raise ValueError(
            f"k_cache and v_cache must be views of one kind, got {k_cache.dim()}-D and "
            f"{v_cache.dim()}-D"
        )
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be 3-D with unit last stride, got {tuple(q.shape)} {q.stride()}")
    if q.shape[2] != k_cache.shape[-1]:
        raise ValueError(f"q head_dim {q.shape[2]} != k_cache head_dim {k_cache.shape[-1]}")
    if q.shape[1] % k_cache.shape[-2] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_cache.shape[-2]})"
        )
    if k_cache.dtype == torch.uint8 or not (k_cache.is_floating_point()):
        raise ValueError(
            f"caches must be viewed with a float dtype, got {k_cache.dtype}; view fp8 bytes "
            "with their fp8 dtype (cache.view(torch.float8_e4m3fn))"
        )
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(
            f"block_table must be 2-D int32 with unit column stride, got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (block_table.shape[0],):
        raise ValueError(
            f"seq_lens must be ({block_table.shape[0]},) int32, got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.dtype != torch.float32):
        raise ValueError(
            f"sinks must be ({q.shape[1]},) fp32, got {sinks.dtype} {tuple(sinks.shape)}"
        )
    if not isinstance(page_size, int) or not 1 <= page_size:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    check_same_device(q, k_cache, v_cache, block_table, seq_lens, sinks)


__all__ = [
    "attn_tile",
    "check_attention_args",
    "dot_precision",
    "finish_rows",
    "load_rows",
    "triton",
]
