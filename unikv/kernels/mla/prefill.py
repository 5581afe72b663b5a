"""Triton MLA kernels over the MLA sub-pool's dense latent views (absorbed form).

One kernel serves decode and extend (prefill chunks): the rows of a request are
its (new token, query head) pairs, flattened head-minor,

    row m of request b  ->  token j = m // H, head h = m % H, position prefix_b + j

so a decode step (one token) is H rows sharing every latent tile, and an extend
step is q_len * H rows under a causal mask ``key <= position``. Grid
``(ceil(max_q_len * H / BLOCK_M), B, S)``; program (row block, request, split)
streams the request's latent rows through the block table,

    row(i) = block_table[b, i // ps] * ps + i % ps              (int64)
    logits = (q_latent . c + q_rope . k_rope) * sm_scale        two dots, no padding
    acc   += softmax-weights @ c                                V = the first rank columns

and cuts the keys it sees into S BLOCK_N-aligned chunks (split-KV, decode only):
each split writes (acc / l, lse) to a fp32 workspace and the decode merge kernel
(``decode._decode_merge_kernel``) combines them per (token, head). S is fixed on
the host from the SM count and the block table's capacity, never from seq_lens,
so the grid is CUDA-graph safe. With S == 1 the kernel writes ``out`` itself.

``store_mla`` writes latent rows with the K/V store kernel over the row's two
single-head column views [c | k_rope] (one launch, a bit copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.attention import store
from unikv.kernels.attention.decode import _decode_merge_kernel, merge_launch
from unikv.kernels.attention.tiles import dot_precision
from unikv.kernels.mla.ref import check_mla_args, check_store_args, latent_parts
from unikv.kernels.runtime.checks import (  # noqa: F401  (workspace_numel: public, sizes buffers)
    device_sms,
    next_pow2,
    out_buffer,
    split_workspace,
    workspace_numel,
)
from unikv.kernels.runtime.ids import row_offset

MIN_SPLIT_TOKENS = 256  # never cut a request's keys into chunks shorter than this
CTAS_PER_SM = 4  # split decode until about this many programs per SM ...
NO_SPLIT_PROGRAMS_PER_SM = 2  # ... unless the row blocks already give this many
MAX_SPLITS = 64
# (block_m, block_n, num_warps, num_stages) by (padded rank >= 512, block_m): an
# untuned first guess for the H200 (benchmarks/bench_mla.py --sweep times others)
CONFIGS = {
    (True, 16): (16, 32, 4, 2),
    (True, 32): (32, 32, 8, 2),
    (False, 16): (16, 16, 4, 1),
    (False, 32): (32, 16, 4, 1),
}


def choose_config(rank: int, rows: int, itemsize: int = 2) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for a kv_lora_rank, the rows of one
    request (``max_q_len * heads``: 16-row blocks when they hold every row) and the
    query itemsize (fp32 tiles are not multi-buffered: shared memory)."""
    block_m, block_n, warps, stages = CONFIGS[(next_pow2(rank) >= 512, 16 if rows <= 16 else 32)]
    return block_m, block_n, warps, stages if itemsize <= 2 else 1


def choose_num_splits(row_programs: int, max_q_len: int, max_len: int, device: torch.device) -> int:
    """Splits per request: 1 for extend; for decode enough programs to fill the GPU
    with chunks >= MIN_SPLIT_TOKENS. Host ints only (no seq_lens)."""
    sms = device_sms(device)
    if max_q_len > 1 or row_programs >= NO_SPLIT_PROGRAMS_PER_SM * sms:
        return 1
    want = triton.cdiv(sms * CTAS_PER_SM, max(row_programs, 1))
    cap = max(1, triton.cdiv(max_len, MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, MAX_SPLITS))


@triton.jit
def _mla_kernel(
    q_lat,
    q_rope,
    cache,
    block_table,
    q_indptr,
    seq_lens,
    out,
    ws_acc,
    ws_lse,
    sm_scale,
    ql_st,
    ql_sh,
    qr_st,
    qr_sh,
    c_sn,
    bt_sb,
    o_st,
    o_sh,
    H: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    mb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(q_indptr + b)
    q_len = tl.load(q_indptr + b + 1) - q_start
    if mb * BLOCK_M >= q_len * H:
        return
    prefix = tl.load(seq_lens + b) - q_len
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len * H
    head = offs_m % H
    pos_m = prefix + offs_m // H
    tok = (q_start + offs_m // H).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    mask_r = offs_r < RANK
    mask_p = offs_p < ROPE
    ql = tl.load(
        q_lat + tok[:, None] * ql_st + head[:, None] * ql_sh + offs_r[None, :],
        mask=mask_m[:, None] & mask_r[None, :],
        other=0.0,
    )
    qr = tl.load(
        q_rope + tok[:, None] * qr_st + head[:, None] * qr_sh + offs_p[None, :],
        mask=mask_m[:, None] & mask_p[None, :],
        other=0.0,
    ).to(ql.dtype)
    # keys [0, kv_end): up to the last position any row of this block sees
    kv_end = prefix + tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // H, q_len - 1) + 1
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    bt_row = block_table + b.to(tl.int64) * bt_sb
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        entry = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        # entry * (ps * c_sn) + slot * c_sn, never kernel_row(...) * c_sn (_ids.row_offset)
        row_ptr = cache + row_offset(entry, offs_n, PAGE_SIZE, PAGE_SIZE * c_sn, c_sn)[:, None]
        kc = tl.load(
            row_ptr + offs_r[None, :],
            mask=mask_n[:, None] & mask_r[None, :],
            other=0.0,
        ).to(ql.dtype)
        kr = tl.load(
            row_ptr + RANK + offs_p[None, :],
            mask=mask_n[:, None] & mask_p[None, :],
            other=0.0,
        ).to(ql.dtype)
        s = tl.dot(ql, tl.trans(kc), input_precision=PRECISION)
        s = tl.dot(qr, tl.trans(kr), s, input_precision=PRECISION) * qk_scale
        visible = mask_n[None, :] & (offs_n[None, :] <= pos_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(ql.dtype), kc, input_precision=PRECISION)
        m_i = m_new
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptr = out + tok[:, None] * o_st + head[:, None] * o_sh + offs_r[None, :]
        tl.store(o_ptr, res.to(out.dtype.element_ty), mask=mask_m[:, None] & mask_r[None, :])
    else:  # workspace row of (token, head, split), as the decode merge kernel reads it
        row = (tok * H + head) * NUM_SPLITS + split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(
            ws_acc + row[:, None] * RANK + offs_r[None, :],
            res,
            mask=mask_m[:, None] & mask_r[None, :],
        )
        tl.store(ws_lse + row, lse, mask=mask_m)


def store_mla(
    latent_cache: torch.Tensor, kernel_ids: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor
) -> None:
    """Write the latent rows of T tokens at kernel ids, one launch (a bit copy).

    latent_cache: (N, rank + rope) dense per-layer latent view, storage dtype
    (uint8 for fp8); kernel_ids: (T,) int32/int64; latent: (T, rank); rope:
    (T, rope); unit last strides.
    """
    check_store_args(latent_cache, kernel_ids, latent, rope)
    c_view, rope_view = latent_parts(latent_cache, latent.shape[1])
    store.store_kv(c_view, rope_view, kernel_ids, latent[:, None], rope[:, None])


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
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of ragged new tokens over their cached latent rows.

    Arguments as in ``mla_ref.mla_attention``: q_latent (T, H, rank), q_rope
    (T, H, rope), latent_cache (N, rank + rope), block_table (B, max_pages)
    int32, q_indptr (B+1,) int32, seq_lens (B,) int32, max_q_len host int.
    workspace: optional fp32 tensor of >= ``workspace_numel(T, H, rank, S)``
    elements (fixed buffers for CUDA graphs). num_splits / config override the
    heuristics (benchmarks). Returns out (T, H, rank) in q_latent's dtype.
    """
    check_mla_args(q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens)
    num_tokens, heads, rank = q_latent.shape
    rope = q_rope.shape[2]
    out = out_buffer(out, (num_tokens, heads, rank), q_latent)
    bsz = block_table.shape[0]
    if num_tokens == 0 or bsz == 0 or max_q_len <= 0:
        return out
    rows = max_q_len * heads
    block_m, block_n, warps, stages = config or choose_config(rank, rows, q_latent.element_size())
    row_blocks = triton.cdiv(rows, block_m)
    max_len = block_table.shape[1] * page_size
    splits = num_splits or choose_num_splits(row_blocks * bsz, max_q_len, max_len, out.device)
    ws_acc, ws_lse = split_workspace(workspace, num_tokens, heads, rank, splits, out.device)
    _mla_kernel[(row_blocks, bsz, splits)](
        q_latent,
        q_rope,
        latent_cache,
        block_table,
        q_indptr,
        seq_lens,
        out,
        ws_acc,
        ws_lse,
        sm_scale,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        latent_cache.stride(0),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        H=heads,
        RANK=rank,
        ROPE=rope,
        BLOCK_R=max(16, next_pow2(rank)),
        BLOCK_P=max(16, next_pow2(rope)),
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        NUM_STAGES=stages,
        PRECISION=dot_precision(q_latent),
        num_warps=warps,
    )
    if splits > 1:
        _decode_merge_kernel[(num_tokens, heads)](
            ws_acc,
            ws_lse,
            ws_acc,  # no sinks
            out,
            out.stride(0),
            out.stride(1),
            heads,
            DV=rank,
            BLOCK_DV=next_pow2(rank),
            NUM_SPLITS=splits,
            HAS_SINKS=False,
            PDL=False,  # the MLA split kernel launches plainly
            **merge_launch(splits, rank),
        )
    return out
