"""Fused MLA decode: the logits of a latent tile computed once for all rank columns of V.

Grid ``(head_blocks, B, S)``; program (head block, request b, split) owns BLOCK_H heads
(the M rows of every dot) and keys ``[lo, hi)`` of b (``mla_decode`` states the split
layout). The rank columns are cut in two halves of BLOCK_V (0 and 1), so no tile is
wider than 256 columns (a TMA box) and the fp32 output is two accumulators:

    s     = (q0 . c0^T + q1 . c1^T + q_rope . k_rope^T) * sm_scale * log2(e)
    p     = 2^(s - m)                                   (online softmax, base 2)
    acc_i = acc_i * 2^(m_old - m) + p @ c_i             (BLOCK_H x BLOCK_V, fp32)

With 64 heads on 8 warps the two warpgroups share N, so the 64 x 512 accumulator is
128 registers a thread (FlashMLA's split of the PV product between warpgroups).
Tiles of full keys run unmasked; the last, partial tile alone is masked (its rows past
``seq_len`` may hold anything: they load as 0). Row addresses:

    gather  (page_size % BLOCK_N != 0): entry per key, ``_ids.row_offset``
    contig  (page_size % BLOCK_N == 0): a tile lies in one page: one block-table entry
    tma     (contig, ``tma_ok``): full tiles by TMA descriptors over ``cache[:, :rank]``
            and ``cache[:, rank:]`` (box BLOCK_N x BLOCK_V / BLOCK_P; zero past a view)

Writes ``out`` (one split) or the fp32 workspace rows (token, head, split) that
``mla_decode._merge_kernel`` combines. Host ints only: graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from unikv.kernels.attention.tiles import dot_precision
from unikv.kernels.mla.new_row import new_row
from unikv.kernels.mla.plan import Config
from unikv.kernels.runtime.checks import next_pow2
from unikv.kernels.runtime.ids import row_offset
from unikv.kernels.runtime.interpret import patch_interpreter

patch_interpreter()  # tl.range with run-time bounds under TRITON_INTERPRET=1


@triton.jit
def _load_tile(
    cache, c_desc, r_desc, bt_row, start, hi, c_sn, new, dtype: tl.constexpr, RANK: tl.constexpr,
    ROPE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CONTIG: tl.constexpr, TMA: tl.constexpr,
    STORE: tl.constexpr = False,
):  # fmt: skip
    """Tile of keys ``start + [0, BLOCK_N)``: c0, c1 (BLOCK_N, BLOCK_V), k_rope
    (BLOCK_N, BLOCK_P) in ``dtype``; keys >= hi (MASKED) and columns past the view are 0.
    STORE (MASKED tiles only): ``new`` = (position, c0, c1, k_rope) of the step's new
    row, which replaces that position's key (its bytes are not read: ``new_row``)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    if CONTIG:  # one page: entry of the tile's first key
        entry = tl.load(bt_row + start // PAGE_SIZE)
        first = entry * PAGE_SIZE + start % PAGE_SIZE  # int32 row of the dense view
    if TMA and not MASKED:
        c0 = c_desc.load([first, 0])
        c1 = c_desc.load([first, BLOCK_V])
        kr = r_desc.load([first, 0])
    else:
        if not CONTIG:  # CONTIG: the tile's one entry (its keys' slots are start % ps + i)
            entry = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        # entry * (ps * c_sn) + slot * c_sn: never a row index times c_sn, whose
        # alignment Triton overstates at row strides that are not a 16-byte multiple
        ptr = cache + row_offset(entry, offs_n, PAGE_SIZE, PAGE_SIZE * c_sn, c_sn)[:, None]
        cols = tl.arange(0, BLOCK_V)
        offs_p = tl.arange(0, BLOCK_P)
        keep = mask_n[:, None] if MASKED else tl.full([BLOCK_N, 1], 1, tl.int1)
        if STORE:
            is_new = (offs_n == new[0])[:, None]
            keep = keep & ~is_new
        c0 = tl.load(ptr + cols[None, :], mask=keep & (cols[None, :] < RANK), other=0.0)
        cols1 = BLOCK_V + cols
        c1 = tl.load(ptr + cols1[None, :], mask=keep & (cols1[None, :] < RANK), other=0.0)
        kr = tl.load(ptr + RANK + offs_p[None, :], mask=keep & (offs_p[None, :] < ROPE), other=0.0)
        if STORE:
            c0 = tl.where(is_new, new[1][None, :], c0)
            c1 = tl.where(is_new, new[2][None, :], c1)
            kr = tl.where(is_new, new[3][None, :], kr)
    return c0.to(dtype), c1.to(dtype), kr.to(dtype), mask_n


@triton.jit
def _step(
    q0, q1, qr, c0, c1, kr, mask_n, m_i, l_i, acc0, acc1, qk_scale, MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a tile (logits once, both V halves)."""
    s = tl.dot(q0, tl.trans(c0), input_precision=PRECISION)
    s = tl.dot(q1, tl.trans(c1), s, input_precision=PRECISION)
    s = tl.dot(qr, tl.trans(kr), s, input_precision=PRECISION)
    s = s * qk_scale
    if MASKED:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a live key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(c0.dtype)
    acc0 = tl.dot(p, c0, acc0 * alpha[:, None], input_precision=PRECISION)
    acc1 = tl.dot(p, c1, acc1 * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc0, acc1


@triton.jit(do_not_specialize=["num_splits"])
def _fused_kernel(
    q_lat, q_rope, cache, c_desc, r_desc, block_table, q_indptr, seq_lens, out, ws_acc, ws_lse,
    sm_scale, ql_st, ql_sh, qr_st, qr_sh, c_sn, bt_sb, o_st, o_sh, num_splits,
    lat_new, rope_new, write_ids, ln_st, rn_st,
    H: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr,
    CONTIG: tl.constexpr, TMA: tl.constexpr, STORE: tl.constexpr = False,
):  # fmt: skip
    b = tl.program_id(1)
    split = tl.program_id(2)
    tok = tl.load(q_indptr + b)
    if tl.load(q_indptr + b + 1) == tok:  # a lane with no new token
        return
    seq = tl.load(seq_lens + b)
    chunk = tl.cdiv(tl.cdiv(seq, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < H
    cols = tl.arange(0, BLOCK_V)
    m0, m1 = cols < RANK, BLOCK_V + cols < RANK
    offs_p = tl.arange(0, BLOCK_P)
    tok = tok.to(tl.int64)
    new = (seq - 1, 0.0, 0.0, 0.0)  # STORE: the new row (position, c0, c1, k_rope)
    holds_new = 0
    if STORE:  # the split holding the new row takes its tile on the masked path
        new, holds_new = new_row(lat_new, rope_new, write_ids, tok, ln_st, rn_st, cache, c_sn,
                                 lo, hi, seq, cols, BLOCK_V + cols, offs_p, RANK, ROPE,
                                 PAGE_SIZE, tl.program_id(0) == 0)  # fmt: skip
    # end of the unmasked tiles (neither past hi nor holding the new row)
    full_hi = lo + tl.maximum(hi - lo - holds_new, 0) // BLOCK_N * BLOCK_N
    q_row = q_lat + tok * ql_st + heads[:, None] * ql_sh
    q0 = tl.load(q_row + cols[None, :], mask=mask_h[:, None] & m0[None, :], other=0.0)
    q1 = tl.load(q_row + BLOCK_V + cols[None, :], mask=mask_h[:, None] & m1[None, :], other=0.0)
    qr = tl.load(
        q_rope + tok * qr_st + heads[:, None] * qr_sh + offs_p[None, :],
        mask=mask_h[:, None] & (offs_p[None, :] < ROPE),
        other=0.0,
    ).to(q0.dtype)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    bt_row = block_table + b.to(tl.int64) * bt_sb
    for start in tl.range(lo, full_hi, BLOCK_N, num_stages=NUM_STAGES):
        c0, c1, kr, mask_n = _load_tile(
            cache, c_desc, r_desc, bt_row, start, hi, c_sn, new, q0.dtype, RANK, ROPE, BLOCK_V,
            BLOCK_P, PAGE_SIZE, BLOCK_N, False, CONTIG, TMA,
        )  # fmt: skip
        m_i, l_i, acc0, acc1 = _step(
            q0, q1, qr, c0, c1, kr, mask_n, m_i, l_i, acc0, acc1, qk_scale, False, PRECISION
        )
    if full_hi < hi:  # the partial last tile (STORE: or the one holding the new row)
        c0, c1, kr, mask_n = _load_tile(
            cache, c_desc, r_desc, bt_row, full_hi, hi, c_sn, new, q0.dtype, RANK, ROPE,
            BLOCK_V, BLOCK_P, PAGE_SIZE, BLOCK_N, True, CONTIG, TMA, STORE,
        )  # fmt: skip
        m_i, l_i, acc0, acc1 = _step(
            q0, q1, qr, c0, c1, kr, mask_n, m_i, l_i, acc0, acc1, qk_scale, True, PRECISION
        )
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    res0, res1 = acc0 * inv[:, None], acc1 * inv[:, None]
    mask0, mask1 = mask_h[:, None] & m0[None, :], mask_h[:, None] & m1[None, :]
    if num_splits == 1:
        o_ptr = out + tok * o_st + heads[:, None] * o_sh + cols[None, :]
        tl.store(o_ptr, res0.to(out.dtype.element_ty), mask=mask0)
        tl.store(o_ptr + BLOCK_V, res1.to(out.dtype.element_ty), mask=mask1)
    else:  # workspace row (token, head, split)
        row = (tok * H + heads) * num_splits + split
        w_ptr = ws_acc + row[:, None] * RANK + cols[None, :]
        tl.store(w_ptr, res0, mask=mask0)
        tl.store(w_ptr + BLOCK_V, res1, mask=mask1)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(ws_lse + row, lse, mask=mask_h)


def block_sizes(rank: int, rope: int) -> tuple[int, int]:
    """(BLOCK_V, BLOCK_P): half the rank columns and the rope columns, powers of two >= 16."""
    return max(16, next_pow2(triton.cdiv(rank, 2))), max(16, next_pow2(rope))


def tma_ok(cache: torch.Tensor, rank: int, page_size: int, block_n: int) -> bool:
    """TMA descriptors can read this view with page-aligned tiles: rows and both column
    offsets 16-byte aligned, boxes of at most 256 columns (rank <= 512, rope <= 256),
    ``page_size % block_n == 0`` and int32 row indices."""
    item = cache.element_size()
    return (
        page_size % block_n == 0
        and max(block_sizes(rank, cache.shape[1] - rank)) <= 256
        and cache.data_ptr() % 16 == 0
        and (cache.stride(0) * item) % 16 == 0
        and (rank * item) % 16 == 0
        and cache.shape[0] < 2**31
    )


def launch(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    q_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: torch.Tensor,
    ws_lse: torch.Tensor,
    *,
    sm_scale: float,
    page_size: int,
    num_splits: int,
    config: Config,
    new_row: tuple | None = None,
) -> None:
    """The fused kernel over checked ``mla_decode.mla_attention`` arguments (shapes there);
    ``workspace`` / ``ws_lse`` are the acc and lse parts (used when num_splits > 1);
    new_row: None or the step's checked (latent, rope, write_ids), stored in the launch."""
    heads, rank = q_latent.shape[1:]
    rope = q_rope.shape[2]
    block_v, block_p = block_sizes(rank, rope)
    contig = page_size % config.block_n == 0
    use_tma = config.variant == "tma" and tma_ok(cache, rank, page_size, config.block_n)
    c_desc = r_desc = None
    if use_tma:
        c_desc = TensorDescriptor.from_tensor(cache[:, :rank], [config.block_n, block_v])
        r_desc = TensorDescriptor.from_tensor(cache[:, rank:], [config.block_n, block_p])
    grid = (triton.cdiv(heads, config.block_h), block_table.shape[0], num_splits)
    lat_new, rope_new, ids = new_row or (q_latent, q_rope, seq_lens)  # unread without it
    _fused_kernel[grid](
        q_latent, q_rope, cache, c_desc, r_desc, block_table, q_indptr, seq_lens, out,
        workspace, ws_lse, sm_scale, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0),
        q_rope.stride(1), cache.stride(0), block_table.stride(0), out.stride(0), out.stride(1),
        num_splits, lat_new, rope_new, ids, lat_new.stride(0), rope_new.stride(0), H=heads,
        RANK=rank, ROPE=rope, BLOCK_V=block_v, BLOCK_P=block_p, PAGE_SIZE=page_size, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
        NUM_STAGES=config.num_stages, PRECISION=dot_precision(q_latent), CONTIG=contig,
        TMA=use_tma, STORE=new_row is not None, num_warps=config.num_warps,
    )  # fmt: skip
