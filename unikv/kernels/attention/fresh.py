"""Triton extend attention of fresh prompts: no cached prefix, K/V read contiguous.

When no request of a batch has a cached prefix (``seq_lens == q_lens``, known to
the step planner from host ints), every key a new token sees is one of the
batch's own new tokens, whose K/V the model just computed: ``k``/``v`` (T, H, D)
hold them in token order, so the kernel reads K/V tiles straight from them (no
block-table gather), the way FlashInfer's ragged prefill does. The same grid and
loop split as ``extend``: program (head, q block, request), blocks launched
last-first, an unmasked loop over keys ``[lo, diag)`` and a masked diagonal.

Tiles come in through plain pointer loads, or, with ``tma`` in the config and
tensors TMA allows (16-byte aligned base and token stride, ``stride(1) == D``,
power-of-two D; Hopper and newer, or the interpreter), through host-built tensor
descriptors over the 2-D ``(T, H * D)`` view: request b's key tile at token
``t`` of head ``kvh`` is the box ``[q_start_b + t, kvh * D]`` (rows past T read 0,
rows of the next request are masked off by causality).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.attention import fresh_hopper as extend_hopper
from unikv.kernels.attention.tiles import attn_tile, dot_precision, finish_rows
from unikv.kernels.runtime.checks import check_same_device, next_pow2, out_buffer, tma_ok

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton without host tensor descriptors: tma_ok never holds
    TensorDescriptor = None

# (block_m, block_n, num_warps, num_stages, tma) per head_dim; the H200 pick comes
# from benchmarks/bench_extend_long.py (its "install" lines). head_dim 64 takes the best
# pointer-load tile of that sweep (docs/perf.md: 64 rows, 1.07x the 128-row tile):
# TMA was 1.16x alone but 1.02x inside Llama-3.2-1B's prefill steps, whose e2e then
# ran slower (not explained: another lease, no
# same-run control)
CONFIGS = {64: (64, 64, 4, 3, False), 128: (128, 128, 8, 3, True), 256: (64, 32, 4, 2, False)}
# what bench_extend_long.py sweeps (at any --dim; a failing tile is recorded, not picked)
CANDIDATES = [
    (128, 64, 4, 3, False),
    (128, 128, 8, 3, False),
    (128, 64, 4, 3, True),
    (128, 64, 4, 4, True),
    (128, 128, 8, 3, True),
    (128, 128, 8, 2, True),
    (64, 64, 4, 3, False),  # short prompts: more programs, less of the diagonal masked
]


@triton.jit
def _fresh_loop(
    qv, m_i, l_i, acc, k, v, desc_k, desc_v, row0, kvh, lo, hi, pos_m, window,
    qk_scale, soft_cap, k_st, k_sh, v_st, v_sh, offs_d, offs_dv,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Keys ``[lo, hi)`` of one request (token ``row0`` is its key 0) into the
    online softmax of one q block; (M,) m_i/l_i and (M, Dv) acc fp32."""
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        if TMA:
            kt = desc_k.load([row0 + start, kvh * D])
            vt = desc_v.load([row0 + start, kvh * DV])
        else:
            rows = (row0 + offs_n).to(tl.int64)
            k_ptr = k + rows[:, None] * k_st + kvh * k_sh + offs_d[None, :]
            v_ptr = v + rows[:, None] * v_st + kvh * v_sh + offs_dv[None, :]
            if MASKED or D != BLOCK_D:
                kt = tl.load(k_ptr, mask=mask_n[:, None] & (offs_d[None, :] < D), other=0.0)
            else:  # every key of the tile is live
                kt = tl.load(k_ptr)
            if MASKED or DV != BLOCK_DV:
                vt = tl.load(v_ptr, mask=mask_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
            else:
                vt = tl.load(v_ptr)
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
def _fresh_kernel(
    q, k, v, desc_k, desc_v, q_indptr, sinks, out, sm_scale, soft_cap, window,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, o_st, o_sh,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_CAP: tl.constexpr,
    NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)  # longest blocks first
    b = tl.program_id(2)
    q_start = tl.load(q_indptr + b)
    q_len = tl.load(q_indptr + b + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # = positions: no prefix
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < q_len
    tok = (q_start + offs_m).to(tl.int64)
    qv = tl.load(
        q + tok[:, None] * q_st + h * q_sh + offs_d[None, :],
        mask=mask_m[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    kvh = h // GROUP
    first_q = mb * BLOCK_M
    end = tl.minimum(first_q + BLOCK_M, q_len)  # one past the block's last key
    diag = first_q // BLOCK_N * BLOCK_N
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    m_i, l_i, acc = _fresh_loop(
        qv, m_i, l_i, acc, k, v, desc_k, desc_v, q_start, kvh, lo, diag, offs_m, window,
        qk_scale, soft_cap, k_st, k_sh, v_st, v_sh, offs_d, offs_dv, D, DV, BLOCK_N,
        False, HAS_WINDOW, HAS_CAP, NUM_STAGES, PRECISION, HAS_WINDOW, TMA, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    m_i, l_i, acc = _fresh_loop(
        qv, m_i, l_i, acc, k, v, desc_k, desc_v, q_start, kvh, diag, end, offs_m, window,
        qk_scale, soft_cap, k_st, k_sh, v_st, v_sh, offs_d, offs_dv, D, DV, BLOCK_N,
        True, HAS_WINDOW, HAS_CAP, 1, PRECISION, True, TMA, BLOCK_D, BLOCK_DV,
    )  # fmt: skip
    res = finish_rows(acc, m_i, l_i, sinks, h, HAS_SINKS)
    tl.store(
        out + tok[:, None] * o_st + h * o_sh + offs_dv[None, :],
        res.to(out.dtype.element_ty),
        mask=mask_m[:, None] & (offs_dv[None, :] < DV),
    )


def _descriptor(x: torch.Tensor, block_n: int):
    rows, heads, dim = x.shape
    return TensorDescriptor(x, [rows, heads * dim], [x.stride(0), 1], [block_n, dim])


def check_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_indptr, sinks) -> None:
    """ValueError unless q / k / v are a fresh step's (T, H*, D) rows, q_indptr
    (B+1,) int32 and sinks None or (Hq,) fp32, all on one device."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3 or x.stride(2) != 1 or x.dtype != q.dtype:
            raise ValueError(
                f"{name} must be 3-D {q.dtype} with unit last stride, got {x.dtype} "
                f"{tuple(x.shape)} {x.stride()}"
            )
    if k.shape[:2] != v.shape[:2] or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"fresh k/v must be (T, H, D) and (T, H, Dv) rows of q's T={q.shape[0]} tokens with "
            f"D={q.shape[2]}, got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})"
        )
    if q_indptr.dtype != torch.int32 or q_indptr.dim() != 1 or q_indptr.shape[0] < 1:
        raise ValueError(
            f"q_indptr must be (B+1,) int32, got {q_indptr.dtype} {tuple(q_indptr.shape)}"
        )
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.dtype != torch.float32):
        raise ValueError(
            f"sinks must be ({q.shape[1]},) fp32, got {sinks.dtype} {tuple(sinks.shape)}"
        )
    check_same_device(q, k, v, q_indptr, sinks)


def extend_attention_fresh(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_indptr: torch.Tensor,
    *,
    max_q_len: int,
    sm_scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    soft_cap: float = 0.0,
    out: torch.Tensor | None = None,
    config: tuple | None = None,
    hopper: bool | None = None,
) -> torch.Tensor:
    """Causal attention of ragged fresh prompts over themselves (no cached prefix).

    q: (T, Hq, D); k: (T, H, D), v: (T, H, Dv) the same tokens' K/V (q's dtype, any
    token and head strides, unit last stride); q_indptr: (B+1,) int32, request b
    owning rows ``q_indptr[b]:q_indptr[b+1]`` at positions 0..q_len-1. window,
    sinks, soft_cap as in ``decode_attention``; max_q_len: host int >= every q
    length. config: ``(block_m, block_n, warps, stages[, tma])``, default
    ``CONFIGS[head_dim]``; a default asking for TMA is used where ``tma_ok`` holds
    for k and v (a host decision from shapes, strides and the device), an explicit
    one must be allowed. hopper: the device runs the Gluon kernel (``extend_hopper.
    runs_on``: the step's ``ExtendPlan`` passes it; None asks ``runs_on`` here,
    for direct callers); there, without a config, where ``extend_hopper.usable``
    holds, the Gluon kernel runs instead (16-bit, D == Dv in (64, 128), no window or
    soft-cap, max_q_len >= ``extend_hopper.MIN_Q_LEN[D]``).
    Returns out (T, Hq, Dv) in q's dtype.
    """
    check_fresh(q, k, v, q_indptr, sinks)
    num_tokens, hq, dim = q.shape
    heads, dim_v = k.shape[1], v.shape[2]
    out = out_buffer(out, (num_tokens, hq, dim_v), q)
    bsz = q_indptr.shape[0] - 1
    if num_tokens == 0 or bsz == 0 or max_q_len <= 0:
        return out
    if hopper is None:
        hopper = extend_hopper.runs_on(q.device)
    if hopper and config is None and extend_hopper.usable(q, k, v, window, soft_cap, max_q_len):
        return extend_hopper.fresh_attention(
            q, k, v, q_indptr, out, max_q_len=max_q_len, sm_scale=sm_scale, sinks=sinks
        )
    block_m, block_n, warps, stages, *rest = config or CONFIGS.get(
        next_pow2(dim), (64, 32, 4, 2, False)
    )
    use_tma = bool(rest and rest[0]) and tma_ok(k) and tma_ok(v)
    if config is not None and bool(rest and rest[0]) and not use_tma:
        raise ValueError(
            f"config {config} asks for TMA, which k {k.stride()} / v {v.stride()} on "
            f"{k.device} do not allow (tma_ok); pass tma=False"
        )
    desc_k, desc_v = (_descriptor(k, block_n), _descriptor(v, block_n)) if use_tma else (k, v)
    _fresh_kernel[(hq, triton.cdiv(max_q_len, block_m), bsz)](
        q, k, v, desc_k, desc_v, q_indptr, sinks if sinks is not None else q, out,
        sm_scale, float(soft_cap), int(window),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        GROUP=hq // heads, D=dim, DV=dim_v, BLOCK_D=next_pow2(dim), BLOCK_DV=next_pow2(dim_v),
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=window > 0, HAS_SINKS=sinks is not None,
        HAS_CAP=soft_cap > 0, NUM_STAGES=stages, PRECISION=dot_precision(q), TMA=use_tma,
        num_warps=warps,
    )  # fmt: skip
    return out
