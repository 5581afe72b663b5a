"""The depthwise causal conv of the hybrid layers in Triton, over the pool's conv states.

``causal_conv1d`` (re-exported by ``triton_ops``) is ``recurrent_ref.causal_conv1d``'s
twin: request b's last K inputs live in ``conv_state[slots[b]]`` ((C, K) of a strided
per-layer pool view, oldest first); its new tokens ``q_indptr[b]:q_indptr[b+1]`` of x
are convolved, continuing that window, and the window is moved on in place.

Both steps are one pass over their bytes, each byte read once and written once:

    decode (max_q_len == 1)  one launch; program (C block, lane block) holds a
                             (LANES * BLOCK_C, K) tile of window rows: it reads the
                             K-1 newest state columns of each row and its new
                             input, writes the output (SiLU fused) and the shifted
                             window (its weights come from L1 after the first
                             lane). Lanes per program are chosen from the batch so
                             the grid fills the GPU at small B and moves larger
                             tiles at large B (``decode_config``).
    prefill (max_q_len > 1)  one launch (plus one, before it, on speculative verify
                             steps: the draft windows, which read the live state);
                             program (C block, chunk of CHUNK_T tokens, request)
                             walks its chunk in BLOCK_T-token tiles (the K taps of a
                             tile re-read the K-1 rows before it from L1, not DRAM).
                             The request's first chunk is the only program that
                             reads the initial state: it computes the request's
                             first K-1 outputs (the tiles skip them, so the loop
                             reads x only) and writes the final state after a
                             barrier: no second launch.

A prefill chunk ending at a prefix-cache checkpoint (``ckpt_slots`` (B,), issue 41):
the first-chunk program stores the final window (``ckpt_at``: the window ending at that
row of the lane, a checkpoint inside the chunk) into ``ckpt_slots[b]`` as well (0, the
sink, without one), so the checkpoint needs no slot copy; a decode-shaped step
(every lane one token) copies the written windows there by index after the launch.

The conv output's split into q/k/v (Gated DeltaNet) or x/B/C (Mamba-2) is a view of
the one (T, C) output, so there is no copy to fuse. Slot and row offsets are int64
(a prefill tile's offsets int32 from one int64 base, bounded by the launcher); every
stride is passed in; a packed (C, K) window or weight gets constexpr strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.recurrent.checks import check_ckpt_slots, check_conv_args, check_draft_slots
from unikv.kernels.runtime.checks import next_pow2
from unikv.kernels.runtime.interpret import patch_interpreter

patch_interpreter()  # tl.range with run-time bounds under TRITON_INTERPRET=1

# Block sizes: sm_90a register counts (ptxas -v on this host's PTX; K 4, bf16, 4 warps):
# decode 31 / 48 / 72 / 168 registers at 1 / 2 / 4 / 8 lanes of 256 channels (8 lanes
# would hold 3 programs per SM); prefill 96 / 167 at 16 / 32 tokens of 128 channels,
# 255 at 64 (or 256 channels), spilling. The benchmark's sweep times the neighbours.
DECODE_BLOCK_C = 256  # channels per decode program
DECODE_MIN_PROGRAMS = 1024  # lanes per program grow only while the grid keeps this many
DECODE_MAX_LANES = 4
PREFILL_BLOCK_C = 128  # channels per prefill program (256 B rows at bf16)
PREFILL_BLOCK_T = 32  # tokens per tile (K tap loads of a (BLOCK_T, BLOCK_C) tile)
PREFILL_CHUNK_T = 256  # tokens per prefill program (a multiple of BLOCK_T)
STATE_BLOCK_C = 128  # channels per draft-window program (verify steps only)
NUM_WARPS = 4


def decode_config(num_lanes: int, channels: int) -> tuple[int, int]:
    """(BLOCK_C, LANES) of the decode launch: the largest power-of-two lanes per
    program (<= DECODE_MAX_LANES) that still leaves DECODE_MIN_PROGRAMS programs."""
    block_c = min(DECODE_BLOCK_C, next_pow2(channels))
    programs = triton.cdiv(channels, block_c) * num_lanes
    lanes = 1
    while lanes < DECODE_MAX_LANES and programs // (2 * lanes) >= DECODE_MIN_PROGRAMS:
        lanes *= 2
    return block_c, lanes


@triton.jit
def _decode_kernel(
    x, state, slots, w, bias, out,
    x_st, s_s, s_c, s_k, w_c, w_k, o_st, B, C,
    K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, LANES: tl.constexpr,
    PACKED: tl.constexpr, W_PACKED: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    """Program (C block, lane block): lanes [pid1 * LANES, +LANES) at once, as LANES *
    BLOCK_C window rows (lane-major, so neighbouring threads read neighbouring rows)."""
    if PACKED:  # the pool's (C, K) window: constexpr strides, contiguous channel rows
        sc = K
        sk = 1
    else:
        sc = s_c
        sk = s_k
    if W_PACKED:  # a contiguous (C, K) weight: 8-byte rows at K 4, 16-bit
        wc = K
        wk = 1
    else:
        wc = w_c
        wk = w_k
    r = tl.arange(0, LANES * BLOCK_C)
    c = tl.program_id(0) * BLOCK_C + r % BLOCK_C
    lane = tl.program_id(1).to(tl.int64) * LANES + r // BLOCK_C
    k = tl.arange(0, BLOCK_K)[None, :]
    live = (c < C) & (lane < B)
    slot = tl.load(slots + lane, mask=live, other=0).to(tl.int64)  # one address per lane
    row = (state + slot * s_s + c.to(tl.int64) * sc)[:, None]  # (rows, 1) window rows
    wt = tl.load(w + c[:, None] * wc + k * wk, mask=live[:, None] & (k < K),
                 other=0.0).to(tl.float32)  # fmt: skip
    nxt = tl.load(row + (k + 1) * sk, mask=live[:, None] & (k + 1 < K), other=0.0)
    xb = tl.load(x + lane * x_st + c, mask=live, other=0.0).to(tl.float32)
    seq = tl.where(k == K - 1, xb[:, None], nxt.to(tl.float32))  # the new window
    acc = tl.sum(seq * wt, axis=1)
    if HAS_BIAS:
        acc += tl.load(bias + c, mask=live, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out + lane * o_st + c, acc.to(out.dtype.element_ty), mask=live)
    tl.debug_barrier()  # every thread has read the old window before any overwrites it
    tl.store(row + k * sk, seq.to(state.dtype.element_ty), mask=live[:, None] & (k < K))


@triton.jit
def _prefill_kernel(
    x, state, slots, q_indptr, w, bias, out, ckpt_slots, ckpt_at,
    x_st, s_s, s_c, s_k, w_c, w_k, o_st, C,
    K: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr, PACKED: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    EVEN_C: tl.constexpr, CKPT: tl.constexpr, CKPT_AT: tl.constexpr,
):  # fmt: skip
    """Outputs of tokens [pid1 * CHUNK_T, +CHUNK_T) of request pid2, channel block
    pid0; the request's first chunk also writes its final window."""
    if PACKED:
        sc = K
        sk = 1
    else:
        sc = s_c
        sk = s_k
    b = tl.program_id(2)  # channel blocks vary fastest: neighbours read one row span
    start = tl.load(q_indptr + b).to(tl.int64)
    length = tl.load(q_indptr + b + 1).to(tl.int64) - start
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    if EVEN_C:  # no partial channel block: masks only on rows
        mc = tl.full((BLOCK_C,), 1, tl.int1)
    else:
        mc = c < C
    first = tl.program_id(1).to(tl.int64) * CHUNK_T
    slot = tl.load(slots + b).to(tl.int64)
    row = state + slot * s_s + c.to(tl.int64) * sc  # (BLOCK_C,) window rows
    if HAS_BIAS:
        bv = tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)[None, :]
    # the first 4 taps' weights load once, before the tiles (a tap's weights are strided
    # by K, so each load also costs a layout change: once per program, not per tile)
    w0 = tl.load(w + c * w_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    w1, w2, w3 = w0, w0, w0  # unused past K
    if K > 1:
        w1 = tl.load(w + c * w_c + w_k, mask=mc, other=0.0).to(tl.float32)[None, :]
    if K > 2:
        w2 = tl.load(w + c * w_c + 2 * w_k, mask=mc, other=0.0).to(tl.float32)[None, :]
    if K > 3:
        w3 = tl.load(w + c * w_c + 3 * w_k, mask=mc, other=0.0).to(tl.float32)[None, :]
    jt = tl.arange(0, BLOCK_T)
    for t0 in tl.range(first, tl.minimum(first + CHUNK_T, length), BLOCK_T):
        # one int64 base per tile, int32 offsets inside it (the launcher bounds them)
        xt = x + (start + t0) * x_st
        mj = t0 + jt < length  # rows of the request (its last tile is partial)
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for i in tl.static_range(K):  # seq[j + 1 + i] = x_b[j + 1 + i - K] (j >= K - 1)
            rows = jt + (1 + i - K)
            mx = mj & (t0 + rows >= 0)
            xv = tl.load(xt + rows[:, None] * x_st + c[None, :], mask=mx[:, None] & mc[None, :],
                         other=0.0)  # fmt: skip
            if i == 0:
                wi = w0
            elif i == 1:
                wi = w1
            elif i == 2:
                wi = w2
            elif i == 3:
                wi = w3
            else:  # widths past 4: the tap's weights from L1 in the tile
                wi = tl.load(w + c * w_c + i * w_k, mask=mc, other=0.0).to(tl.float32)[None, :]
            acc += xv.to(tl.float32) * wi
        if HAS_BIAS:
            acc += bv
        if SILU:
            acc = acc * tl.sigmoid(acc)
        keep = mj & (t0 + jt >= K - 1)  # rows j < K - 1 read the initial window: below
        dst = out + (start + t0) * o_st + jt[:, None] * o_st + c[None, :]
        tl.store(dst, acc.to(out.dtype.element_ty), mask=keep[:, None] & mc[None, :])
    if first == 0:  # the one reader of the initial window: its rows, then the final window
        j = tl.arange(0, BLOCK_K)  # rows j < K - 1 of the request
        mrow = (j < K - 1) & (j < length)
        acc = tl.zeros((BLOCK_K, BLOCK_C), dtype=tl.float32)
        for i in tl.static_range(K):  # seq[j + 1 + i]: x_b[idx], or window column K + idx
            idx = j + 1 + i - K
            xv = tl.load(x + (start + idx)[:, None] * x_st + c[None, :],
                         mask=(mrow & (idx >= 0))[:, None] & mc[None, :], other=0.0)  # fmt: skip
            sv = tl.load(row[None, :] + (K + idx)[:, None] * sk,
                         mask=(mrow & (idx < 0))[:, None] & mc[None, :], other=0.0)  # fmt: skip
            wi = tl.load(w + c * w_c + i * w_k, mask=mc, other=0.0).to(tl.float32)
            acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wi[None, :]
        if HAS_BIAS:
            acc += bv
        if SILU:
            acc = acc * tl.sigmoid(acc)
        dst = out + start * o_st + j[:, None] * o_st + c[None, :]
        tl.store(dst, acc.to(out.dtype.element_ty), mask=mrow[:, None] & mc[None, :])
        k = tl.arange(0, BLOCK_K)
        idx = length + k  # index into seq = [state (K) | x_b (length)]
        live = mc[:, None] & (k < K)[None, :] & (length > 0)
        xv = tl.load(x + (start + idx - K)[None, :] * x_st + c[:, None],
                     mask=live & (idx >= K)[None, :])  # fmt: skip
        sv = tl.load(row[:, None] + idx[None, :] * sk, mask=live & (idx < K)[None, :])
        new = tl.where((idx >= K)[None, :], xv.to(tl.float32), sv.to(tl.float32))
        if CKPT_AT:  # the window ending at the checkpoint row (-1: the last), read now
            at = tl.load(ckpt_at + b).to(tl.int64)
            cidx = tl.where(at < 0, length - 1, at) + 1 + k
            cx = tl.load(x + (start + cidx - K)[None, :] * x_st + c[:, None],
                         mask=live & (cidx >= K)[None, :])  # fmt: skip
            cs = tl.load(row[:, None] + cidx[None, :] * sk, mask=live & (cidx < K)[None, :])
            cnew = tl.where((cidx >= K)[None, :], cx.to(tl.float32), cs.to(tl.float32))
        else:
            cnew = new
        tl.debug_barrier()  # the old window is read (by every thread) before it is overwritten
        tl.store(row[:, None] + k[None, :] * sk, new.to(state.dtype.element_ty), mask=live)
        if CKPT:  # that window into the lane's checkpoint slot too (0: the sink)
            cslot = tl.load(ckpt_slots + b).to(tl.int64)
            crow = state + cslot * s_s + c.to(tl.int64) * sc
            tl.store(crow[:, None] + k[None, :] * sk, cnew.to(state.dtype.element_ty), mask=live)


@triton.jit
def _draft_windows_kernel(
    x, state, slots, q_indptr, draft_slots, x_st, s_s, s_c, s_k, d_st, C,
    K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (b, C block, j): the window after token j of request b (j < its
    tokens - 1) into slot draft_slots[b, j]; reads the live state only."""
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(q_indptr + b).to(tl.int64)
    length = tl.load(q_indptr + b + 1).to(tl.int64) - start
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, BLOCK_K)
    slot = tl.load(slots + b).to(tl.int64)
    row = state + slot * s_s + c.to(tl.int64)[:, None] * s_c
    j = tl.program_id(2).to(tl.int64)
    ok = j < length - 1
    dst_slot = tl.load(draft_slots + b * d_st + j, mask=ok, other=0).to(tl.int64)
    dst = state + dst_slot * s_s + c.to(tl.int64)[:, None] * s_c
    idx = j + 1 + k  # index into seq = [state (K) | x_b (length)]
    live = (c < C)[:, None] & (k < K)[None, :] & ok
    xv = tl.load(
        x + (start + idx - K)[None, :] * x_st + c[:, None], mask=live & (idx >= K)[None, :]
    )
    sv = tl.load(row + idx[None, :] * s_k, mask=live & (idx < K)[None, :])
    new = tl.where((idx >= K)[None, :], xv.to(tl.float32), sv.to(tl.float32))
    tl.store(dst + k[None, :] * s_k, new.to(state.dtype.element_ty), mask=live)


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    q_indptr: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    max_q_len: int,
    activation: str | None,
    draft_slots: torch.Tensor | None = None,
    config: dict | None = None,
    ckpt_slots: torch.Tensor | None = None,
    ckpt_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv continuing each request's state (see ``recurrent_ref``).

    x: (T, C) model dtype, unit stride on C; conv_state: (S, C, K) strided pool view
    indexed by physical slot; slots: (B,) int32/int64 physical slots (0 = sink);
    q_indptr: (B+1,) int32/int64; weight: (C, K); bias: (C,) or None; activation:
    None or "silu"; draft_slots: None or (B, k) (a verify step: the window after each
    token j < k but the lane's last into slot ``draft_slots[b, j]``); config: None, or
    block sizes overriding the defaults (``block_c``/``lanes`` for decode, ``block_c``/
    ``block_t``/``chunk_t`` for prefill, ``num_warps`` for both: the benchmark's sweep);
    ckpt_slots: None or (B,) (the final window into slot ``ckpt_slots[b]`` too, 0 the
    sink: a chunk ending at a prefix-cache checkpoint); ckpt_at: None or (B,) with
    them (the window ending at that row of the lane instead, -1 its last: a checkpoint
    inside the chunk). Returns (T, C) in x.dtype; conv_state updated in place.
    """
    check_conv_args(x, conv_state, slots, q_indptr, weight, bias, max_q_len, activation)
    check_draft_slots(draft_slots, slots)
    check_ckpt_slots(ckpt_slots, slots, ckpt_at)
    num_lanes, (channels, width) = slots.shape[0], conv_state.shape[1:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or num_lanes == 0:
        return out
    config = config or {}
    s_s, s_c, s_k = conv_state.stride()
    w_c, w_k = weight.stride()
    common = {
        "K": width, "BLOCK_K": next_pow2(width), "HAS_BIAS": bias is not None,
        "PACKED": s_k == 1 and s_c == width, "SILU": activation == "silu",
        "num_warps": config.get("num_warps", NUM_WARPS),
    }  # fmt: skip
    bias_arg = bias if bias is not None else weight  # never read without HAS_BIAS
    if max_q_len == 1:
        block_c, lanes = decode_config(num_lanes, channels)
        block_c, lanes = config.get("block_c", block_c), config.get("lanes", lanes)
        grid = (triton.cdiv(channels, block_c), triton.cdiv(num_lanes, lanes))
        _decode_kernel[grid](
            x, conv_state, slots, weight, bias_arg, out,
            x.stride(0), s_s, s_c, s_k, w_c, w_k, out.stride(0), num_lanes, channels,
            BLOCK_C=block_c, LANES=lanes, W_PACKED=w_k == 1 and w_c == width, **common,
        )  # fmt: skip
        if ckpt_slots is not None:  # (rare: a one-token chunk at a checkpoint) by index
            conv_state[ckpt_slots.long()] = conv_state[slots.long()]
        return out
    if draft_slots is not None:  # every draft window first: they read the live one
        _draft_windows_kernel[(num_lanes, triton.cdiv(channels, STATE_BLOCK_C), draft_slots.shape[1])](
            x, conv_state, slots, q_indptr, draft_slots, x.stride(0), s_s, s_c, s_k,
            draft_slots.stride(0), channels, K=width, BLOCK_C=STATE_BLOCK_C,
            BLOCK_K=next_pow2(width), num_warps=NUM_WARPS,
        )  # fmt: skip
    block_c = config.get("block_c", PREFILL_BLOCK_C)
    block_t = config.get("block_t", PREFILL_BLOCK_T)
    chunk_t = config.get("chunk_t", max(PREFILL_CHUNK_T, block_t))
    assert chunk_t % block_t == 0 and chunk_t >= width, "conv prefill: chunk_t tiles"
    if max(x.stride(0), out.stride(0)) * (block_t + width) >= 2**31:
        raise ValueError(
            f"causal_conv1d: x's row stride {x.stride(0)} is too large for the prefill's "
            f"int32 tile offsets (row stride x {block_t + width} rows must stay below 2**31); "
            "pass x with a smaller row stride (e.g. x.contiguous())"
        )
    grid = (triton.cdiv(channels, block_c), triton.cdiv(max_q_len, chunk_t), num_lanes)
    _prefill_kernel[grid](
        x, conv_state, slots, q_indptr, weight, bias_arg, out,
        ckpt_slots if ckpt_slots is not None else slots,
        ckpt_at if ckpt_at is not None else slots, x.stride(0), s_s, s_c, s_k, w_c, w_k,
        out.stride(0), channels, BLOCK_T=block_t, CHUNK_T=chunk_t, BLOCK_C=block_c,
        EVEN_C=channels % block_c == 0, CKPT=ckpt_slots is not None,
        CKPT_AT=ckpt_slots is not None and ckpt_at is not None, **common,
    )  # fmt: skip
    return out
