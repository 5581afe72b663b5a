"""Triton paged decode attention: split-KV over the dense per-layer views.

Grid ``(H_kv, B, S)``: program (kv head, b, split) serves the GROUP query heads
of one KV head (padded to 16 rows for the tensor-core dot), so each K/V row is
read once per step; heads first, so the programs of one request's KV heads run side
by side over the same rows of its pages (1.04x the (B, H_kv, S) order at the e2e's
decode batch: 102.2 against 106.3 us, ``decode_ops_grid_h200_f6ab973.json``). A
request's visible keys ``[lo, seq_len)`` (lo = seq_len - W with a window, so only the
window's pages are read) are cut into S equal, BLOCK_N-aligned chunks; S is fixed on
the host from the SM count and the block table's capacity, so the grid never depends
on device data (CUDA-graph safe).

    split s -> (acc_s / l_s, lse_s)  in a caller-ownable fp32 workspace
    merge    -> out = sum_s exp(lse_s - M) acc_s / (sum_s exp(lse_s - M) + exp(sink - M))

With S == 1 the split kernel normalises and writes ``out`` itself. Token i of
request b is the row at (entry ``block_table[b, i // ps]``, slot ``i % ps``) of the
view (``_ids.row_offset``; a dense view is entry * ps + slot); every row offset is
int64 and every stride is passed in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.env import FLAGS
from unikv.kernels.attention.rope_store import check_rope_store_args, check_store_args
from unikv.kernels.attention.tiles import attn_tile, check_attention_args, dot_precision, load_rows
from unikv.kernels.linear.elementwise import _rotated
from unikv.kernels.runtime import pdl
from unikv.kernels.runtime.checks import (  # noqa: F401  (workspace_numel: public, sizes buffers)
    check_same_device,
    device_sms,
    next_pow2,
    out_buffer,
    split_workspace,
    view_strides,
    workspace_numel,
)
from unikv.kernels.runtime.ids import kernel_offset

MIN_SPLIT_TOKENS = 64  # never cut a request into chunks shorter than this (one 64-row tile)
CTAS_PER_SM = 4  # split until about this many programs per SM ...
NO_SPLIT_PROGRAMS_PER_SM = 2  # ... unless (B * H_kv) already gives this many per SM
# (block_n, num_warps, num_stages) per head_dim, or per (head_dim, page_size) where that
# differs; loops of LONG_LOOP_TILES or more tiles use LONG_LOOP_STAGES. Tuned on the
# H200 (benchmarks/sweep_kernels.py; docs/perf.md).
CONFIGS = {64: (64, 4, 2), 128: (64, 4, 2), 256: (32, 4, 2)}
# without splits (a large batch): the e2e's decode batch at head dim 64 (B 256, 512-767
# keys, page 16; bench_decode_ops.py, docs/perf.md) ran 128-key tiles 1.03x faster than 64
NO_SPLIT_CONFIGS = {64: (128, 4, 2)}
LONG_LOOP_TILES = 32
LONG_LOOP_STAGES = 3
# decode steps of at most PRELOAD_ROWS requests (one request's GEMV chain, whose kernels
# keep pdl.py's contract) load seq_lens, the block table and each split's first tile of
# K/V rows older than the step's before the PDL wait: every kernel but the one just
# before has completed by then (UNIKV_DECODE_PRELOAD=0 turns it off; fixed at import,
# the A/B switch).
PRELOAD = FLAGS.decode_preload
PRELOAD_ROWS = 4
# fp32 elements of the (splits, Dv) tile the merge reads per pass (``merge_launch``;
# UNIKV_DECODE_MERGE_TILE, fixed at import, is the A/B switch: 1024 was 16 splits a pass)
MERGE_TILE = FLAGS.decode_merge_tile


def choose_num_splits(batch: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits per request: enough programs to fill the GPU, chunks >= MIN_SPLIT_TOKENS.
    Depends only on host ints (shape of the block table), never on seq_lens."""
    programs = batch * kv_heads
    sms = device_sms(device)
    if programs >= NO_SPLIT_PROGRAMS_PER_SM * sms:
        return 1
    want = triton.cdiv(sms * CTAS_PER_SM, programs)
    cap = max(1, triton.cdiv(max_len, MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, 256))


def choose_config(dim: int, page_size: int, max_len: int, splits: int) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) for a head_dim, page size and loop length."""
    block_d = next_pow2(dim)
    block_n, warps, stages = CONFIGS.get((block_d, page_size)) or CONFIGS.get(block_d, (32, 4, 2))
    if block_d <= 128 and triton.cdiv(max_len, splits * block_n) >= LONG_LOOP_TILES:
        return block_n, warps, max(stages, LONG_LOOP_STAGES)
    if splits == 1 and block_d in NO_SPLIT_CONFIGS:  # short loops of a large batch
        return NO_SPLIT_CONFIGS[block_d]
    return block_n, warps, stages


@triton.jit
def _rope_lanes(cos, sin, pos, b, sc0, HALF, offs_d, dt: tl.constexpr):
    """Per head-dim lane of request b's new token: its rotate-half partner lane and the
    (cos, sin) it is rotated by, rounded to the model dtype ``dt`` as ``rope_store``
    rounds them; lanes past 2 * HALF (partial rotary) are their own partner with
    (1, 0), so they pass through."""
    first = offs_d < HALF
    rot = offs_d < 2 * HALF
    partner = tl.where(rot, tl.where(first, offs_d + HALF, offs_d - HALF), offs_d)
    lane = tl.where(first, offs_d, offs_d - HALF)
    p = tl.load(pos + b).to(tl.int64)
    c = tl.load(cos + p * sc0 + lane, mask=rot, other=1.0).to(dt).to(tl.float32)
    sn = tl.load(sin + p * sc0 + lane, mask=rot, other=0.0).to(dt).to(tl.float32)
    return partner, c, tl.where(first, -sn, sn)


@triton.jit
def _store_new_row(k_new, v_new, k_cache, v_cache, write_ids, b, kvh, kn_sb, kn_sh, vn_sb,
                   vn_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, partner, c, sn, offs_d,
                   offs_dv, D: tl.constexpr, DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   owner, ROPE: tl.constexpr):  # fmt: skip
    """Request b's new K row of head kvh (rotated with ``ROPE``, else as given), and
    its V row, in the cache's dtype, written into the cache at the token's kernel id
    (``rope_store``'s / ``store``'s row) where ``owner`` (the split whose keys hold
    it). Returns the two rows."""
    kid = tl.load(write_ids + b)
    k_src = k_new + b.to(tl.int64) * kn_sb + kvh * kn_sh
    mask_d = offs_d < D
    kr = tl.load(k_src + offs_d, mask=mask_d, other=0.0)
    if ROPE:
        kr = _rotated(kr, tl.load(k_src + partner, mask=mask_d, other=0.0), c, sn)
    kr = kr.to(k_cache.dtype.element_ty)
    tl.store(k_cache + kernel_offset(kid, PAGE_SIZE, k_sb, k_sn) + kvh * k_sh + offs_d, kr,
             mask=mask_d & owner)  # fmt: skip
    mask_v = offs_dv < DV
    vx = tl.load(v_new + b.to(tl.int64) * vn_sb + kvh * vn_sh + offs_dv, mask=mask_v, other=0.0)
    vx = vx.to(v_cache.dtype.element_ty)
    tl.store(v_cache + kernel_offset(kid, PAGE_SIZE, v_sb, v_sn) + kvh * v_sh + offs_dv, vx,
             mask=mask_v & owner)  # fmt: skip
    return kr, vx


@triton.jit
def _split_range(seq_lens, b, split, window, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_WINDOW: tl.constexpr):  # fmt: skip
    """(seq, first visible key, chunk, lo, hi) of request b's split ``split``."""
    seq = tl.load(seq_lens + b)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    return seq, first, chunk, lo, tl.minimum(lo + chunk, seq)


@triton.jit
def _decode_split_kernel(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    sinks,
    out,
    ws_acc,
    ws_lse,
    sm_scale,
    soft_cap,
    window,
    q_sb,
    q_sh,
    k_sb,
    k_sn,
    k_sh,
    v_sb,
    v_sn,
    v_sh,
    bt_sb,
    o_sb,
    o_sh,
    k_new,
    v_new,
    write_ids,
    cos,
    sin,
    pos,
    kn_sb,
    kn_sh,
    vn_sb,
    vn_sh,
    sc0,
    HALF,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_CAP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    PDL: tl.constexpr,
    PRELOAD: tl.constexpr = False,
    STORE: tl.constexpr = False,
):
    kvh = tl.program_id(0)  # heads first: a request's KV heads run side by side
    b = tl.program_id(1)
    split = tl.program_id(2)
    if PRELOAD:  # the kernel before is still running: every load but q's and the new row's
        seq, first, chunk, lo, hi = _split_range(seq_lens, b, split, window, NUM_SPLITS,
                                                 BLOCK_N, HAS_WINDOW)  # fmt: skip
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    bt_row = block_table + b.to(tl.int64) * bt_sb
    if PRELOAD:  # the first tile's rows older than the step's: written steps ago
        offs_n0 = lo + tl.arange(0, BLOCK_N)
        kt0, vt0 = load_rows(k_cache, v_cache, bt_row, offs_n0,
                             offs_n0 < tl.minimum(hi, seq - 1), kvh, k_sb, k_sn, k_sh, v_sb,
                             v_sn, v_sh, offs_d, offs_dv, D, DV, PAGE_SIZE, True, BLOCK_D,
                             BLOCK_DV)  # fmt: skip
        if ROPE:
            partner, c, sn = _rope_lanes(cos, sin, pos, b, sc0, HALF, offs_d,
                                         q.dtype.element_ty)  # fmt: skip
    pdl.wait(PDL)  # q and the step's K/V rows come from the kernels before
    if not PRELOAD:
        seq, first, chunk, lo, hi = _split_range(seq_lens, b, split, window, NUM_SPLITS,
                                                 BLOCK_N, HAS_WINDOW)  # fmt: skip
    heads = kvh * GROUP + offs_g
    mask_g = offs_g < GROUP
    q_rows = q + b.to(tl.int64) * q_sb + heads[:, None] * q_sh
    mask_q = mask_g[:, None] & (offs_d[None, :] < D)
    qv = tl.load(q_rows + offs_d[None, :], mask=mask_q, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    owner = (seq > 0) & (split == (seq - 1 - first) // tl.maximum(chunk, 1))  # holds the new row
    # ROPE: rope + store fused, q rotated here and the new K/V row stored by its split;
    # STORE: the same store of the row as given (no rope: q and k come as they attend)
    if ROPE or STORE:
        if ROPE:
            if not PRELOAD:
                partner, c, sn = _rope_lanes(cos, sin, pos, b, sc0, HALF, offs_d,
                                             q.dtype.element_ty)  # fmt: skip
            qv = _rotated(qv, tl.load(q_rows + partner[None, :], mask=mask_q, other=0.0), c, sn)
        else:
            partner, c, sn = offs_d, 1.0, 0.0  # unread: no rotation
        kr, vr = _store_new_row(k_new, v_new, k_cache, v_cache, write_ids, b, kvh, kn_sb, kn_sh,
                                vn_sb, vn_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, partner, c, sn,
                                offs_d, offs_dv, D, DV, PAGE_SIZE, owner, ROPE)  # fmt: skip
        tl.debug_barrier()  # the row's stores are visible to this program's loads
    if PRELOAD:  # the new row joins the preloaded tile from registers (or one reload)
        new_row = (offs_n0 == seq - 1)[:, None]
        if ROPE or STORE:
            kt0 = tl.where(new_row, kr[None, :], kt0)
            vt0 = tl.where(new_row, vr[None, :], vt0)
        else:
            ktn, vtn = load_rows(k_cache, v_cache, bt_row, offs_n0, (offs_n0 == seq - 1) & owner,
                                 kvh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, offs_d, offs_dv, D,
                                 DV, PAGE_SIZE, True, BLOCK_D, BLOCK_DV)  # fmt: skip
            kt0 = tl.where(new_row, ktn, kt0)
            vt0 = tl.where(new_row, vtn, vt0)
        m_i, l_i, acc = attn_tile(qv, kt0, vt0, (offs_n0 < hi)[None, :], m_i, l_i, acc,
                                  qk_scale, soft_cap, HAS_CAP, PRECISION, True)  # fmt: skip
        lo = lo + BLOCK_N
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
            True,
            BLOCK_D,
            BLOCK_DV,
        )
        m_i, l_i, acc = attn_tile(
            qv,
            kt,
            vt,
            mask_n[None, :],
            m_i,
            l_i,
            acc,
            qk_scale,
            soft_cap,
            HAS_CAP,
            PRECISION,
            True,
        )
    pdl.trigger(PDL)  # the keys are read: the merge (or the next kernel) may launch
    head_mask = mask_g
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = (
                tl.load(sinks + heads, mask=mask_g, other=0.0).to(tl.float32) * 1.4426950408889634
            )
            m_safe = tl.where(m_i == float("-inf"), sink, tl.maximum(m_i, sink))
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.exp2(sink - m_safe)
            acc = acc * tl.exp2(m_i - m_safe)[:, None]
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptr = out + b.to(tl.int64) * o_sb + heads[:, None] * o_sh + offs_dv[None, :]
        tl.store(
            o_ptr, res.to(out.dtype.element_ty), mask=head_mask[:, None] & (offs_dv[None, :] < DV)
        )
    else:
        row = (b * (GROUP * tl.num_programs(0)) + heads).to(tl.int64) * NUM_SPLITS + split
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(
            ws_acc + row[:, None] * DV + offs_dv[None, :],
            res,
            mask=head_mask[:, None] & (offs_dv[None, :] < DV),
        )
        tl.store(ws_lse + row, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    ws_acc,
    ws_lse,
    sinks,
    out,
    o_sb,
    o_sh,
    HQ,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pdl.wait(PDL)
    row = (b * HQ + h).to(tl.int64) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(ws_lse + row + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    if CHUNK_S == BLOCK_S:  # one pass: every split's row loaded beside the lse
        part = tl.load(
            ws_acc + (row + offs_s)[:, None] * DV + offs_dv[None, :],
            mask=(offs_s < NUM_SPLITS)[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
    peak = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks + h).to(tl.float32) * 1.4426950408889634
        peak = tl.maximum(peak, sink)
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    denom = tl.sum(tl.exp2(lse - peak), axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - peak)
    if CHUNK_S == BLOCK_S:
        acc = tl.sum(part * tl.exp2(lse - peak)[:, None], axis=0)
    else:
        acc = tl.zeros([BLOCK_DV], tl.float32)
        for s0 in range(0, NUM_SPLITS, CHUNK_S):  # a few splits at a time: small register tiles
            offs_c = s0 + tl.arange(0, CHUNK_S)
            mask_c = offs_c < NUM_SPLITS
            w = tl.exp2(tl.load(ws_lse + row + offs_c, mask=mask_c, other=float("-inf")) - peak)
            part = tl.load(
                ws_acc + (row + offs_c)[:, None] * DV + offs_dv[None, :],
                mask=mask_c[:, None] & (offs_dv[None, :] < DV),
                other=0.0,
            )
            acc += tl.sum(part * w[:, None], axis=0)
    pdl.trigger(PDL)
    res = acc / tl.where(denom > 0, denom, 1.0)
    o_ptr = out + b.to(tl.int64) * o_sb + h * o_sh + offs_dv
    tl.store(o_ptr, res.to(out.dtype.element_ty), mask=offs_dv < DV)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    sm_scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    soft_cap: float = 0.0,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: tuple[int, int, int] | None = None,
    new_row: tuple | None = None,
    rope: tuple | None = None,
    preload: bool | None = None,
) -> torch.Tensor:
    """Paged decode attention, one query token per request.

    q: (B, Hq, D) (unit stride on D); k_cache (N, H, D) / v_cache (N, H, Dv): dense
    per-layer views, or (E, ps, H, D) / (E, ps, H, Dv) page-strided views (asymmetric
    K/V), a float dtype (view fp8 bytes with their fp8 dtype), strided rows allowed;
    Hq a multiple of H. block_table: (B, max_pages) int32 kernel page
    entries; seq_lens: (B,) int32 tokens in the cache (the query is the last).
    window: 0 = full, W > 0 = only the last W keys (only their pages are read).
    sinks: None or (Hq,) fp32 sink logits. soft_cap: 0 = off. out: optional
    (B, Hq, Dv). workspace: optional fp32 tensor of >= ``workspace_numel(...)``
    elements (fixed buffers for CUDA graphs). num_splits / config override the
    heuristics (benchmarks). new_row: the step's (k, v, write_ids), stored inside the
    launch (``store_decode_attention``, checked there); rope: with it, (cos, sin,
    positions) rotating q and k first (``rope_store_decode_attention``). preload (None: ``PRELOAD`` under PDL at most
    ``PRELOAD_ROWS`` requests): load seq_lens, the block table and each split's first
    tile of rows but the new one before the PDL wait (the same bytes). Returns out
    (B, Hq, Dv) in q's dtype.
    """
    check_attention_args(q, k_cache, v_cache, block_table, seq_lens, sinks, page_size)
    bsz, hq, dim = q.shape
    heads, dim_v = k_cache.shape[-2], v_cache.shape[-1]
    group = hq // heads
    out = out_buffer(out, (bsz, hq, dim_v), q)
    if bsz == 0:
        return out
    max_len = block_table.shape[1] * page_size
    if window > 0:
        max_len = min(max_len, window)
    splits = num_splits or choose_num_splits(bsz, heads, max_len, q.device)
    ws_acc, ws_lse = split_workspace(workspace, bsz, hq, dim_v, splits, q.device)
    block_n, warps, stages = config or choose_config(dim, page_size, max_len, splits)
    sinks_arg = sinks if sinks is not None else ws_acc  # never read without sinks
    on = pdl.enabled(q)
    preload = (PRELOAD and on and bsz <= PRELOAD_ROWS) if preload is None else preload
    assert rope is None or new_row is not None, "rope rotates the stored new row: pass new_row"
    k_new, v_new, ids = new_row or (q, q, seq_lens)  # never read without new_row
    cos, sin, positions = rope or (ws_acc, ws_acc, seq_lens)
    half = cos.shape[-1] if rope is not None else 0
    _decode_split_kernel[(heads, bsz, splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        sinks_arg,
        out,
        ws_acc,
        ws_lse,
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
        k_new,
        v_new,
        ids,
        cos,
        sin,
        positions,
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        cos.stride(0),
        half,
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        D=dim,
        DV=dim_v,
        BLOCK_D=next_pow2(dim),
        BLOCK_DV=next_pow2(dim_v),
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        HAS_WINDOW=window > 0,
        HAS_SINKS=sinks is not None,
        HAS_CAP=soft_cap > 0,
        NUM_STAGES=stages,
        PRECISION=dot_precision(q),
        ROPE=rope is not None,
        PDL=on,
        PRELOAD=bool(preload),
        STORE=new_row is not None and rope is None,
        num_warps=warps,
        # rope: products must not fuse into the sum (rope_store's rounding; with fusion
        # on, the H200 fused bf16's narrowed multiply-add: a GPU test, docs/perf.md)
        enable_fp_fusion=rope is None,
        **pdl.launch_options(on),
    )
    if splits > 1:
        _decode_merge_kernel[(bsz, hq)](
            ws_acc,
            ws_lse,
            sinks_arg,
            out,
            out.stride(0),
            out.stride(1),
            hq,
            DV=dim_v,
            BLOCK_DV=next_pow2(dim_v),
            NUM_SPLITS=splits,
            HAS_SINKS=sinks is not None,
            PDL=on,
            **merge_launch(splits, dim_v),
            **pdl.launch_options(on),
        )
    return out


def merge_launch(splits: int, dim_v: int) -> dict:
    """The merge kernel's split tiling for S splits of Dv columns: every split in one
    pass while S x Dv fits ``MERGE_TILE`` fp32 elements (each pass is a dependent L2
    round trip: one request's merge ran 5 of them at S = 66), else CHUNK_S at a time."""
    block_s = next_pow2(splits)
    chunk = max(1, min(block_s, MERGE_TILE // next_pow2(dim_v)))
    tile = chunk * next_pow2(dim_v)
    return {"BLOCK_S": block_s, "CHUNK_S": chunk, "num_warps": 8 if tile > 4096 else 4}


def rope_store_decode_attention(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    **attention: object,
) -> torch.Tensor:
    """``rope_store.rope_store_kv`` then ``decode_attention`` in one launch (plus the
    merge): each split program rotates its q heads as it loads them, and the split
    holding a request's last key rotates that token's K row and writes it and the V
    row at ``write_ids`` before it reads its keys. The same bytes as the two ops
    (their roundings), except that q and k are not rotated in place. Arguments:
    ``rope_store_kv``'s (k_cache / v_cache the attention's views, in k's dtype: an
    fp8 cache takes the two-op path), then ``decode_attention``'s."""
    check_rope_store_args(k_cache, v_cache, write_ids, q, k, v, cos, positions)
    check_same_device(q, k, v, write_ids, cos, sin, positions)
    return decode_attention(q, k_cache, v_cache, block_table, seq_lens, **attention,
                            new_row=(k, v, write_ids), rope=(cos, sin, positions))  # fmt: skip


def store_decode_attention(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    **attention: object,
) -> torch.Tensor:
    """``store.store_kv`` then ``decode_attention`` in one launch (plus the merge), for
    attention without rope (NemotronH, Granite-4.0-H's nope layers, a model that
    rotates q and k itself): the split holding a request's last key writes that
    token's K and V rows at ``write_ids`` before it reads its keys, as
    ``rope_store_decode_attention`` does without the rotation. The same bytes as the
    two ops. k_cache / v_cache: the attention's views, in k's dtype (an fp8 cache is
    quantised by the caller: ``store_kv`` then ``decode_attention``); then
    ``decode_attention``'s arguments."""
    check_store_args("store_decode_attention", k_cache, v_cache, write_ids, q, k, v)
    check_same_device(q, k, v, write_ids)
    return decode_attention(q, k_cache, v_cache, block_table, seq_lens, **attention,
                            new_row=(k, v, write_ids))  # fmt: skip
