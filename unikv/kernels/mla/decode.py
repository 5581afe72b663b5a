"""Triton paged MLA decode (absorbed form) for many query heads on one latent KV head.

Decode step: request b has one new token (``q_indptr[b+1] - q_indptr[b]`` is 0 or 1)
whose H query heads all read the same cached latent rows ``[c (rank) | k_rope (rope)]``
(``mla_ref`` states the math). Grid ``(head_blocks * NUM_V, B, S)``; program
(head block, V part v, request, split) owns BLOCK_H heads as the M rows of every dot,
so each latent tile is loaded once per head block (not once per head):

    s    = q[:, mine] . c[:, mine]^T (+ q[:, other] . c[:, other]^T) + q_rope . k_rope^T
    acc += softmax-weights(s) @ c[:, mine]                  (BLOCK_H x BLOCK_V, fp32)

``mine`` is this program's BLOCK_V of the rank columns of V. With NUM_V = 2 the
512-wide V is cut in two programs of 256 columns (a 64 x 512 fp32 accumulator does
not fit one warpgroup's registers); both compute the full logits, the "other"
columns only feed them. Token rows are reached through the block table
(``_ids.row_offset``, int64). A request's keys ``[0, seq_len)`` are cut into S
BLOCK_N-aligned chunks (split-KV); each split writes ``(acc / l, lse)`` to a fp32
workspace and ``_merge_kernel`` combines the splits per (token, head, column block).
S == 1 writes ``out`` directly. Config and S depend only on host ints (heads,
batch, page size, the block table's capacity, SM count, compute capability): no tuning, no
device reads, CUDA-graph safe; with ``out`` and ``workspace`` passed nothing is
allocated. Steps with ``max_q_len > 1`` (prefill chunks) go to ``mla.mla_attention``.
This is the ``split`` variant; ``mla_decode_plan`` holds the configs, the (heads, page
size) table and the split rules, and ``mla_decode_fused`` the ``fused`` / ``tma``
variants (logits once per tile), which share the workspace and the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.attention.tiles import dot_precision
from unikv.kernels.mla import decode_fused as mla_decode_fused
from unikv.kernels.mla import prefill as mla
from unikv.kernels.mla.new_row import new_row
from unikv.kernels.mla.plan import (  # noqa: F401  (the plan's public names, re-exported)
    CONFIGS,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    TABLE,
    Config,
    check_config,
    choose_config,
    choose_num_splits,
    decode_plan,
    workspace_numel,
)
from unikv.kernels.mla.ref import check_mla_args, check_store_args
from unikv.kernels.runtime.checks import (
    check_ids,
    check_same_device,
    device_sms,
    next_pow2,
    out_buffer,
    split_workspace,
)
from unikv.kernels.runtime.ids import row_offset
from unikv.kernels.runtime.interpret import patch_interpreter

patch_interpreter()  # tl.range with run-time bounds under TRITON_INTERPRET=1


@triton.jit(do_not_specialize=["num_splits"])  # one compile for every split count
def _split_kernel(
    q_lat, q_rope, cache, block_table, q_indptr, seq_lens, out, ws_acc, ws_lse, sm_scale,
    ql_st, ql_sh, qr_st, qr_sh, c_sn, bt_sb, o_st, o_sh, num_splits,
    lat_new, rope_new, write_ids, ln_st, rn_st,
    H: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr, NUM_V: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr, STORE: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)  # head block * NUM_V + v: siblings adjacent (L2 reuse)
    b = tl.program_id(1)
    split = tl.program_id(2)
    tok = tl.load(q_indptr + b)
    if tl.load(q_indptr + b + 1) == tok:  # a lane with no new token
        return
    seq = tl.load(seq_lens + b)
    chunk = tl.cdiv(tl.cdiv(seq, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq)
    v = pid % NUM_V
    heads = (pid // NUM_V) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < H
    cols = v * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's V columns
    mask_c = cols < RANK
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < ROPE
    tok = tok.to(tl.int64)
    q_row = q_lat + tok * ql_st + heads[:, None] * ql_sh
    qv = tl.load(q_row + cols[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    qr = tl.load(
        q_rope + tok * qr_st + heads[:, None] * qr_sh + offs_p[None, :],
        mask=mask_h[:, None] & mask_p[None, :],
        other=0.0,
    ).to(qv.dtype)
    cols_o = (1 - v) * BLOCK_V + tl.arange(0, BLOCK_V)  # NUM_V 1: past RANK, never read
    mask_o = cols_o < RANK
    if NUM_V == 2:  # the other columns of the logits
        qo = tl.load(q_row + cols_o[None, :], mask=mask_h[:, None] & mask_o[None, :], other=0.0)
    if STORE:  # the step's new row (``new_row``): V part 0 of head block 0 writes it
        new, _ = new_row(lat_new, rope_new, write_ids, tok, ln_st, rn_st, cache, c_sn, lo, hi,
                         seq, cols, cols_o, offs_p, RANK, ROPE, PAGE_SIZE, pid == 0)  # fmt: skip
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    bt_row = block_table + b.to(tl.int64) * bt_sb
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        entry = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        rows = cache + row_offset(entry, offs_n, PAGE_SIZE, PAGE_SIZE * c_sn, c_sn)[:, None]
        keep = mask_n[:, None]
        if STORE:  # the new row's key comes from registers, its bytes are not read
            is_new = (offs_n == new[0])[:, None]
            keep = keep & ~is_new
        cv = tl.load(rows + cols[None, :], mask=keep & mask_c[None, :], other=0.0)
        if STORE:
            cv = tl.where(is_new, new[1][None, :], cv)
        cv = cv.to(qv.dtype)
        s = tl.dot(qv, tl.trans(cv), input_precision=PRECISION)
        if NUM_V == 2:
            co = tl.load(rows + cols_o[None, :], mask=keep & mask_o[None, :], other=0.0)
            if STORE:
                co = tl.where(is_new, new[2][None, :], co)
            s = tl.dot(qo, tl.trans(co.to(qv.dtype)), s, input_precision=PRECISION)
        kr = tl.load(rows + RANK + offs_p[None, :], mask=keep & mask_p[None, :], other=0.0)
        if STORE:
            kr = tl.where(is_new, new[3][None, :], kr)
        s = tl.dot(qr, tl.trans(kr.to(qv.dtype)), s, input_precision=PRECISION)
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a live key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(qv.dtype), cv, input_precision=PRECISION)
        m_i = m_new
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = mask_h[:, None] & mask_c[None, :]
    if not SPLIT:
        o_ptr = out + tok * o_st + heads[:, None] * o_sh + cols[None, :]
        tl.store(o_ptr, res.to(out.dtype.element_ty), mask=mask)
    else:  # workspace row (token, head, split); V part 0 alone writes the lse
        row = (tok * H + heads) * num_splits + split
        tl.store(ws_acc + row[:, None] * RANK + cols[None, :], res, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(ws_lse + row, lse, mask=mask_h & (v == 0))


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    ws_acc, ws_lse, out, o_st, o_sh, num_splits, H: tl.constexpr, RANK: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out[tok, h, cols] = sum_s 2^(lse_s - M) acc_s / sum_s 2^(lse_s - M)."""
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    row0 = (tok * H + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    lse = tl.load(ws_lse + row0 + offs_s, mask=mask_s, other=float("-inf"))
    peak = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(peak == float("-inf"), 0.0, peak))  # 0 for empty splits
    denom = tl.sum(w, axis=0)
    mask_c = cols < RANK
    part = tl.load(
        ws_acc + (row0 + offs_s)[:, None] * RANK + cols[None, :],
        mask=mask_s[:, None] & mask_c[None, :],
        other=0.0,
    )
    res = tl.sum(part * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out + tok * o_st + h * o_sh + cols, res.to(out.dtype.element_ty), mask=mask_c)


def _launch_split(
    q_latent, q_rope, cache, block_table, q_indptr, seq_lens, out, workspace, ws_lse,
    sm_scale, page_size, splits, cfg, new_row=None,
) -> None:  # fmt: skip
    """The split kernel over checked ``mla_attention`` arguments."""
    heads, rank = q_latent.shape[1:]
    rope = q_rope.shape[2]
    block_v = max(16, next_pow2(triton.cdiv(rank, cfg.num_v)))
    lat_new, rope_new, ids = new_row or (q_latent, q_rope, seq_lens)  # unread without it
    _split_kernel[(triton.cdiv(heads, cfg.block_h) * cfg.num_v, block_table.shape[0], splits)](
        q_latent, q_rope, cache, block_table, q_indptr, seq_lens, out, workspace, ws_lse,
        sm_scale, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), block_table.stride(0), out.stride(0), out.stride(1), splits, lat_new,
        rope_new, ids, lat_new.stride(0), rope_new.stride(0), H=heads,
        RANK=rank, ROPE=rope, BLOCK_V=block_v, BLOCK_P=max(16, next_pow2(rope)),
        NUM_V=cfg.num_v, PAGE_SIZE=page_size, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        SPLIT=splits > 1, NUM_STAGES=cfg.num_stages, PRECISION=dot_precision(q_latent),
        STORE=new_row is not None, num_warps=cfg.num_warps,
    )  # fmt: skip


def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_q_len: int,
    page_size: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: Config | tuple | None = None,
    new_row: tuple | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention, ``mla.mla_attention``'s signature and semantics.

    q_latent (T, H, rank), q_rope (T, H, rope), latent_cache (N, rank + rope) dense
    latent view, block_table (B, max_pages) int32 kernel page entries, q_indptr (B+1,)
    int32, seq_lens (B,) int32 (new rows already stored), max_q_len host int. Decode
    (max_q_len 1) runs here; longer steps go to ``mla.mla_attention``. workspace:
    optional fp32 tensor of >= ``workspace_numel(T, H, rank, S)`` elements (CUDA
    graphs). num_splits / config override the heuristics (benchmarks, tests). new_row:
    None, or a decode step's (latent, rope, write_ids) stored inside the launch
    (``store_mla_attention``, checked there; seq_lens then count the new rows).
    Returns out (T, H, rank) in q_latent's dtype.
    """
    assert new_row is None or max_q_len <= 1, "new_row is a decode step's: store_mla_attention"
    if max_q_len > 1:
        return mla.mla_attention(
            q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens,
            max_q_len=max_q_len, page_size=page_size, sm_scale=sm_scale, out=out,
            workspace=workspace,
        )  # fmt: skip
    check_mla_args(q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens)
    num_tokens, heads, rank = q_latent.shape
    out = out_buffer(out, (num_tokens, heads, rank), q_latent)
    bsz = block_table.shape[0]
    if num_tokens == 0 or bsz == 0 or max_q_len <= 0:
        return out
    if config is None:
        cfg = choose_config(heads, q_latent.dtype, out.device, page_size)
    else:
        cfg = check_config(config)
    max_len = block_table.shape[1] * page_size
    splits = num_splits or choose_num_splits(bsz, heads, rank, max_len, cfg, device_sms(out.device))
    ws_acc, ws_lse = split_workspace(workspace, num_tokens, heads, rank, splits, out.device)
    if cfg.variant != "split":
        mla_decode_fused.launch(
            q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens, out, ws_acc,
            ws_lse, sm_scale=sm_scale, page_size=page_size, num_splits=splits, config=cfg,
            new_row=new_row,
        )  # fmt: skip
    else:
        _launch_split(q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens, out,
                      ws_acc, ws_lse, sm_scale, page_size, splits, cfg, new_row)  # fmt: skip
    if splits > 1:
        block_s = next_pow2(splits)
        block_c = max(16, min(next_pow2(rank), 8192 // block_s))  # <= 8192 fp32 a program
        _merge_kernel[(num_tokens, heads, triton.cdiv(rank, block_c))](
            ws_acc, ws_lse, out, out.stride(0), out.stride(1), splits, H=heads, RANK=rank,
            BLOCK_S=block_s, BLOCK_C=block_c, num_warps=4,
        )  # fmt: skip
    return out


def store_mla_attention(
    latent_cache: torch.Tensor,
    write_ids: torch.Tensor,
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    block_table: torch.Tensor,
    q_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_q_len: int,
    page_size: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: Config | tuple | None = None,
) -> torch.Tensor:
    """``mla.store_mla`` then ``mla_attention``; a decode step (max_q_len 1) in one launch
    (plus the merge): the split holding a request's last key takes the new row from
    ``latent`` / ``rope`` and one of its programs writes it at ``write_ids`` (``new_row``
    says how no program reads it half-written). The same bytes as the two ops. Every
    token is one lane's (q_indptr[B] == T) and its write id is the kernel id of its
    request's position seq_len - 1. Arguments: ``store_mla``'s (latent and rope in the
    cache's dtype), then ``mla_attention``'s; longer steps run the two ops."""
    check_store_args(latent_cache, write_ids, latent, rope)
    check_ids("write_ids", write_ids)
    if latent.dtype != latent_cache.dtype or rope.dtype != latent_cache.dtype:
        raise ValueError(
            f"latent / rope must be in the cache's dtype {latent_cache.dtype} (MLA rows are "
            f"stored as they are), got {latent.dtype} / {rope.dtype}"
        )
    if latent.stride(1) != 1 or rope.stride(1) != 1:
        raise ValueError(
            f"latent / rope need unit last stride, got {latent.stride()} / {rope.stride()}"
        )
    check_same_device(latent_cache, write_ids, latent, rope, q_latent)
    attend = {"max_q_len": max_q_len, "page_size": page_size, "sm_scale": sm_scale, "out": out,
              "workspace": workspace, "num_splits": num_splits, "config": config}  # fmt: skip
    if max_q_len > 1:  # prefill chunks: the store, then the ragged kernel
        mla.store_mla(latent_cache, write_ids, latent, rope)
        return mla_attention(q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens,
                             **attend)  # fmt: skip
    return mla_attention(q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens,
                         **attend, new_row=(latent, rope, write_ids))  # fmt: skip
