"""The fused MoE's MXFP4 path for Hopper, in Gluon: weights decoded in registers.

``moe_triton``'s kernels decode each weight tile into shared memory for wgmma's B
operand; at 256 tokens that ran at 20 % of the packed bytes' roofline, the decode, the
shared-memory round trip and the MMA taking turns. Here the product is transposed (the
weight features are wgmma's 64-row A operand, an expert's tokens its N) and the A
operand is built in registers: each thread loads the 16 bytes its A fragment needs (the
weights re-packed at load time, ``mxfp4_frag``), decodes them in place (inline PTX, two
bf16 per byte) and hands them to wgmma. The activation tiles, fragments and scale words
come through a cp.async ring in shared memory.

    gate_up  grid (blocks of BLOCK_T sorted rows, I / F)   -> act (rows, I) x.dtype
             gate and up tiles of F = 16 num_warps features (rows [gate | up],
             ``gate_up_row_order``) + b1, the activation, stored at the sorted rows
    down     grid (blocks, d / F)                          -> y (M, d) fp32
             (A + b2) times the routing weight at the assignment's row

Per K block of 64: the low nibbles hold k0 .. k0 + 31 (one scale group), the high
nibbles k0 + 32 .. k0 + 63, so the two decoded halves are dotted with contiguous
activation columns. A block whose second half is padding can run half the rows
(``HALF``). ``moe`` picks the tiles from ``TABLE``; ``usable`` says where this path
runs. Gluon runs only on a GPU (no interpreter): the CPU tests cover the packing
(``mxfp4_frag``) and the sm_90a compile (``benchmarks/aot_sm90.py --hopper``), the GPU
tests this file against the dequantised reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from unikv.kernels.moe.fused import align_by_expert, bucket
from unikv.kernels.moe.mxfp4_frag import gate_up_row_order, pack_fragments


def _pair(select: str, lo: str, hi: str, scale_lo: str, scale_hi: str, one_mul: bool) -> str:
    """Two bytes of $4 (prmt ``select`` puts them in the low bytes of two 16-bit lanes)
    -> bf16x2 of their low nibbles times ``scale_lo`` and of their high nibbles times
    ``scale_hi``. A code's bits placed as bf16's sign / lowest exponent / top mantissa
    bits are its value times 2^-126 (code 1, 0.5, the subnormal 2^-127); times 2^126,
    then the scale, is exact for any scale; ``one_mul``: one multiply by the scale times
    2^126, the scales' bf16 holding it (e8m0 exponents <= 128)."""
    mul = "" if one_mul else "fma.rn.bf16x2 t, t, big, nz;\n"
    return f"""
prmt.b32 p, $4, 0, {select};
shl.b32 t, p, 6;
shl.b32 u, p, 12;
or.b32 t, t, u;
and.b32 t, t, 0x81C081C0;
{mul}fma.rn.bf16x2 {lo}, t, {scale_lo}, nz;
shl.b32 t, p, 2;
shl.b32 u, p, 8;
and.b32 t, t, 0x01C001C0;
and.b32 u, u, 0x80008000;
or.b32 t, t, u;
{mul}fma.rn.bf16x2 {hi}, t, {scale_hi}, nz;"""


def _decode_asm(one_mul: bool) -> str:
    """Four bytes ($4: bytes 0, 1 of one row, 2, 3 of the row 8 below) -> low-nibble
    pairs $0 (bytes 0, 1) and $1 (2, 3), high-nibble pairs $2, $3. Scales (bf16x2; each
    input is broadcast over the pack, so its first operand): $5 (row, group 0), $9 (row,
    group 1), $13 (row + 8, group 0), $17 (row + 8, group 1)."""
    return (
        "{\n.reg .b32 p, t, u, big, nz;\nmov.b32 big, 0x7E807E80;\nmov.b32 nz, 0x80008000;"
        + _pair("0x4140", "$0", "$2", "$5", "$9", one_mul)
        + _pair("0x4342", "$1", "$3", "$13", "$17", one_mul)
        + "\n}"
    )


def _scales_asm(one_mul: bool) -> str:
    """One scale word (four e8m0 bytes e) -> four bf16x2 scales: 2^(e - 127) (e = 0 the
    subnormal 2^-127), or with ``one_mul`` 2^(e - 1) (exponent field e + 126)."""
    fix = "add.u32 t, t, 0x007E007E;\nshl.b32 ${q}, t, 7;\n" if one_mul else (
        "shl.b32 t, t, 7;\nmax.u16x2 ${q}, t, m;\n"
    )  # fmt: skip
    body = "".join(f"prmt.b32 t, $4, 0, 0x4{q}4{q};\n" + fix.format(q=q) for q in range(4))
    return "{\n.reg .b32 t, m;\nmov.b32 m, 0x00400040;\n" + body + "}"


_DECODE = gl.constexpr(_decode_asm(False))
_DECODE_ONE = gl.constexpr(_decode_asm(True))
_SCALES = gl.constexpr(_scales_asm(False))
_SCALES_ONE = gl.constexpr(_scales_asm(True))
ONE_MUL_MAX_SCALE = 128  # e8m0 exponents up to this: the scale times 2^126 fits bf16


@gluon.jit
def _act(g, u, ACT: gl.constexpr, alpha, limit):
    """The gated activation on fp32 tiles: 0 silu(g) * u, 1 gpt-oss's clamped
    (u + 1) * g * sigmoid(alpha g)."""
    if ACT == 0:
        out = g / (1.0 + gl.exp(-g)) * u
    else:
        gc = gl.minimum(g, limit)
        uc = gl.minimum(gl.maximum(u, -limit), limit)
        out = (uc + 1.0) * (gc / (1.0 + gl.exp(-alpha * gc)))
    return out


@gluon.jit
def _frag_offsets(BL: gl.constexpr, SLABS: gl.constexpr):
    """(SLABS, 32, 16) byte offsets of one K block's fragments (slab stride 1: the
    caller scales it) and the (SLABS, 32) lane-quad index of the scale words."""
    s = gl.arange(0, SLABS, layout=gl.SliceLayout(1, gl.SliceLayout(2, BL)))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, BL)))
    i = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, BL)))
    s3 = gl.expand_dims(gl.expand_dims(s, 1), 2)
    l3 = gl.expand_dims(gl.expand_dims(lane, 0), 2)
    i3 = gl.expand_dims(gl.expand_dims(i, 0), 1)
    return s3, l3 * 16 + i3, gl.expand_dims(s, 1), gl.expand_dims(lane, 0) // 4


@gluon.jit
def _decode_frag(byte, word, BL: gl.constexpr, DOT: gl.constexpr, F: gl.constexpr,
                 ONE_MUL: gl.constexpr):  # fmt: skip
    """Fragment bytes (SLABS, 32, 16) and their scale words (SLABS, 32, 1) -> the A
    operands (F, 32) of the block's low and high halves, in wgmma's register layout."""
    if ONE_MUL:
        scales_asm: gl.constexpr = _SCALES_ONE
        decode_asm: gl.constexpr = _DECODE_ONE
    else:
        scales_asm: gl.constexpr = _SCALES
        decode_asm: gl.constexpr = _DECODE
    sa, sb, sc, sd = gl.inline_asm_elementwise(
        scales_asm, "=r,=r,=r,=r,r", [word],
        dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True, pack=1,
    )  # fmt: skip
    sa, sb = gl.broadcast(sa, byte)[0], gl.broadcast(sb, byte)[0]
    sc, sd = gl.broadcast(sc, byte)[0], gl.broadcast(sd, byte)[0]
    lo, hi = gl.inline_asm_elementwise(
        decode_asm, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r", [byte, sa, sb, sc, sd],
        dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4,
    )  # fmt: skip
    return _to_dot(lo, DOT, F), _to_dot(hi, DOT, F)


@gluon.jit
def _to_dot(v, DOT: gl.constexpr, F: gl.constexpr):
    """(SLABS, 32 lanes, 16 bytes) -> (F rows, 32 k'): row = 16 s + 8 i1 + lq, k' =
    i0 + 2 lr + 8 i2 + 16 i3 (lane = 4 lq + lr, byte = i0 + 2 i1 + 4 i2 + 8 i3): the
    same registers, so the layout change is free."""
    v = gl.reshape(v, [F // 16, 8, 4, 2, 2, 2, 2])  # s, lq, lr, i3, i2, i1, i0
    v = gl.permute(v, [0, 5, 1, 3, 4, 2, 6])  # s, i1, lq, i3, i2, lr, i0
    v = gl.reshape(v, [F, 32])
    return gl.convert_layout(v, DOT, assert_trivial=True)


@gluon.jit
def _issue(x_rows, valid, w_tiles, s_tiles, slab_ok, kb, K, s_xk, xlo, xhi, ws, ss, stage,
           NW: gl.constexpr, XL: gl.constexpr):  # fmt: skip
    """Start K block kb's copies into ring stage ``stage``: the two activation halves
    (BLOCK_T, 32), and for each of the NW weight tiles its fragments and scale words
    (each tile its own buffers: the barrier analysis sees them apart; slabs past the
    matrix, ``slab_ok`` false, are zero-filled)."""
    ks = kb * 64 + gl.arange(0, 32, layout=gl.SliceLayout(0, XL))
    mask = gl.expand_dims(valid, 1) & gl.expand_dims(ks < K, 0)
    x_ptrs = x_rows + gl.expand_dims(ks, 0) * s_xk
    async_copy.async_copy_global_to_shared(xlo.index(stage), x_ptrs, mask=mask)
    async_copy.async_copy_global_to_shared(xhi.index(stage), x_ptrs + 32 * s_xk, mask=mask)
    kw = gl.minimum(kb, K // 64 - 1)  # past K: zero activations, the last block's weights
    for t in gl.static_range(NW):
        async_copy.async_copy_global_to_shared(ws[t].index(stage), w_tiles[t] + kw * 512,
                                               mask=gl.expand_dims(slab_ok, 2))  # fmt: skip
        async_copy.async_copy_global_to_shared(ss[t].index(stage), s_tiles[t] + kw * 8,
                                               mask=slab_ok)  # fmt: skip
    async_copy.commit_group()


@gluon.jit
def _decode_stage(ws, ss, stage, NW: gl.constexpr, F: gl.constexpr, BL: gl.constexpr,
                  DOT: gl.constexpr, ONE_MUL: gl.constexpr):  # fmt: skip
    """Ring stage ``stage``'s weight tiles (F rows each) decoded: (lo, hi) of tile 0
    and of tile 1 (tile 0 again when NW == 1)."""
    byte = ws[0].index(stage).load(BL)
    word = gl.expand_dims(ss[0].index(stage).load(gl.SliceLayout(2, BL)), 2)
    a_lo, a_hi = _decode_frag(byte, word, BL, DOT, F, ONE_MUL)
    c_lo, c_hi = a_lo, a_hi
    if NW == 2:
        byte = ws[1].index(stage).load(BL)
        word = gl.expand_dims(ss[1].index(stage).load(gl.SliceLayout(2, BL)), 2)
        c_lo, c_hi = _decode_frag(byte, word, BL, DOT, F, ONE_MUL)
    return a_lo, a_hi, c_lo, c_hi


@gluon.jit
def _k_loop(x_rows, valid, w_tiles, s_tiles, slab_ok, K, KB, s_xk, acc0,
            NW: gl.constexpr, STAGES: gl.constexpr, BLOCK_T: gl.constexpr, F: gl.constexpr,
            BL: gl.constexpr, DOT: gl.constexpr, XL: gl.constexpr, SMEM: gl.constexpr,
            ONE_MUL: gl.constexpr):  # fmt: skip
    """NW accumulators W_t @ x^T (F rows each) over every K block: a ring of STAGES
    buffers, the copies STAGES - 1 blocks ahead."""
    AHEAD: gl.constexpr = STAGES - 1
    SLABS: gl.constexpr = F // 16
    xlo = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, 32], SMEM)
    xhi = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, 32], SMEM)
    plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ws = (gl.allocate_shared_memory(gl.uint8, [STAGES, SLABS, 32, 16], plain3),)
    ss = (gl.allocate_shared_memory(gl.int32, [STAGES, SLABS, 32], plain2),)
    if NW == 2:
        ws = ws + (gl.allocate_shared_memory(gl.uint8, [STAGES, SLABS, 32, 16], plain3),)
        ss = ss + (gl.allocate_shared_memory(gl.int32, [STAGES, SLABS, 32], plain2),)
    for st in gl.static_range(AHEAD):
        _issue(x_rows, valid, w_tiles, s_tiles, slab_ok, gl.minimum(st, KB - 1), K, s_xk, xlo,
               xhi, ws, ss, st, NW, XL)  # fmt: skip
    acc_a, acc_b = acc0, acc0
    for kb in range(KB):
        stage = kb % STAGES
        async_copy.wait_group(AHEAD - 1)  # this thread's copies of block kb are in
        # everyone's are, and every warp is past block kb - 1: its stage is free
        gl.thread_barrier()
        fence_async_shared()  # the copies, seen by wgmma (the async proxy)
        nxt = gl.minimum(kb + AHEAD, KB - 1)  # past the end: the last block again
        _issue(x_rows, valid, w_tiles, s_tiles, slab_ok, nxt, K, s_xk, xlo, xhi, ws, ss,
               (kb + AHEAD) % STAGES, NW, XL)  # fmt: skip
        b_lo = xlo.index(stage).permute((1, 0))
        b_hi = xhi.index(stage).permute((1, 0))
        a_lo, a_hi, c_lo, c_hi = _decode_stage(ws, ss, stage, NW, F, BL, DOT, ONE_MUL)
        if NW == 2:
            acc_a = warpgroup_mma(a_lo, b_lo, acc_a, is_async=True)
            acc_a = warpgroup_mma(a_hi, b_hi, acc_a, is_async=True)
            acc_b = warpgroup_mma(c_lo, b_lo, acc_b, is_async=True)
            acc_b = warpgroup_mma(c_hi, b_hi, acc_b, is_async=True)
            # all four done before anything else runs: their register operands are live
            # up to here (loop-carried copies would not keep the registers wgmma reads)
            acc_a, acc_b, _, _, _, _ = warpgroup_mma_wait(
                num_outstanding=0, deps=(acc_a, acc_b, a_lo, a_hi, c_lo, c_hi)
            )
        else:
            acc_a = warpgroup_mma(a_lo, b_lo, acc_a, is_async=True)
            acc_a = warpgroup_mma(a_hi, b_hi, acc_a, is_async=True)
            acc_a, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, a_lo, a_hi))
    async_copy.wait_group(0)
    return acc_a, acc_b


@gluon.jit
def _runs_half(sorted_ids_ptr, row0, num_assign, BLOCK_T: gl.constexpr):
    """Whether the block's second half is padding (an expert's rows come first in its
    block): with HALF it then runs BLOCK_T / 2 rows, half the MMA. Callers test
    ``HALF and _runs_half(...)``, so without HALF the half-block branch is not
    compiled (a call's result is a run-time value: ``if _runs_half(..., HALF)`` built
    both branches, and 16-row tiles then failed to compile an 8-row half)."""
    return gl.load(sorted_ids_ptr + row0 + BLOCK_T // 2) >= num_assign


@gluon.jit
def _gate_up_block(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, sorted_ids_ptr, expert, row0, pid_n,
                   num_assign, top_k, K, I, KB, s_xm, s_xk, s_be, s_bn, s_om, s_on,
                   row_step, up_offset, alpha, limit, ACT: gl.constexpr,
                   HAS_BIAS: gl.constexpr, T: gl.constexpr, F: gl.constexpr,
                   STAGES: gl.constexpr, BL: gl.constexpr, DOT: gl.constexpr,
                   MMA: gl.constexpr, XL: gl.constexpr, SMEM: gl.constexpr,
                   ONE_MUL: gl.constexpr):  # fmt: skip
    """T sorted rows from row0 of one expert, F intermediate features: gate and up,
    the activation, stored at the sorted rows."""
    rows_x = gl.arange(0, T, layout=gl.SliceLayout(1, XL))
    assign_x = gl.load(sorted_ids_ptr + row0 + rows_x)
    valid_x = assign_x < num_assign
    x_rows = x_ptr + gl.expand_dims((assign_x // top_k).to(gl.int64) * s_xm, 1)
    # fragments: the gate slabs of features 64 pid_n .., the up slabs I rows below
    s3, off3, s2, quad = _frag_offsets(BL, F // 16)
    slab_ok = pid_n * F + 16 * s2 < I  # (F / 16, 1): the last tile may pass I
    gate_slab = expert.to(gl.int64) * (I // 8) + pid_n * (F // 16)  # 2I rows, slabs of 16
    up_slab = gate_slab + I // 16
    w_tiles = (w_ptr + (gate_slab + s3) * KB * 512 + off3, w_ptr + (up_slab + s3) * KB * 512 + off3)
    s_tiles = (s_ptr + (gate_slab + s2) * KB * 8 + quad, s_ptr + (up_slab + s2) * KB * 8 + quad)
    acc0 = gl.zeros([F, T], gl.float32, MMA)
    acc_g, acc_u = _k_loop(x_rows, valid_x, w_tiles, s_tiles, slab_ok, K, KB, s_xk, acc0, 2,
                           STAGES, T, F, BL, DOT, XL, SMEM, ONE_MUL)  # fmt: skip
    feats = pid_n * F + gl.arange(0, F, layout=gl.SliceLayout(1, MMA))
    f_ok = feats < I
    if HAS_BIAS:
        b_base = b_ptr + expert.to(gl.int64) * s_be
        bg = gl.load(b_base + feats * row_step * s_bn, mask=f_ok, other=0.0)
        bu = gl.load(b_base + (feats * row_step + up_offset) * s_bn, mask=f_ok, other=0.0)
        acc_g += gl.expand_dims(bg.to(gl.float32), 1)
        acc_u += gl.expand_dims(bu.to(gl.float32), 1)
    out = _act(acc_g, acc_u, ACT, alpha, limit)
    pos = row0 + gl.arange(0, T, layout=gl.SliceLayout(0, MMA))
    assign = gl.load(sorted_ids_ptr + pos)
    mask = gl.expand_dims(f_ok, 1) & gl.expand_dims(assign < num_assign, 0)
    dst = out_ptr + gl.expand_dims(pos.to(gl.int64) * s_om, 0) + gl.expand_dims(feats * s_on, 1)
    gl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit(do_not_specialize=["num_assign"])
def gate_up_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr,
    num_assign, top_k, K, I, KB, s_xm, s_xk, s_be, s_bn, s_om, s_on,
    row_step, up_offset, alpha, limit,
    ACT: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_T: gl.constexpr, STAGES: gl.constexpr,
    BL: gl.constexpr, DOT: gl.constexpr, MMA: gl.constexpr, XL: gl.constexpr,
    SMEM: gl.constexpr, ONE_MUL: gl.constexpr, HALF: gl.constexpr, DOT_H: gl.constexpr,
    MMA_H: gl.constexpr, F: gl.constexpr,
):  # fmt: skip
    pid_m, pid_n = gl.program_id(0), gl.program_id(1)
    expert = gl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    row0 = pid_m * BLOCK_T
    args = (x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, sorted_ids_ptr, expert, row0, pid_n,
            num_assign, top_k, K, I, KB, s_xm, s_xk, s_be, s_bn, s_om, s_on, row_step,
            up_offset, alpha, limit)  # fmt: skip
    if HALF and _runs_half(sorted_ids_ptr, row0, num_assign, BLOCK_T):
        _gate_up_block(*args, ACT, HAS_BIAS, BLOCK_T // 2, F, STAGES, BL, DOT_H, MMA_H, XL,
                       SMEM, ONE_MUL)  # fmt: skip
    else:
        _gate_up_block(*args, ACT, HAS_BIAS, BLOCK_T, F, STAGES, BL, DOT, MMA, XL, SMEM,
                       ONE_MUL)  # fmt: skip


@gluon.jit
def _down_block(a_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ids_ptr, expert, row0,
                pid_n, num_assign, N, K, KB, s_am, s_ak, s_be, s_bn, s_ym, s_yn,
                HAS_BIAS: gl.constexpr, T: gl.constexpr, F: gl.constexpr,
                STAGES: gl.constexpr, BL: gl.constexpr, DOT: gl.constexpr, MMA: gl.constexpr,
                XL: gl.constexpr, SMEM: gl.constexpr, ONE_MUL: gl.constexpr):  # fmt: skip
    """T sorted rows from row0 of one expert, F output features: the down projection
    (+ b2) times the routing weight, at each assignment's row of y."""
    rows_x = row0 + gl.arange(0, T, layout=gl.SliceLayout(1, XL))
    valid_x = gl.load(sorted_ids_ptr + rows_x) < num_assign
    a_rows = a_ptr + gl.expand_dims(rows_x.to(gl.int64) * s_am, 1)
    s3, off3, s2, quad = _frag_offsets(BL, F // 16)
    slab_ok = pid_n * F + 16 * s2 < N
    slab = expert.to(gl.int64) * (N // 16) + pid_n * (F // 16)
    w_tiles = (w_ptr + (slab + s3) * KB * 512 + off3,)
    s_tiles = (s_ptr + (slab + s2) * KB * 8 + quad,)
    acc0 = gl.zeros([F, T], gl.float32, MMA)
    acc, _ = _k_loop(a_rows, valid_x, w_tiles, s_tiles, slab_ok, K, KB, s_ak, acc0, 1, STAGES,
                     T, F, BL, DOT, XL, SMEM, ONE_MUL)  # fmt: skip
    feats = pid_n * F + gl.arange(0, F, layout=gl.SliceLayout(1, MMA))
    f_ok = feats < N
    if HAS_BIAS:
        bias = gl.load(b_ptr + expert.to(gl.int64) * s_be + feats * s_bn, mask=f_ok, other=0.0)
        acc += gl.expand_dims(bias.to(gl.float32), 1)
    pos = row0 + gl.arange(0, T, layout=gl.SliceLayout(0, MMA))
    assign = gl.load(sorted_ids_ptr + pos)
    ok = assign < num_assign
    weight = gl.load(tw_ptr + assign, mask=ok, other=0.0).to(gl.float32)
    dst = y_ptr + gl.expand_dims(assign.to(gl.int64) * s_ym, 0) + gl.expand_dims(feats * s_yn, 1)
    mask = gl.expand_dims(f_ok, 1) & gl.expand_dims(ok, 0)
    gl.store(dst, acc * gl.expand_dims(weight, 0), mask=mask)


@gluon.jit(do_not_specialize=["num_assign"])
def down_kernel(
    a_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ids_ptr, block_experts_ptr,
    num_assign, N, K, KB, s_am, s_ak, s_be, s_bn, s_ym, s_yn,
    HAS_BIAS: gl.constexpr, BLOCK_T: gl.constexpr, STAGES: gl.constexpr,
    BL: gl.constexpr, DOT: gl.constexpr, MMA: gl.constexpr, XL: gl.constexpr,
    SMEM: gl.constexpr, ONE_MUL: gl.constexpr, HALF: gl.constexpr, DOT_H: gl.constexpr,
    MMA_H: gl.constexpr, F: gl.constexpr,
):  # fmt: skip
    pid_m, pid_n = gl.program_id(0), gl.program_id(1)
    expert = gl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    row0 = pid_m * BLOCK_T
    args = (a_ptr, w_ptr, s_ptr, b_ptr, tw_ptr, y_ptr, sorted_ids_ptr, expert, row0, pid_n,
            num_assign, N, K, KB, s_am, s_ak, s_be, s_bn, s_ym, s_yn)  # fmt: skip
    if HALF and _runs_half(sorted_ids_ptr, row0, num_assign, BLOCK_T):
        _down_block(*args, HAS_BIAS, BLOCK_T // 2, F, STAGES, BL, DOT_H, MMA_H, XL, SMEM,
                    ONE_MUL)  # fmt: skip
    else:
        _down_block(*args, HAS_BIAS, BLOCK_T, F, STAGES, BL, DOT, MMA, XL, SMEM, ONE_MUL)


@functools.cache  # built once per tile shape, not per call
def layouts(block_t: int, warps: int = 4) -> dict:
    """The kernels' layout constexprs for BLOCK_T tokens a block and ``warps`` warps (a
    slab of 16 feature rows each: F = 16 warps features a program); shared, not to be
    mutated."""
    frag = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0], [0, 16, 0]],
        warp_bases=[[1 << w, 0, 0] for w in range(warps.bit_length() - 1)],
        block_bases=[],
        shape=[warps, 32, 16],
    )
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                    instr_shape=[16, block_t, 16])  # fmt: skip
    half = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                     instr_shape=[16, max(block_t // 2, 8), 16])  # fmt: skip
    return {
        "MMA_H": half,
        "DOT_H": gl.DotOperandLayout(operand_index=0, parent=half, k_width=2),
        "BL": frag,
        "DOT": gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        "MMA": mma,
        "XL": gl.BlockedLayout([1, 8], [8, 4], [warps, 1], [1, 0]),
        "F": 16 * warps,
        "SMEM": gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2),
    }


def fused_moe_hopper(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    frags: Mxfp4Fragments,
    *,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    gate_up: str = "concat",
    alpha: float = 1.702,
    limit: float = 7.0,
    block_t: int = 64,
    stages: int = 4,
    one_mul: bool | None = None,
    half: bool = False,
    warps: int = 4,
) -> torch.Tensor:
    """``moe.fused_moe`` for MXFP4 experts re-packed by ``pack_experts`` (16-bit x only):
    x (T, d), topk_weights / topk_ids (T, k) -> (T, d) in x.dtype."""
    t, d = x.shape
    top_k = topk_ids.shape[1]
    m = topk_ids.numel()
    inter = frags.inter
    check_args(x, topk_weights, topk_ids, frags, activation)
    if m == 0:
        return torch.zeros_like(x)
    sorted_ids, block_experts = align_by_expert(topk_ids, frags.num_experts, block_t)
    rows = sorted_ids.shape[0]
    one_mul = frags.one_mul if one_mul is None else one_mul
    lay = {**layouts(block_t, warps), "ONE_MUL": one_mul, "HALF": bool(half) and block_t >= 16}
    f = lay["F"]
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    bias1 = b1 if b1 is not None else x
    interleaved = gate_up == "interleaved"
    row_step, up_offset = (2, 1) if interleaved else (1, inter)
    grid = (block_experts.shape[0], triton.cdiv(inter, f))
    gate_up_kernel[grid](
        x, frags.w1, frags.s1, bias1, act, sorted_ids, block_experts,
        m, top_k, d, inter, d // 64, *x.stride(), bias1.stride(0), bias1.stride(-1),
        *act.stride(), row_step, up_offset, float(alpha), float(limit),
        ACT=0 if activation == "silu" else 1, HAS_BIAS=b1 is not None, BLOCK_T=block_t,
        STAGES=stages, num_warps=warps, **lay,
    )  # fmt: skip
    y = torch.empty(m, d, dtype=torch.float32, device=x.device)
    bias2 = b2 if b2 is not None else x
    down_kernel[(block_experts.shape[0], triton.cdiv(d, f))](
        act, frags.w2, frags.s2, bias2, topk_weights.reshape(-1), y, sorted_ids, block_experts,
        m, d, inter, inter // 64, *act.stride(), bias2.stride(0), bias2.stride(-1), *y.stride(),
        HAS_BIAS=b2 is not None, BLOCK_T=block_t, STAGES=stages, num_warps=warps, **lay,
    )  # fmt: skip
    return y.view(t, top_k, d).sum(1).to(x.dtype)


def check_args(x, topk_weights, topk_ids, frags: Mxfp4Fragments, activation: str) -> None:
    """ValueError unless x is bf16 (T, d) with d the experts' hidden size, the routing
    (T, k) pairs and the activation a gated one this path runs."""
    d = frags.w1.shape[2] * 64
    routed = topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != d:
        raise ValueError(
            f"the Hopper MoE takes bf16 activations (T, {d}); got {x.dtype} {tuple(x.shape)}"
        )
    if not routed or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids and topk_weights must both be (T={x.shape[0]}, k); got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    if activation not in ("silu", "gpt_oss"):
        raise ValueError(f"the Hopper MoE runs 'silu' or 'gpt_oss', got {activation!r}")


class Mxfp4Fragments(NamedTuple):
    """An MoE layer's MXFP4 experts in the fragment order (``mxfp4_frag``): gate/up rows
    [gate (I) | up (I)], scales as int32 words."""

    w1: torch.Tensor  # (E, 2I / 16, d / 64, 512) uint8
    s1: torch.Tensor  # (E, 2I / 16, d / 64, 8) int32
    w2: torch.Tensor  # (E, d / 16, I / 64, 512) uint8
    s2: torch.Tensor  # (E, d / 16, I / 64, 8) int32
    one_mul: bool  # every scale exponent <= ONE_MUL_MAX_SCALE: the one-multiply decode

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def inter(self) -> int:
        return self.w1.shape[1] * 8


def pack_experts(w1, s1, w2, s2, gate_up: str) -> Mxfp4Fragments:
    """Checkpoint MXFP4 experts (``moe_ref``'s layouts) -> ``Mxfp4Fragments``."""
    order = gate_up_row_order(w1.shape[1], gate_up == "interleaved", w1.device)
    f1, g1 = pack_fragments(w1, s1, order)
    f2, g2 = pack_fragments(w2, s2)
    one_mul = max(int(s1.max()), int(s2.max())) <= ONE_MUL_MAX_SCALE  # once, at load
    return Mxfp4Fragments(f1, g1.view(torch.int32), f2, g2.view(torch.int32), one_mul)


# (block_t, stages, half, warps) per ``moe.BUCKETS`` bucket of T, bf16 MXFP4 experts at
# gpt-oss's shape on the H200 (``benchmarks/bench_moe_hopper.py``; the README's MXFP4
# section); half: blocks half padding run half the rows
TABLE = {1: (32, 4, True, 4), 8: (32, 4, True, 4), 16: (32, 4, True, 4), 64: (32, 4, True, 4),
         256: (64, 4, True, 4), 2048: (128, 3, True, 4), 8192: (128, 3, True, 4)}  # fmt: skip


def usable(dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether this path runs experts of that shape for a model of ``dtype``, on a
    device where it runs at all (sm_90 with ``UNIKV_MOE_HOPPER`` not "0": decided once,
    by ``get_backend``, whose ``moe_repacked`` asks this): bf16 activations (wgmma's
    operands share a type), hidden and intermediate sizes in whole K blocks of 64."""
    return dtype == torch.bfloat16 and hidden % 64 == 0 and inter % 64 == 0


def repack_in_place(w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                    gate_up: str) -> Mxfp4Fragments:  # fmt: skip
    """Re-pack a layer's MXFP4 experts, as the checkpoint stores them (uint8 blocks w1
    (E, 2I, d / 32, 16), scales s1 (E, 2I, d / 32), w2 / s2 likewise), in place into
    this kernel's order (``pack_experts``: same bytes, one pass, one layer's copy at a
    time); returns the fragments as views of those four tensors, which then hold that
    order and only this kernel reads."""
    frags = pack_experts(w1, s1, w2, s2, gate_up)
    with torch.no_grad():
        for param, packed in zip((w1, s1, w2, s2), frags[:4], strict=True):
            param.copy_(packed.view(torch.uint8).reshape(param.shape))
    return Mxfp4Fragments(
        w1.view(frags.w1.shape),
        s1.view(frags.s1.shape[:-1] + (32,)).view(torch.int32),
        w2.view(frags.w2.shape),
        s2.view(frags.s2.shape[:-1] + (32,)).view(torch.int32),
        frags.one_mul,
    )


def moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    frags: Mxfp4Fragments,
    *,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    gate_up: str = "concat",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """``fused_moe_hopper`` with the tiles ``TABLE`` gives T = x.shape[0] (host ints);
    the signature is ``kernels/moe/protocols.MoERepackedRun``."""
    block_t, stages, half, warps = TABLE[bucket(x.shape[0])]
    return fused_moe_hopper(x, topk_weights, topk_ids, frags, b1=b1, b2=b2,
                            activation=activation, gate_up=gate_up, alpha=alpha, limit=limit,
                            block_t=block_t, stages=stages, half=half, warps=warps)  # fmt: skip
