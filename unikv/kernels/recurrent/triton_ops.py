"""Triton recurrent-state ops (Gated DeltaNet, Mamba-2) in place in the Mamba sub-pool.

The twins of ``unikv/kernels/recurrent/ref.py``, with exactly its signatures. Each op
reads request b's state from ``state[slots[b]]`` (a strided per-layer pool view),
runs the request's new tokens ``q_indptr[b]:q_indptr[b+1]`` through the recurrence
and writes the state back in place; every stride is passed in, offsets are int64.

    decode (max_q_len == 1)  one launch per op; token b belongs to lane b; no
                             gather/scatter, no host sync, no allocation but the
                             output: CUDA-graph safe.
    prefill (max_q_len > 1)  conv: one varlen kernel (``recurrent/conv.py`` holds
                             the conv; re-exported here). GDN / SSD: fla-core's
                             chunked kernels on CUDA (``recurrent_fla``); without
                             fla-core (or on CPU) the fused-recurrent Triton kernels
                             below, looping over time.

State tiles stay in fp32 registers for the whole request: GDN program (b, h, Dv
block) holds S[:, v0:v0+BLOCK_V] (Dk x BLOCK_V); SSD program (b, h, P block) holds
S[p0:p0+BLOCK_P, :] (BLOCK_P x N).

Speculative verify steps (``draft_slots`` (B, k), ``recurrent_ref``'s docstring): the
GDN / SSD programs also store their tile after token j of lane b into slot
``draft_slots[b, j]`` (j < k, j < the lane's tokens - 1), the same tile of another
slot, so no program reads what another writes; the conv writes each draft window in
a launch of its own before the live window's launch overwrites the state both read.
A prefill chunk that reaches a prefix-cache checkpoint (``ckpt_slots`` (B,), issue 41)
has each program store its tile after the checkpoint row (``ckpt_at`` (B,), -1 or
absent: the lane's last) into ``ckpt_slots[b]`` as well (0, the sink, for lanes without
one), and fla-core's scatter writes both in one indexed write (a row inside a lane: two
fla calls, ``fla_prefill``'s docstring): the checkpoint needs no slot copy after the
step.
Such steps never take fla-core's chunked kernels (they keep no per-token state): the
fused-recurrent ones run them (k + 1 tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.recurrent import fla_prefill as recurrent_fla
from unikv.kernels.recurrent.checks import (
    check_ckpt_slots,
    check_draft_slots,
    check_gdn_args,
    check_ssd_args,
)
from unikv.kernels.recurrent.conv import causal_conv1d
from unikv.kernels.runtime.checks import next_pow2
from unikv.kernels.runtime.interpret import patch_interpreter

patch_interpreter()  # tl.range with run-time bounds under TRITON_INTERPRET=1

__all__ = ["causal_conv1d", "gated_delta_rule", "mamba2_ssd"]

GDN_BLOCK_V = 32  # Dv columns of S per GDN program
SSD_BLOCK_P = 32  # P rows of S per SSD program
NUM_WARPS = 4


@triton.jit
def _ckpt_target(sp, slot, s_s, ckpt_slots, ckpt_at, b, start, end, CKPT_AT: tl.constexpr):
    """(pointers, row) of a lane's checkpoint: ``sp`` (its state slot's tile) moved to
    the checkpoint slot ``ckpt_slots[b]`` (0: the sink), and the row after which the
    state is written there: the chunk's last, or with CKPT_AT ``start + ckpt_at[b]``
    (-1: the last)."""
    cslot = tl.load(ckpt_slots + b).to(tl.int64)
    cut = end - 1
    if CKPT_AT:
        at = tl.load(ckpt_at + b).to(tl.int64)
        cut = tl.where(at < 0, end - 1, start + at)
    return sp + (cslot - slot) * s_s, cut


@triton.jit
def _gdn_kernel(
    q, k, v, g, beta, A_log, dt_bias, out, state, slots, q_indptr, draft_slots, ckpt_slots,
    ckpt_at,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, g_st, g_sh, g_sk, b_st, b_sh, o_st, o_sh,
    s_s, s_h, s_k, s_v, d_st, num_draft, scale,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    USE_L2NORM: tl.constexpr, DECODE: tl.constexpr, GATING: tl.constexpr,
    GROUPS: tl.constexpr, PER_CHANNEL: tl.constexpr, DRAFT: tl.constexpr, CKPT: tl.constexpr,
    CKPT_AT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hk = h // GROUPS  # the q/k head value head h reads (GQA)
    if GATING:  # g, beta hold the raw a, b: the gates of recurrent_ref.gdn_gates
        neg_a = -tl.exp(tl.load(A_log + h).to(tl.float32))
        bias = tl.load(dt_bias + h).to(tl.float32)
    if DECODE:  # q_indptr == arange(B + 1): token b is lane b's only token
        start = b
        end = b + 1
    else:
        start = tl.load(q_indptr + b).to(tl.int64)
        end = tl.load(q_indptr + b + 1).to(tl.int64)
    ok = tl.arange(0, BLOCK_K)
    ov = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = ok < DK, ov < DV
    m2 = mk[:, None] & mv[None, :]
    slot = tl.load(slots + b).to(tl.int64)
    sp = state + slot * s_s + h * s_h + ok[:, None] * s_k + ov[None, :] * s_v
    s = tl.load(sp, mask=m2, other=0.0).to(tl.float32)  # (BLOCK_K, BLOCK_V)
    if CKPT:
        cp, cut = _ckpt_target(sp, slot, s_s, ckpt_slots, ckpt_at, b, start, end, CKPT_AT)
    for t in tl.range(start, end):
        qt = tl.load(q + t * q_st + hk * q_sh + ok, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + t * k_st + hk * k_sh + ok, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + t * v_st + h * v_sh + ov, mask=mv, other=0.0).to(tl.float32)
        braw = tl.load(beta + t * b_st + h * b_sh)
        if PER_CHANNEL:  # KDA: a log decay per key channel, given as computed
            gt = tl.load(g + t * g_st + h * g_sh + ok * g_sk, mask=mk, other=0.0)
            gt = gt.to(tl.float32)
            bt = braw.to(tl.float32)
        else:
            gt = tl.load(g + t * g_st + h * g_sh).to(tl.float32)
            if GATING:  # torch's softplus (identity above 20); sigmoid rounded to b's dtype
                x = gt + bias
                gt = neg_a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
                bt = tl.sigmoid(braw.to(tl.float32)).to(braw.dtype).to(tl.float32)
            else:
                bt = braw.to(tl.float32)
        if USE_L2NORM:
            qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=0) + 1e-6)
            kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + 1e-6)
        if PER_CHANNEL:  # KDA: row i of the state decays by exp(g[i])
            s = s * tl.exp(gt)[:, None]
        else:
            s = s * tl.exp(gt)
        delta = (vt - tl.sum(s * kt[:, None], axis=0)) * bt  # (BLOCK_V,)
        s = s + kt[:, None] * delta[None, :]
        o = tl.sum(s * (qt * scale)[:, None], axis=0)
        tl.store(out + t * o_st + h * o_sh + ov, o.to(out.dtype.element_ty), mask=mv)
        if DRAFT:  # the state after token j into its draft slot (speculative verify)
            j = t - start
            keep = (j < end - start - 1) & (j < num_draft)
            dslot = tl.load(draft_slots + b * d_st + j, mask=keep, other=0).to(tl.int64)
            dp = state + dslot * s_s + h * s_h + ok[:, None] * s_k + ov[None, :] * s_v
            tl.store(dp, s.to(state.dtype.element_ty), mask=m2 & keep)
        if CKPT:  # the state after the checkpoint row into its slot too
            tl.store(cp, s.to(state.dtype.element_ty), mask=m2 & (t == cut))
    tl.store(sp, s.to(state.dtype.element_ty), mask=m2 & (end > start))


@triton.jit
def _ssd_kernel(
    x, dt, A, Bm, Cm, D, dt_bias, out, state, slots, q_indptr, draft_slots, ckpt_slots,
    ckpt_at,
    x_st, x_sh, dt_st, dt_sh, b_st, b_sg, c_st, c_sg, o_st, o_sh,
    s_s, s_h, s_p, s_n, d_st, num_draft, dt_lo, dt_hi,
    HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, DECODE: tl.constexpr, DRAFT: tl.constexpr, CKPT: tl.constexpr,
    CKPT_AT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if DECODE:
        start = b
        end = b + 1
    else:
        start = tl.load(q_indptr + b).to(tl.int64)
        end = tl.load(q_indptr + b + 1).to(tl.int64)
    grp = h // HEADS_PER_GROUP
    op = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    on = tl.arange(0, BLOCK_N)
    mp, mn = op < P, on < N
    m2 = mp[:, None] & mn[None, :]
    a = tl.load(A + h).to(tl.float32)
    skip = tl.load(D + h).to(tl.float32)
    bias = tl.load(dt_bias + h).to(tl.float32)
    slot = tl.load(slots + b).to(tl.int64)
    sp = state + slot * s_s + h * s_h + op[:, None] * s_p + on[None, :] * s_n
    s = tl.load(sp, mask=m2, other=0.0).to(tl.float32)  # (BLOCK_P, BLOCK_N)
    if CKPT:
        cp, cut = _ckpt_target(sp, slot, s_s, ckpt_slots, ckpt_at, b, start, end, CKPT_AT)
    for t in tl.range(start, end):
        xt = tl.load(x + t * x_st + h * x_sh + op, mask=mp, other=0.0).to(tl.float32)
        step = tl.load(dt + t * dt_st + h * dt_sh).to(tl.float32) + bias
        if DT_SOFTPLUS:  # torch's softplus: identity above 20
            step = tl.where(step > 20.0, step, tl.log(1.0 + tl.exp(step)))
        step = tl.minimum(tl.maximum(step, dt_lo), dt_hi)
        bt = tl.load(Bm + t * b_st + grp * b_sg + on, mask=mn, other=0.0).to(tl.float32)
        ct = tl.load(Cm + t * c_st + grp * c_sg + on, mask=mn, other=0.0).to(tl.float32)
        s = s * tl.exp(step * a) + (step * xt)[:, None] * bt[None, :]
        y = tl.sum(s * ct[None, :], axis=1) + skip * xt
        tl.store(out + t * o_st + h * o_sh + op, y.to(out.dtype.element_ty), mask=mp)
        if DRAFT:  # the state after token j into its draft slot (speculative verify)
            j = t - start
            keep = (j < end - start - 1) & (j < num_draft)
            dslot = tl.load(draft_slots + b * d_st + j, mask=keep, other=0).to(tl.int64)
            dp = state + dslot * s_s + h * s_h + op[:, None] * s_p + on[None, :] * s_n
            tl.store(dp, s.to(state.dtype.element_ty), mask=m2 & keep)
        if CKPT:  # the state after the checkpoint row into its slot too
            tl.store(cp, s.to(state.dtype.element_ty), mask=m2 & (t == cut))
    tl.store(sp, s.to(state.dtype.element_ty), mask=m2 & (end > start))


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    q_indptr: torch.Tensor,
    *,
    max_q_len: int,
    scale: float,
    use_qk_l2norm: bool,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    draft_slots: torch.Tensor | None = None,
    ckpt_slots: torch.Tensor | None = None,
    chunks: torch.Tensor | None = None,
    ckpt_at: torch.Tensor | None = None,
    ckpt_split: recurrent_fla.CkptSplit | None = None,
) -> torch.Tensor:
    """Gated delta rule over each request's new tokens (see ``recurrent_ref``).

    q, k: (T, Hk, Dk), Hk dividing H; v: (T, H, Dv) (unit stride on the last dim);
    g: (T, H) fp32 log decay, or (T, H, Dk) a log decay per key channel (KDA, without
    ``gating``; never through fla-core); beta: (T, H) (with ``gating`` = (A_log,
    dt_bias): the raw a and b, gated in the kernel); state: (S, H, Dk, Dv) strided pool
    view (fp32); slots: (B,) physical slots; q_indptr: (B+1,); draft_slots: None or
    (B, k) (a verify step: the state after each token j < k but the lane's last into
    slot ``draft_slots[b, j]``); ckpt_slots: None or (B,) (a chunk ending at a
    checkpoint: the final state into slot ``ckpt_slots[b]`` too, 0 the sink); ckpt_at:
    None or (B,) with them (the state after that row of the lane instead, -1 its last:
    a checkpoint inside the chunk); ckpt_split: None or the plan's
    ``fla_prefill.CkptSplit`` of ``ckpt_at`` (fla-core only); chunks:
    None or (NT, 2) int64 fla-core's chunk list of q_indptr (``fla_prefill.
    chunk_indices``, uploaded by the step's plan: no host sync in fla-core; unread by
    the kernels below). Returns (T, H, Dv) in v.dtype.
    """
    check_gdn_args(q, k, v, g, beta, state, slots, q_indptr, max_q_len, gating)
    check_draft_slots(draft_slots, slots)
    check_ckpt_slots(ckpt_slots, slots, ckpt_at)
    per_channel = g.dim() == 3  # KDA (fla-core's chunked GDN takes per-head decay only)
    chunked = max_q_len > 1 and not per_channel and draft_slots is None
    if chunked and recurrent_fla.use_fla(q.device, v.dtype):
        return recurrent_fla.gated_delta_rule(
            q, k, v, g, beta, state, slots, q_indptr, scale=scale, use_qk_l2norm=use_qk_l2norm,
            gating=gating, ckpt_slots=ckpt_slots, chunks=chunks, ckpt_at=ckpt_at,
            ckpt_split=ckpt_split,
        )  # fmt: skip
    heads, dim_k, dim_v = state.shape[1:]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if q.shape[0] == 0 or slots.shape[0] == 0:
        return out
    grid = (slots.shape[0], heads, triton.cdiv(dim_v, GDN_BLOCK_V))
    a_log, dt_bias = gating if gating is not None else (g, g)  # unread without GATING
    draft = draft_slots is not None and max_q_len > 1
    _gdn_kernel[grid](
        q, k, v, g, beta, a_log, dt_bias, out, state, slots, q_indptr,
        draft_slots if draft else slots, ckpt_slots if ckpt_slots is not None else slots,
        ckpt_at if ckpt_at is not None else slots,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *g.stride()[:2],
        g.stride(2) if per_channel else 0, *beta.stride(), *out.stride()[:2], *state.stride(),
        *((draft_slots.stride(0), draft_slots.shape[1]) if draft else (0, 0)), float(scale),
        DK=dim_k, DV=dim_v, BLOCK_K=next_pow2(dim_k), BLOCK_V=min(GDN_BLOCK_V, next_pow2(dim_v)),
        USE_L2NORM=bool(use_qk_l2norm), DECODE=max_q_len == 1, GATING=gating is not None,
        GROUPS=heads // q.shape[1], PER_CHANNEL=per_channel, DRAFT=draft,
        CKPT=ckpt_slots is not None, CKPT_AT=ckpt_slots is not None and ckpt_at is not None, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def mamba2_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    q_indptr: torch.Tensor,
    *,
    max_q_len: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    draft_slots: torch.Tensor | None = None,
    ckpt_slots: torch.Tensor | None = None,
    ckpt_at: torch.Tensor | None = None,
    ckpt_split: recurrent_fla.CkptSplit | None = None,
) -> torch.Tensor:
    """Mamba-2 selective scan over each request's new tokens (see ``recurrent_ref``).

    x: (T, H, P); dt: (T, H) raw; A: (H,) fp32 (negative); B, C: (T, G, N) (head h
    reads group h // (H // G)); D, dt_bias: (H,); state: (S, H, P, N) strided pool
    view (fp32); slots: (B,); q_indptr: (B+1,); draft_slots: None or (B, k) (as
    ``gated_delta_rule``); ckpt_slots, ckpt_at, ckpt_split: as ``gated_delta_rule``.
    Returns (T, H, P) in x.dtype.
    """
    check_ssd_args(x, dt, A, B, C, D, dt_bias, state, slots, q_indptr, max_q_len, dt_limit)
    check_draft_slots(draft_slots, slots)
    check_ckpt_slots(ckpt_slots, slots, ckpt_at)
    if max_q_len > 1 and draft_slots is None and recurrent_fla.use_fla(x.device, x.dtype):
        return recurrent_fla.mamba2_ssd(
            x, dt, A, B, C, D, dt_bias, state, slots, q_indptr,
            dt_softplus=dt_softplus, dt_limit=dt_limit, ckpt_slots=ckpt_slots, ckpt_at=ckpt_at,
            ckpt_split=ckpt_split,
        )  # fmt: skip
    heads, dim_p, dim_n = state.shape[1:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or slots.shape[0] == 0:
        return out
    grid = (slots.shape[0], heads, triton.cdiv(dim_p, SSD_BLOCK_P))
    draft = draft_slots is not None and max_q_len > 1
    _ssd_kernel[grid](
        x, dt, A, B, C, D, dt_bias, out, state, slots, q_indptr,
        draft_slots if draft else slots, ckpt_slots if ckpt_slots is not None else slots,
        ckpt_at if ckpt_at is not None else slots,
        *x.stride()[:2], *dt.stride(), *B.stride()[:2], *C.stride()[:2], *out.stride()[:2],
        *state.stride(), *((draft_slots.stride(0), draft_slots.shape[1]) if draft else (0, 0)),
        float(dt_limit[0]), float(dt_limit[1]),
        HEADS_PER_GROUP=heads // B.shape[1], P=dim_p, N=dim_n,
        BLOCK_P=min(SSD_BLOCK_P, next_pow2(dim_p)), BLOCK_N=next_pow2(dim_n),
        DT_SOFTPLUS=bool(dt_softplus), DECODE=max_q_len == 1, DRAFT=draft,
        CKPT=ckpt_slots is not None, CKPT_AT=ckpt_slots is not None and ckpt_at is not None, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
