"""Triton paged extend (prefill with a cached prefix) attention.

Grid ``(Hq, ceil(max_q_len / BLOCK_M), B)``: program (head, q block, request)
takes BLOCK_M new tokens of one request and one query head; heads of one KV
group are neighbours in launch order, so their K/V tiles are shared in L2.
Request b's new token j sits at position ``prefix_b + j`` with
``prefix_b = seq_lens[b] - q_len_b``; keys are read through the block table:

    keys [lo, diag)          every row sees them: no causal mask
    keys [diag, last_q]      the diagonal tiles: mask key <= pos
    (window W: lo = first_q - W + 1 and a mask key > pos - W)

Q blocks are launched last-first, so the longest programs start first.
A batch with no cached prefix may instead pass its new K/V (``fresh_kv``, a
plan-time choice): ``extend_fresh`` then reads them contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.attention.fresh import extend_attention_fresh
from unikv.kernels.attention.tiles import (
    attn_tile,
    check_attention_args,
    dot_precision,
    finish_rows,
    load_rows,
)
from unikv.kernels.runtime.checks import next_pow2, out_buffer, view_strides

# (block_m, block_n, num_warps, num_stages) per head_dim; tuned on the H200
# (benchmarks/bench_extend_long.py sweeps CANDIDATES and prints the pick; head_dim 64
# over 16 x 512 fresh, 1 x 8k fresh and 8 x (512 + 512): 1.22x SDPA geomean, 1.10x the
# 128-row tile before; inside Llama-3.2-1B's mixed prefill steps, decode rows with
# continued chunks: 1.85x; the runs: docs/perf.md)
CONFIGS = {64: (64, 64, 4, 3), 128: (128, 128, 8, 3), 256: (64, 32, 4, 2)}
CANDIDATES = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3)]


@triton.jit
def _kv_loop(
    qv,
    m_i,
    l_i,
    acc,
    k_cache,
    v_cache,
    bt_row,
    kvh,
    lo,
    hi,
    pos_m,
    window,
    qk_scale,
    soft_cap,
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
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        kt, vt = load_rows(
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
            D,
            DV,
            PAGE_SIZE,
            MASKED,
            BLOCK_D,
            BLOCK_DV,
        )
        mask = mask_n[None, :]
        if CAUSAL:
            mask = mask & (offs_n[None, :] <= pos_m[:, None])
        if HAS_WINDOW:
            mask = mask & (offs_n[None, :] > pos_m[:, None] - window)
        m_i, l_i, acc = attn_tile(
            qv, kt, vt, mask, m_i, l_i, acc, qk_scale, soft_cap, HAS_CAP, PRECISION, MASKED
        )
    return m_i, l_i, acc


@triton.jit
def _extend_kernel(
    q,
    k_cache,
    v_cache,
    block_table,
    q_indptr,
    seq_lens,
    sinks,
    out,
    sm_scale,
    soft_cap,
    window,
    q_st,
    q_sh,
    k_sb,
    k_sn,
    k_sh,
    v_sb,
    v_sn,
    v_sh,
    bt_sb,
    o_st,
    o_sh,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_CAP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(q_indptr + b)
    q_len = tl.load(q_indptr + b + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    seq = tl.load(seq_lens + b)
    prefix = seq - q_len
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < q_len
    pos_m = prefix + offs_m
    tok = (q_start + offs_m).to(tl.int64)
    qv = tl.load(
        q + tok[:, None] * q_st + h * q_sh + offs_d[None, :],
        mask=mask_m[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    kvh = h // GROUP
    first_q = prefix + mb * BLOCK_M
    end = tl.minimum(first_q + BLOCK_M, seq)  # one past the block's last key
    diag = first_q // BLOCK_N * BLOCK_N
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    bt_row = block_table + b.to(tl.int64) * bt_sb
    m_i, l_i, acc = _kv_loop(
        qv, m_i, l_i, acc, k_cache, v_cache, bt_row, kvh, lo, diag, pos_m, window,
        qk_scale, soft_cap, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, offs_d, offs_dv,
        D, DV, PAGE_SIZE, BLOCK_N, False, HAS_WINDOW, HAS_CAP, NUM_STAGES, PRECISION,
        HAS_WINDOW, BLOCK_D, BLOCK_DV,  # no masks off-diagonal
    )  # fmt: skip
    m_i, l_i, acc = _kv_loop(
        qv, m_i, l_i, acc, k_cache, v_cache, bt_row, kvh, diag, end, pos_m, window,
        qk_scale, soft_cap, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, offs_d, offs_dv,
        D, DV, PAGE_SIZE, BLOCK_N, True, HAS_WINDOW, HAS_CAP, 1, PRECISION,
        True, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    res = finish_rows(acc, m_i, l_i, sinks, h, HAS_SINKS)
    tl.store(
        out + tok[:, None] * o_st + h * o_sh + offs_dv[None, :],
        res.to(out.dtype.element_ty),
        mask=mask_m[:, None] & (offs_dv[None, :] < DV),
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_q_len: int,
    page_size: int,
    sm_scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    soft_cap: float = 0.0,
    out: torch.Tensor | None = None,
    config: tuple | None = None,
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    hopper: bool = False,
) -> torch.Tensor:
    """Causal attention of ragged new tokens over their cached prefix and themselves.

    q: (T, Hq, D) new tokens, request b owning rows ``q_indptr[b]:q_indptr[b+1]``;
    q_indptr: (B+1,) int32; seq_lens: (B,) int32 totals incl. the new tokens
    (whose K/V are already stored). k_cache/v_cache/block_table/window/sinks/
    soft_cap as in ``decode_attention``. max_q_len: host int >= every q length
    (sizes the grid; no host sync). fresh_kv: the new tokens' own (k, v), (T, H, D)
    and (T, H, Dv) in q's dtype, passed only when the step planner knows that no
    request has a cached prefix (``seq_lens == q_lens``; not checked on device):
    K/V are then read from them (``extend_fresh``), not through the block table.
    config: ``CONFIGS``-style tiles of the path taken (``extend_fresh.CONFIGS``
    when fresh). hopper: fresh prompts may take the Gluon kernel (``extend_fresh``;
    decided per step by the step's ``ExtendPlan``, from the backend's variants and the
    prompt length). Returns out (T, Hq, Dv) in q's dtype.
    """
    check_attention_args(q, k_cache, v_cache, block_table, seq_lens, sinks, page_size)
    if fresh_kv is not None:
        k_new, v_new = fresh_kv
        return extend_attention_fresh(
            q, k_new, v_new, q_indptr, max_q_len=max_q_len, sm_scale=sm_scale, window=window,
            sinks=sinks, soft_cap=soft_cap, out=out, config=config, hopper=hopper,
        )  # fmt: skip
    if q_indptr.dtype != torch.int32 or q_indptr.shape != (block_table.shape[0] + 1,):
        raise ValueError(
            f"q_indptr must be ({block_table.shape[0] + 1},) int32, got {q_indptr.dtype} {tuple(q_indptr.shape)}"
        )
    num_tokens, hq, dim = q.shape
    heads, dim_v = k_cache.shape[-2], v_cache.shape[-1]
    out = out_buffer(out, (num_tokens, hq, dim_v), q)
    bsz = block_table.shape[0]
    if num_tokens == 0 or bsz == 0 or max_q_len <= 0:
        return out
    block_m, block_n, warps, stages = config or CONFIGS.get(next_pow2(dim), (64, 32, 4, 2))
    grid = (hq, triton.cdiv(max_q_len, block_m), bsz)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_table,
        q_indptr,
        seq_lens,
        sinks if sinks is not None else q,
        out,
        sm_scale,
        float(soft_cap),
        int(window),
        q.stride(0),
        q.stride(1),
        *view_strides("k_cache", k_cache, page_size),
        *view_strides("v_cache", v_cache, page_size),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=hq // heads,
        D=dim,
        DV=dim_v,
        BLOCK_D=next_pow2(dim),
        BLOCK_DV=next_pow2(dim_v),
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=window > 0,
        HAS_SINKS=sinks is not None,
        HAS_CAP=soft_cap > 0,
        NUM_STAGES=stages,
        PRECISION=dot_precision(q),
        num_warps=warps,
    )
    return out
