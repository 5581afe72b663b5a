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
(``_ids.kernel_row``, int64). A request's keys ``[0, seq_len)`` are cut into S
BLOCK_N-aligned chunks (split-KV); each split writes ``(acc / l, lse)`` to a fp32
workspace and ``_merge_kernel`` combines the splits per (token, head, column block).
S == 1 writes ``out`` directly. Config and S depend only on host ints (heads,
batch, the block table's capacity, SM count, compute capability): no tuning, no
device reads, CUDA-graph safe; with ``out`` and ``workspace`` passed nothing is
allocated. Steps with ``max_q_len > 1`` (prefill chunks) go to ``mla.mla_attention``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from unikv.kernels import mla
from unikv.kernels._attn import dot_precision
from unikv.kernels._checks import device_sms, next_pow2
from unikv.kernels._ids import kernel_row
from unikv.kernels._interpret import patch_interpreter
from unikv.kernels.mla_ref import check_mla_args

patch_interpreter()  # tl.range with run-time bounds under TRITON_INTERPRET=1


class Config(NamedTuple):
    """Tile config: heads per program, V parts (1 or 2), keys per tile, warps,
    pipeline stages; programs an SM holds at once and ns a key per program (the
    split model's estimates)."""

    block_h: int
    num_v: int
    block_n: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 1
    token_ns: float = 32.0


# Untuned first guesses; ``benchmarks/bench_mla_decode.py --sweep`` times others. sm90
# figures from ptxas (triton 3.6, rank 512 + rope 64, bf16): registers a thread, smem.
# wide*: heads are the wgmma M rows (64 per warpgroup, warps along M), V in two programs
#   of 256 columns (a 64 x 512 fp32 accumulator needs 256 registers a thread); Q and
#   two latent stages in smem. wide128: 230 regs, 216 KB; wide64: 249 regs, 144 KB.
# narrow*: 16 heads, whole V, mma.sync with the warps along keys / V columns (BLOCK_N >
#   BLOCK_H, so no replicated rows). narrow90: 168 regs, 92 KB; narrow: 205 regs, 55 KB.
# fp32: exact fp32 dots (no tensor cores), small tiles.
CONFIGS = {
    "wide128": Config(128, 2, 32, 8, 2, 1, 70.0),
    "wide64": Config(64, 2, 32, 4, 2, 1, 35.0),
    "narrow90": Config(16, 1, 64, 8, 2, 1, 32.0),
    "narrow": Config(16, 1, 32, 4, 2, 2, 32.0),
    "fp32": Config(16, 1, 16, 4, 1, 2, 64.0),
}
MIN_SPLIT_TOKENS = 256  # never cut a request's keys into chunks shorter than this
MAX_SPLITS = 128
# split-count model (ns, rough H200 figures): a program costs PROGRAM_NS plus token_ns
# a key, in waves of sms * ctas_per_sm programs; splits > 1 add the merge (a launch and
# the fp32 partials written and read once).
PROGRAM_NS, MERGE_NS, HBM_BYTES_PER_NS = 2000.0, 4000.0, 3000.0


@functools.cache
def _capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def choose_config(heads: int, dtype: torch.dtype, device: torch.device) -> Config:
    """The config for a head count and query dtype on a device (host only)."""
    if dtype == torch.float32:
        return CONFIGS["fp32"]
    if device.type != "cuda":
        return CONFIGS["narrow"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _capability(index) != 9:  # the wide tiles are wgmma (sm90) tiles
        return CONFIGS["narrow"]
    return CONFIGS["wide128" if heads >= 128 else "wide64" if heads >= 64 else "narrow90"]


@functools.lru_cache(maxsize=1024)
def choose_num_splits(
    batch: int, heads: int, rank: int, max_len: int, config: Config, sms: int
) -> int:
    """Splits per request minimising a wave model of the split kernel plus the merge.

    batch: requests; max_len: the block table's capacity in tokens (never seq_lens, so
    the count is fixed for a CUDA graph); sms: streaming multiprocessors."""
    programs = batch * triton.cdiv(heads, config.block_h) * config.num_v
    slots = max(1, sms * config.ctas_per_sm)
    cap = max(1, min(MAX_SPLITS, max_len // MIN_SPLIT_TOKENS))
    best, best_ns = 1, float("inf")
    for splits in range(1, cap + 1):
        chunk = triton.cdiv(triton.cdiv(max_len, splits), config.block_n) * config.block_n
        waves = triton.cdiv(programs * splits, slots)
        ns = waves * (chunk * config.token_ns + PROGRAM_NS)
        if splits > 1:
            ns += MERGE_NS + 8.0 * batch * heads * splits * rank / HBM_BYTES_PER_NS
        if ns < best_ns:
            best, best_ns = splits, ns
    return best


def workspace_numel(num_tokens: int, heads: int, rank: int, num_splits: int) -> int:
    """fp32 elements of the split-KV workspace (acc and lse of every split)."""
    return num_tokens * heads * num_splits * (rank + 1)


def decode_plan(
    batch: int, heads: int, rank: int, max_len: int, dtype: torch.dtype, device: torch.device
) -> tuple[Config, int, int]:
    """(config, num_splits, workspace fp32 elements) of a decode step of ``batch``
    one-token requests over a block table of ``max_len`` tokens: once per step."""
    config = choose_config(heads, dtype, device)
    splits = choose_num_splits(batch, heads, rank, max_len, config, device_sms(device))
    return config, splits, workspace_numel(batch, heads, rank, splits) if splits > 1 else 1


@triton.jit
def _split_kernel(
    q_lat, q_rope, cache, block_table, q_indptr, seq_lens, out, ws_acc, ws_lse, sm_scale,
    ql_st, ql_sh, qr_st, qr_sh, c_sn, bt_sb, o_st, o_sh, num_splits,
    H: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr, NUM_V: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
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
    if NUM_V == 2:  # the other columns of the logits
        cols_o = (1 - v) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_o = cols_o < RANK
        qo = tl.load(q_row + cols_o[None, :], mask=mask_h[:, None] & mask_o[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    bt_row = block_table + b.to(tl.int64) * bt_sb
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        entry = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        rows = cache + (kernel_row(entry, offs_n, PAGE_SIZE) * c_sn)[:, None]
        cv = tl.load(rows + cols[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0)
        cv = cv.to(qv.dtype)
        s = tl.dot(qv, tl.trans(cv), input_precision=PRECISION)
        if NUM_V == 2:
            co = tl.load(rows + cols_o[None, :], mask=mask_n[:, None] & mask_o[None, :], other=0.0)
            s = tl.dot(qo, tl.trans(co.to(qv.dtype)), s, input_precision=PRECISION)
        kr = tl.load(
            rows + RANK + offs_p[None, :], mask=mask_n[:, None] & mask_p[None, :], other=0.0
        )
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


@triton.jit
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


def _check_config(config) -> Config:
    config = Config(*config)
    pow2 = all(x >= 16 and x == next_pow2(x) for x in (config.block_h, config.block_n))
    if not pow2 or config.num_v not in (1, 2) or config.num_warps < 1 or config.num_stages < 1:
        raise ValueError(
            f"config must be (block_h, num_v, block_n, num_warps, num_stages[, ctas_per_sm]) "
            f"with powers of two >= 16 for block_h / block_n and num_v 1 or 2, got {config}"
        )
    return config


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
) -> torch.Tensor:
    """Absorbed MLA attention, ``mla.mla_attention``'s signature and semantics.

    q_latent (T, H, rank), q_rope (T, H, rope), latent_cache (N, rank + rope) dense
    latent view, block_table (B, max_pages) int32 kernel page entries, q_indptr (B+1,)
    int32, seq_lens (B,) int32 (new rows already stored), max_q_len host int. Decode
    (max_q_len 1) runs here; longer steps go to ``mla.mla_attention``. workspace:
    optional fp32 tensor of >= ``workspace_numel(T, H, rank, S)`` elements (CUDA
    graphs). num_splits / config override the heuristics (benchmarks, tests).
    Returns out (T, H, rank) in q_latent's dtype.
    """
    if max_q_len > 1:
        return mla.mla_attention(
            q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens,
            max_q_len=max_q_len, page_size=page_size, sm_scale=sm_scale, out=out,
            workspace=workspace,
        )  # fmt: skip
    check_mla_args(q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens)
    num_tokens, heads, rank = q_latent.shape
    rope = q_rope.shape[2]
    if out is None:
        out = torch.empty(num_tokens, heads, rank, dtype=q_latent.dtype, device=q_latent.device)
    elif out.shape != (num_tokens, heads, rank) or out.stride(2) != 1:
        raise ValueError(
            f"out must be ({num_tokens}, {heads}, {rank}) with unit last stride, got "
            f"{tuple(out.shape)} strides {out.stride()}"
        )
    bsz = block_table.shape[0]
    if num_tokens == 0 or bsz == 0 or max_q_len <= 0:
        return out
    if config is None:
        cfg = choose_config(heads, q_latent.dtype, out.device)
    else:
        cfg = _check_config(config)
    max_len = block_table.shape[1] * page_size
    splits = num_splits or choose_num_splits(bsz, heads, rank, max_len, cfg, device_sms(out.device))
    need = workspace_numel(num_tokens, heads, rank, splits) if splits > 1 else 1
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=out.device)
    elif workspace.dtype != torch.float32 or workspace.numel() < need:
        raise ValueError(
            f"workspace must be fp32 with >= {need} elements (workspace_numel), got "
            f"{workspace.dtype} x {workspace.numel()}"
        )
    acc_numel = num_tokens * heads * splits * rank
    ws_lse = workspace[acc_numel:need] if splits > 1 else workspace
    block_v = max(16, next_pow2(triton.cdiv(rank, cfg.num_v)))
    _split_kernel[(triton.cdiv(heads, cfg.block_h) * cfg.num_v, bsz, splits)](
        q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens, out, workspace,
        ws_lse, sm_scale, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0),
        q_rope.stride(1), latent_cache.stride(0), block_table.stride(0), out.stride(0),
        out.stride(1), splits, H=heads, RANK=rank, ROPE=rope, BLOCK_V=block_v,
        BLOCK_P=max(16, next_pow2(rope)), NUM_V=cfg.num_v, PAGE_SIZE=page_size,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, SPLIT=splits > 1,
        NUM_STAGES=cfg.num_stages, PRECISION=dot_precision(q_latent),
        num_warps=cfg.num_warps,
    )  # fmt: skip
    if splits > 1:
        block_s = next_pow2(splits)
        block_c = max(16, min(next_pow2(rank), 8192 // block_s))  # <= 8192 fp32 a program
        _merge_kernel[(num_tokens, heads, triton.cdiv(rank, block_c))](
            workspace, ws_lse, out, out.stride(0), out.stride(1), splits, H=heads, RANK=rank,
            BLOCK_S=block_s, BLOCK_C=block_c, num_warps=4,
        )  # fmt: skip
    return out
