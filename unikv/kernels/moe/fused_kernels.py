"""The Triton bodies of the fused MoE (launchers, configs and alignment: ``kernels/moe/fused.py``).

Each program owns BLOCK_M sorted rows of one expert (``block_experts[pid_m]``), BLOCK_N
output features and, with SPLIT_K > 1, one of SPLIT_K slices of the K loop:

    _gate_up_kernel  x rows (gathered by sorted assignment) @ W1[gate | up]^T
                     SPLIT_K == 1: + b1, the activation -> act (rows, I) in x.dtype
                                   (QUANT_OUT, W8A8: in FP8 with its group scales)
                     SPLIT_K  > 1: fp32 partial sums atomically added to gu (rows, 2I)
                                   [gate (I) | up (I)], zeroed by the launcher
    _down_kernel     A @ W2^T (+ b2 on split 0) times the routing weight -> y (M, d) fp32
                     at the assignment's row; ACT_IN_A: A is gu, the bias and the
                     activation applied as each (BLOCK_M, BLOCK_K) tile is loaded;
                     SPLIT_K > 1: atomically added into a zeroed y

Weight tiles are (BLOCK_N, BLOCK_K), contiguous along K for MXFP4 and K-major
checkpoints, fed to ``tl.dot`` transposed; SWAP (a Config's ``swap``) computes the
transposed product instead, acc^T (BLOCK_N, BLOCK_M) += W @ A^T, so the weight
features are the MMA's M rows (wgmma's 64) and the few rows of an expert its N, and
transposes the accumulator once after the K loop.

MXFP4 (``MXFP4`` 1, the default): a tile's BLOCK_N x BLOCK_K / 2 bytes are loaded as
(BLOCK_N, BLOCK_K / 32, 16), one e8m0 scale per row and group of 32, and decoded into two
(BLOCK_N, BLOCK_K / 2) bf16 halves without interleaving them: the low nibbles (the even
k of each group, k0 + 32g + 2i) and the high nibbles (the odd k). Each half is dotted
with the activation columns that hold those k: the launcher hands the gate/up kernel x
with each group of 32 columns permuted to [even | odd] (``perm``: column 32g + 2i + h
at 32g + 16h + i), and the gate/up kernel stores its output columns permuted the same
way for the down kernel, so every A load is runs of 16 contiguous values. The decode
(``_decode_mxfp4``) takes four bytes in one register: on CUDA one inline-PTX block per
four bytes spreads two bytes into the low byte of each 16-bit lane (prmt), shifts each
nibble's ``s e1 e0 m`` into bf16's sign / lowest exponent / top mantissa bits (the
value times 2^-126; code 1, 0.5, is the bf16 subnormal 2^-127), and multiplies
bf16x2 by 2^126 and then by the group's 2^(scale - 127) (scale 0: the subnormal
2^-127): exact for scales 0..254. Under the interpreter the same bits come from Triton
ops (the fp16 route below).
Block-scaled FP8 (``FP8`` 1 or 2, ``kernels/moe/fp8.py``): a weight tile is loaded as
float8_e4m3fn (one byte an element), widened to fp32 and multiplied by its scale block's
multiplier before the dot (``_fp8_tile``), then rounded to the activation's dtype, so
the dot sees exactly the torch reference's dequantised weights. The tile's rows map to
scale rows ``srows`` (gate and up blocked on their own: up's scale rows start at
``s_up``); ``FP8`` 1: the K tile lies inside one scale block (``BK % BLOCK_K == 0``), one
multiplier a row; 2: any block sizes (a tile spanning several K blocks, odd blocks), one
multiplier gathered per element; 3: W8A8 (prefill, ``fp8.py``): the A operand is FP8 too
(x, and the down kernel's activation, quantised per row and group of BK columns by the
launcher), each K tile (inside one scale block) a fresh FP8 x FP8 dot whose fp32
product is scaled by the row's activation scale times the column's weight block scale
before it joins the fp32 accumulator (``_dot8``: DeepSeek-V3's promotion every K block).
``MXFP4`` 2 keeps the earlier decode for the A/B (``UNIKV_MXFP4_DECODE=interleave``):
both nibbles unpacked and interleaved, a code becoming fp16 bits
``s << 15 | e1 e0 m << 9`` (the value times 2^-14) scaled in fp32 by 2^(scale - 113).
(An integer decode straight into bf16, the nibbles dotted against the even and odd K
columns of the A tile loaded with stride 2, ran 0.6-0.9x the interleaved one at every
bucket on the H200 (docs/perf.md) and was removed.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from unikv.kernels.linear.fp8_gemm import e4m3_groups


@triton.jit
def _act(g, u, ACT: tl.constexpr, alpha, limit):
    """The gated activation on fp32 tiles: 0 silu(g) * u, 1 gpt-oss's clamped
    (u + 1) * g * sigmoid(alpha g), 2 relu(u) ** 2 (g unused)."""
    if ACT == 0:
        out = g * tl.sigmoid(g) * u
    elif ACT == 1:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        out = (uc + 1.0) * (gc * tl.sigmoid(gc * alpha))
    else:
        r = tl.maximum(u, 0.0)
        out = r * r
    return out


def _pair_ptx(select: str, lo: str, hi: str, scale: str) -> str:
    """Two bytes of $4 (``select``: prmt's byte selector placing them in the low bytes
    of two 16-bit lanes) -> their low nibbles' bf16x2 (``lo``) and high nibbles' (``hi``),
    times the bf16x2 ``scale``."""
    return f"""
prmt.b32 p, $4, z, {select};
shl.b32 t, p, 6;
shl.b32 u, p, 12;
or.b32 t, t, u;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, big, nz;
fma.rn.bf16x2 {lo}, t, {scale}, nz;
shl.b32 t, p, 2;
shl.b32 u, p, 8;
and.b32 t, t, 0x01C001C0;
and.b32 u, u, 0x80008000;
or.b32 t, t, u;
fma.rn.bf16x2 t, t, big, nz;
fma.rn.bf16x2 {hi}, t, {scale}, nz;"""


# four bytes (one register, $4) -> the bf16x2 pairs of their low nibbles ($0: bytes 0, 1;
# $1: bytes 2, 3) and of their high nibbles ($2, $3), times each byte's own bf16 scale
# ($5: bytes 0, 1; $6: bytes 2, 3; the four bytes of a pack need not share a group)
_MXFP4_PTX = tl.constexpr(
    "{\n.reg .b32 p, t, u, z, big, nz;\nmov.b32 z, 0;\nmov.b32 big, 0x7E807E80;\n"
    "mov.b32 nz, 0x80008000;"
    + _pair_ptx("0x4140", "$0", "$2", "$5")
    + _pair_ptx("0x4342", "$1", "$3", "$6")
    + "\n}"
)


@triton.jit
def _fp16_code(code):
    """e2m1 codes (uint16) -> fp32 values times 2^-14 (fp16 bits s << 15 | e1 e0 m << 9)."""
    return (((code & 7) << 9) | ((code & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e8m0(e8):
    """e8m0 exponents -> fp32 2^(e8 - 127), exact for 0..254 (0: the subnormal 2^-127)."""
    e8 = e8.to(tl.int32)
    return tl.where(e8 == 0, 0x00400000, e8 << 23).to(tl.float32, bitcast=True)


@triton.jit
def _decode_mxfp4(byte, e8, ASM: tl.constexpr):
    """bytes (uint8) and their e8m0 scales (uint8, broadcastable to the bytes) -> (low
    nibbles, high nibbles) as bf16 tensors of the bytes' shape, exact for scales
    0..254: inline PTX four bytes at a time (``_MXFP4_PTX``) when ASM, else Triton ops
    (the interpreter)."""
    if ASM:
        e8 = e8.to(tl.uint16)
        scale = tl.where(e8 == 0, 0x0040, e8 << 7).to(tl.bfloat16, bitcast=True)  # 2^(e8 - 127)
        lo, hi = tl.inline_asm_elementwise(
            _MXFP4_PTX, "=r,=r,=r,=r,r,r,r", [byte, tl.broadcast_to(scale, byte.shape)],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )  # fmt: skip
    else:  # the codes times 2^-14, times 2^14, times the scale (in that order: no overflow)
        scale = _e8m0(e8)
        lo = (_fp16_code((byte & 0x0F).to(tl.uint16)) * 16384.0 * scale).to(tl.bfloat16)
        hi = (_fp16_code((byte >> 4).to(tl.uint16)) * 16384.0 * scale).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, rows, G, ASM: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_G: tl.constexpr):  # fmt: skip
    """MXFP4 blocks (rows, G, 16) and scales (rows, G) -> bf16 (rows, G * 32), the
    kernels' decode (``_decode_mxfp4``) written back in k order (low nibble even k)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = (r[:, None] < rows) & (g[None, :] < G)
    rg = r[:, None].to(tl.int64) * G + g[None, :]
    i = tl.arange(0, 16)[None, None, :]
    byte = tl.load(w_ptr + rg[:, :, None] * 16 + i, mask=ok[:, :, None], other=0)
    e8 = tl.load(s_ptr + rg[:, :, None], mask=ok[:, :, None], other=127)
    lo, hi = _decode_mxfp4(byte, e8, ASM)
    dst = out_ptr + rg[:, :, None] * 32 + 2 * i
    tl.store(dst, lo, mask=ok[:, :, None])
    tl.store(dst + 1, hi, mask=ok[:, :, None])


@triton.jit
def _mxfp4_halves(w_ptr, s_ptr, w_base, s_base, rows, row_ok, k0, K, s_wn, s_sn,
                  ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The (BLOCK_N, BLOCK_K / 2) bf16 halves of W[rows, k0 : k0 + BLOCK_K]: the even k
    of each group of 32 (k0 + 32g + 2i at column 16g + i), then the odd; 0 outside
    ``row_ok`` and K (K a multiple of 32)."""
    grp = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    ok = row_ok[:, None] & (grp[None, :] < K // 32)
    row_off = rows[:, None].to(tl.int64) * s_wn + grp[None, :] * 16
    byte = tl.load(w_ptr + w_base + row_off[:, :, None] + tl.arange(0, 16)[None, None, :],
                   mask=ok[:, :, None], other=0)  # fmt: skip
    # the scales loaded (BLOCK_N, G, 1), in the bytes' layout (2-D, they went through smem)
    s_off = rows[:, None].to(tl.int64) * s_sn + grp[None, :]
    e8 = tl.load(s_ptr + s_base + s_off[:, :, None], mask=ok[:, :, None], other=127)
    lo, hi = _decode_mxfp4(byte, e8, ASM)
    return tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)), tl.reshape(hi, (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _half_cols(k0, BLOCK_K: tl.constexpr):
    """The permuted activation columns of a tile's even-k half (k0 + 32g + i, i < 16);
    its odd-k half is these + 16."""
    j = tl.arange(0, BLOCK_K // 2)
    return k0 + j + (j // 16) * 16


@triton.jit
def perm_col(j):
    """Where feature j sits in a permuted row: 32g + 2i + h -> 32g + 16h + i."""
    return (j // 32) * 32 + (j % 2) * 16 + (j % 32) // 2


@triton.jit
def unperm_col(p):
    """The feature at permuted column p (``perm_col``'s inverse)."""
    return (p // 32) * 32 + (p % 16) * 2 + (p % 32) // 16


@triton.jit
def _weight_tile(w_ptr, s_ptr, w_base, s_base, rows, row_ok, k0, K, s_wn, s_wk, s_sn,
                 MXFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """(BLOCK_N, BLOCK_K) tile W[rows, k0 : k0 + BLOCK_K] of one expert (``w_base`` /
    ``s_base``: the expert's int64 offsets): fp32 for MXFP4, else the weight dtype;
    0 outside ``row_ok`` and K."""
    row_off = rows[:, None].to(tl.int64) * s_wn
    if MXFP4 == 2:  # bytes (BLOCK_N, BLOCK_K / 2), k // 2 within a row; scales k // 32
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(w_ptr + w_base + row_off + kb[None, :],
                       mask=row_ok[:, None] & (kb[None, :] < K // 2), other=0)  # fmt: skip
        code = tl.interleave(byte & 0x0F, byte >> 4).to(tl.uint16)  # (BLOCK_N, BLOCK_K)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s_off = rows[:, None].to(tl.int64) * s_sn + ks[None, :]
        e8 = tl.load(s_ptr + s_base + s_off, mask=row_ok[:, None] & (ks[None, :] < K // 32),
                     other=127)  # fmt: skip
        scale = _e8m0(e8) * 16384.0  # 2^(e8 - 113): the fp16 codes are the values times 2^-14
        grouped = tl.reshape(_fp16_code(code), (BLOCK_N, BLOCK_K // 32, 32))
        tile = tl.reshape(grouped * scale[:, :, None], (BLOCK_N, BLOCK_K))
    else:  # one return: Triton compiles a return after a taken constexpr branch too
        ks = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w_ptr + w_base + row_off + ks[None, :].to(tl.int64) * s_wk,
                       mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)  # fmt: skip
    return tile


@triton.jit
def _fp8_tile(w_ptr, s_ptr, w_base, s_base, rows, srows, row_ok, k0, K, s_wn, s_wk, s_sn,
              FP8: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):  # fmt: skip
    """(BLOCK_N, BLOCK_K) fp32 tile of a block-scaled FP8 weight: W[rows, k0 : k0 +
    BLOCK_K] loaded as FP8, widened and times its blocks' multipliers (``srows``: each
    row's scale row; K-blocks of BK columns, scales contiguous along K); 0 outside
    ``row_ok`` and K. FP8 1: the tile's K range lies in one scale block."""
    q = _weight_tile(w_ptr, s_ptr, w_base, s_base, rows, row_ok, k0, K, s_wn, s_wk, s_sn, 0,
                     BLOCK_N, BLOCK_K).to(tl.float32)  # fmt: skip
    s_rows = s_ptr + s_base + srows.to(tl.int64) * s_sn  # (BLOCK_N,) pointers
    if FP8 == 1:
        s = tl.load(s_rows + k0 // BK, mask=row_ok, other=0.0)
        tile = q * s[:, None]
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        s = tl.load(s_rows[:, None] + ks[None, :] // BK,
                    mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)  # fmt: skip
        tile = q * s
    return tile


@triton.jit
def _dot_t(a, w, acc, IEEE: tl.constexpr, SWAP: tl.constexpr):
    """acc + a @ w^T (a (BLOCK_M, BLOCK_K), w (BLOCK_N, BLOCK_K)), or with SWAP its
    transpose acc^T + w @ a^T: fp32 products when IEEE (fp32 models; the interpreter,
    whose bf16/fp16 dot is wrong), else in a's dtype with fp32 accumulation."""
    if IEEE:
        a, w = a.to(tl.float32), w.to(tl.float32)
        if SWAP:
            acc = tl.dot(w, tl.trans(a), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        if SWAP:
            acc = tl.dot(w.to(a.dtype), tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    return acc


@triton.jit
def _dot8(a, w, sa, sw, acc, SWAP: tl.constexpr):
    """W8A8: acc + (a @ w^T) * sa[m] * sw[n] for FP8 a (BLOCK_M, BLOCK_K) and w (BLOCK_N,
    BLOCK_K) with fp32 row scales ``sa`` and column scales ``sw`` (or, with SWAP, the
    transposed product and accumulator): the FP8 tensor cores, fp32 products per tile."""
    if SWAP:
        acc += tl.dot(w, tl.trans(a)) * sw[:, None] * sa[None, :]
    else:
        acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sw[None, :]
    return acc


@triton.jit
def _block_scales(s_ptr, s_base, srows, s_sn, kb, row_ok):
    """(len(srows),) fp32 weight block scales of scale rows ``srows`` at K block ``kb``."""
    return tl.load(s_ptr + s_base + srows.to(tl.int64) * s_sn + kb, mask=row_ok, other=0.0)


@triton.jit
def _acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """A zero fp32 accumulator, (BLOCK_N, BLOCK_M) with SWAP, else (BLOCK_M, BLOCK_N)."""
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _unswap(acc, SWAP: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) accumulator: transposed back with SWAP."""
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _a_tile(x_rows, valid, ks, K, s_xk):
    """(BLOCK_M, len(ks)) activation rows at columns ``ks``; 0 outside ``valid`` and K."""
    return tl.load(x_rows + ks[None, :] * s_xk, mask=valid[:, None] & (ks[None, :] < K),
                   other=0.0)  # fmt: skip


@triton.jit
def _k_range(K, pid_k, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[lo, hi) of split pid_k: whole BLOCK_K tiles, the last split takes the rest."""
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    lo = pid_k * per
    return lo, tl.minimum(lo + per, K)


@triton.jit(do_not_specialize=["num_assign"])  # one compile for every T
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr,
    num_assign, top_k, K, I,
    s_xm, s_xk, s_we, s_wn, s_wk, s_se, s_sn, s_be, s_bn, s_om, s_on,
    row_step, up_offset, alpha, limit, s_up, xs_ptr, s_xsm, os_ptr, s_osm,
    ACT: tl.constexpr, MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SWAP: tl.constexpr, ASM: tl.constexpr,
    FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QUANT_OUT: tl.constexpr,
    DTYPE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + pos)
    valid = assign < num_assign
    x_rows = x_ptr + (assign // top_k).to(tl.int64)[:, None] * s_xm
    xs_rows = xs_ptr + (assign // top_k).to(tl.int64) * s_xsm  # W8A8: x's group scales
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate features j
    col_ok = cols < I
    gate_rows, up_rows = cols * row_step, cols * row_step + up_offset
    gate_srows = cols // BN  # FP8: scale rows (gate and up each blocked on its own)
    up_srows = s_up + gate_srows
    w_base, s_base = expert.to(tl.int64) * s_we, expert.to(tl.int64) * s_se
    acc_g, acc_u = _acc(BLOCK_M, BLOCK_N, SWAP), _acc(BLOCK_M, BLOCK_N, SWAP)
    k_lo, k_hi = _k_range(K, pid_k, SPLIT_K, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if MXFP4 == 1:  # two halves a tile: x's columns permuted (``perm_col``)
            hc = _half_cols(k0, BLOCK_K)
            a_lo, a_hi = (
                _a_tile(x_rows, valid, hc, K, s_xk),
                _a_tile(x_rows, valid, hc + 16, K, s_xk),
            )
            wu_lo, wu_hi = _mxfp4_halves(w_ptr, s_ptr, w_base, s_base, up_rows, col_ok, k0, K,
                                         s_wn, s_sn, ASM, BLOCK_N, BLOCK_K)  # fmt: skip
            acc_u = _dot_t(a_hi, wu_hi, _dot_t(a_lo, wu_lo, acc_u, IEEE, SWAP), IEEE, SWAP)
            if ACT != 2:
                wg_lo, wg_hi = _mxfp4_halves(w_ptr, s_ptr, w_base, s_base, gate_rows, col_ok, k0,
                                             K, s_wn, s_sn, ASM, BLOCK_N, BLOCK_K)  # fmt: skip
                acc_g = _dot_t(a_hi, wg_hi, _dot_t(a_lo, wg_lo, acc_g, IEEE, SWAP), IEEE, SWAP)
        elif FP8 == 3:  # W8A8: FP8 x (quantised by the launcher) times FP8 weights
            a = _a_tile(x_rows, valid, k0 + tl.arange(0, BLOCK_K), K, s_xk)
            sa = tl.load(xs_rows + k0 // BK, mask=valid, other=0.0)
            wu = _weight_tile(w_ptr, s_ptr, w_base, s_base, up_rows, col_ok, k0, K, s_wn, s_wk,
                              s_sn, 0, BLOCK_N, BLOCK_K)  # fmt: skip
            su = _block_scales(s_ptr, s_base, up_srows, s_sn, k0 // BK, col_ok)
            acc_u = _dot8(a, wu, sa, su, acc_u, SWAP)
            if ACT != 2:
                wg = _weight_tile(w_ptr, s_ptr, w_base, s_base, gate_rows, col_ok, k0, K, s_wn,
                                  s_wk, s_sn, 0, BLOCK_N, BLOCK_K)  # fmt: skip
                sg = _block_scales(s_ptr, s_base, gate_srows, s_sn, k0 // BK, col_ok)
                acc_g = _dot8(a, wg, sa, sg, acc_g, SWAP)
        elif FP8 != 0:  # block-scaled FP8, dequantised per tile, rounded to x's dtype
            a = _a_tile(x_rows, valid, k0 + tl.arange(0, BLOCK_K), K, s_xk)
            wu = _fp8_tile(w_ptr, s_ptr, w_base, s_base, up_rows, up_srows, col_ok, k0, K, s_wn,
                           s_wk, s_sn, FP8, BK, BLOCK_N, BLOCK_K)  # fmt: skip
            acc_u = _dot_t(a, wu.to(a.dtype), acc_u, IEEE, SWAP)
            if ACT != 2:
                wg = _fp8_tile(w_ptr, s_ptr, w_base, s_base, gate_rows, gate_srows, col_ok, k0,
                               K, s_wn, s_wk, s_sn, FP8, BK, BLOCK_N, BLOCK_K)  # fmt: skip
                acc_g = _dot_t(a, wg.to(a.dtype), acc_g, IEEE, SWAP)
        else:
            a = _a_tile(x_rows, valid, k0 + tl.arange(0, BLOCK_K), K, s_xk)
            wu = _weight_tile(w_ptr, s_ptr, w_base, s_base, up_rows, col_ok, k0, K, s_wn, s_wk,
                              s_sn, MXFP4, BLOCK_N, BLOCK_K)  # fmt: skip
            acc_u = _dot_t(a, wu, acc_u, IEEE, SWAP)
            if ACT != 2:
                wg = _weight_tile(w_ptr, s_ptr, w_base, s_base, gate_rows, col_ok, k0, K, s_wn,
                                  s_wk, s_sn, MXFP4, BLOCK_N, BLOCK_K)  # fmt: skip
                acc_g = _dot_t(a, wg, acc_g, IEEE, SWAP)
    acc_g, acc_u = _unswap(acc_g, SWAP), _unswap(acc_u, SWAP)
    out_rows = out_ptr + pos[:, None].to(tl.int64) * s_om
    mask = valid[:, None] & col_ok[None, :]
    out_cols = cols
    if MXFP4 == 1:  # the down kernel reads its A columns permuted
        out_cols = perm_col(cols)
    if SPLIT_K > 1:  # partial sums; bias and activation in the down kernel
        tl.atomic_add(out_rows + (I + out_cols[None, :]) * s_on, acc_u, mask=mask)
        if ACT != 2:
            tl.atomic_add(out_rows + out_cols[None, :] * s_on, acc_g, mask=mask)
    else:
        if HAS_BIAS:
            b_base = b_ptr + expert.to(tl.int64) * s_be
            acc_u += tl.load(b_base + up_rows * s_bn, mask=col_ok, other=0.0).to(tl.float32)[
                None, :
            ]
            acc_g += tl.load(b_base + gate_rows * s_bn, mask=col_ok, other=0.0).to(tl.float32)[
                None, :
            ]
        out = _act(acc_g, acc_u, ACT, alpha, limit)
        if QUANT_OUT:  # W8A8: the activation leaves quantised, with its group scales
            _quant_store(out, out_rows + out_cols[None, :] * s_on, mask, os_ptr, pos, s_osm,
                         valid, pid_n, I, BLOCK_M, BLOCK_N, BK, DTYPE)  # fmt: skip
        else:
            tl.store(out_rows + out_cols[None, :] * s_on, out.to(out_ptr.dtype.element_ty),
                     mask=mask)  # fmt: skip


@triton.jit
def _quant_store(out, dst, mask, os_ptr, pos, s_osm, valid, pid_n, I, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BK: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """W8A8's gate/up epilogue (BLOCK_N a multiple of BK: whole groups a program): the
    fp32 activation rounded to DTYPE (as the 16-bit store would), then quantised per row
    and group of BK columns as ``fp8_gemm.quantize_act`` does it (scale = max(amax / 448,
    1e-12), q = fp8(clamp(a / scale))) -> FP8 at ``dst``, scales at row ``pos``, group
    ``pid_n * BLOCK_N / BK + g`` of ``os_ptr``; columns outside ``mask`` count as 0."""
    G: tl.constexpr = BLOCK_N // BK
    a = tl.where(mask, out.to(DTYPE).to(tl.float32), 0.0)
    grouped = tl.reshape(a, (BLOCK_M, G, BK))
    q, scale = e4m3_groups(grouped, 2)  # (BLOCK_M, G) scales
    tl.store(dst, tl.reshape(q, (BLOCK_M, BLOCK_N)).to(tl.float8e4nv), mask=mask)
    grp = pid_n * G + tl.arange(0, G)
    s_dst = os_ptr + pos[:, None].to(tl.int64) * s_osm + grp[None, :]
    tl.store(s_dst, scale, mask=valid[:, None] & (grp[None, :] < tl.cdiv(I, BK)))


@triton.jit
def _act_tile(a_rows, b_base, ks, feats, mask, I, s_ak, s_bn, row_step, up_offset, alpha,
              limit, ACT: tl.constexpr, HAS_B1: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """Activation tile (BLOCK_M, len(ks)) in DTYPE from the fp32 gate|up sums at
    rows ``a_rows``, columns ``ks`` holding features ``feats`` (+ their b1 when HAS_B1);
    0 outside ``mask``."""
    u = tl.load(a_rows + (I + ks[None, :]) * s_ak, mask=mask, other=0.0)
    g = u
    if ACT != 2:
        g = tl.load(a_rows + ks[None, :] * s_ak, mask=mask, other=0.0)
    if HAS_B1:
        k_ok = feats < I
        u += tl.load(b_base + (feats * row_step + up_offset) * s_bn, mask=k_ok, other=0.0).to(
            tl.float32
        )[None, :]
        g += tl.load(b_base + feats * row_step * s_bn, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    return tl.where(mask, _act(g, u, ACT, alpha, limit), 0.0).to(DTYPE)


@triton.jit
def _down_a(a_rows, b1_base, valid, ks, K, s_ak, s_b1n, row_step, up_offset, alpha, limit,
            ACT_IN_A: tl.constexpr, ACT: tl.constexpr, HAS_B1: tl.constexpr,
            DTYPE: tl.constexpr, PERM: tl.constexpr):  # fmt: skip
    """The down kernel's A tile at columns ``ks``: the activation rows, or with ACT_IN_A
    the activation of the fp32 gate|up sums (``_act_tile``); PERM: the columns hold
    features permuted (``perm_col``)."""
    mask = valid[:, None] & (ks[None, :] < K)
    if ACT_IN_A:
        feats = ks
        if PERM:
            feats = unperm_col(ks)
        a = _act_tile(a_rows, b1_base, ks, feats, mask, K, s_ak, s_b1n, row_step, up_offset,
                      alpha, limit, ACT, HAS_B1, DTYPE)  # fmt: skip
    else:
        a = tl.load(a_rows + ks[None, :] * s_ak, mask=mask, other=0.0)
    return a


@triton.jit(do_not_specialize=["num_assign"])
def _down_kernel(
    a_ptr, w_ptr, s_ptr, b_ptr, b1_ptr, tw_ptr, y_ptr, sorted_ids_ptr, block_experts_ptr,
    num_assign, N, K,
    s_am, s_ak, s_we, s_wn, s_wk, s_se, s_sn, s_be, s_bn, s_b1e, s_b1n, s_ym, s_yn,
    row_step, up_offset, alpha, limit, as_ptr, s_asm,
    MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    ACT_IN_A: tl.constexpr,
    ACT: tl.constexpr, HAS_B1: tl.constexpr, DTYPE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
    ASM: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + pos)
    valid = assign < num_assign
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden features
    col_ok = cols < N
    a_rows = a_ptr + pos[:, None].to(tl.int64) * s_am
    as_rows = as_ptr + pos.to(tl.int64) * s_asm  # W8A8: A's group scales
    b1_base = b1_ptr + expert.to(tl.int64) * s_b1e
    w_base, s_base = expert.to(tl.int64) * s_we, expert.to(tl.int64) * s_se
    acc = _acc(BLOCK_M, BLOCK_N, SWAP)
    k_lo, k_hi = _k_range(K, pid_k, SPLIT_K, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if MXFP4 == 1:  # two halves a tile, A's columns permuted by the gate/up kernel
            hc = _half_cols(k0, BLOCK_K)
            a_lo = _down_a(a_rows, b1_base, valid, hc, K, s_ak, s_b1n, row_step, up_offset,
                           alpha, limit, ACT_IN_A, ACT, HAS_B1, DTYPE, True)  # fmt: skip
            a_hi = _down_a(a_rows, b1_base, valid, hc + 16, K, s_ak, s_b1n, row_step,
                           up_offset, alpha, limit, ACT_IN_A, ACT, HAS_B1, DTYPE, True)  # fmt: skip
            w_lo, w_hi = _mxfp4_halves(w_ptr, s_ptr, w_base, s_base, cols, col_ok, k0, K, s_wn,
                                       s_sn, ASM, BLOCK_N, BLOCK_K)  # fmt: skip
            acc = _dot_t(a_hi, w_hi, _dot_t(a_lo, w_lo, acc, IEEE, SWAP), IEEE, SWAP)
        else:
            a = _down_a(a_rows, b1_base, valid, k0 + tl.arange(0, BLOCK_K), K, s_ak, s_b1n,
                        row_step, up_offset, alpha, limit, ACT_IN_A, ACT, HAS_B1, DTYPE,
                        False)  # fmt: skip
            if FP8 == 3:  # W8A8: FP8 A (quantised by the launcher) times FP8 weights
                w = _weight_tile(w_ptr, s_ptr, w_base, s_base, cols, col_ok, k0, K, s_wn, s_wk,
                                 s_sn, 0, BLOCK_N, BLOCK_K)  # fmt: skip
                sa = tl.load(as_rows + k0 // BK, mask=valid, other=0.0)
                sw = _block_scales(s_ptr, s_base, cols // BN, s_sn, k0 // BK, col_ok)
                acc = _dot8(a, w, sa, sw, acc, SWAP)
            elif FP8 != 0:  # block-scaled FP8: rounded to A's dtype after its scale
                w = _fp8_tile(w_ptr, s_ptr, w_base, s_base, cols, cols // BN, col_ok, k0, K,
                              s_wn, s_wk, s_sn, FP8, BK, BLOCK_N, BLOCK_K).to(a.dtype)  # fmt: skip
                acc = _dot_t(a, w, acc, IEEE, SWAP)
            else:
                w = _weight_tile(w_ptr, s_ptr, w_base, s_base, cols, col_ok, k0, K, s_wn, s_wk,
                                 s_sn, MXFP4, BLOCK_N, BLOCK_K)  # fmt: skip
                acc = _dot_t(a, w, acc, IEEE, SWAP)
    acc = _unswap(acc, SWAP)
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert.to(tl.int64) * s_be + cols * s_bn, mask=col_ok, other=0.0)
        acc += tl.where(pid_k == 0, bias.to(tl.float32), 0.0)[None, :]
    weight = tl.load(tw_ptr + assign, mask=valid, other=0.0).to(tl.float32)
    dst = y_ptr + assign[:, None].to(tl.int64) * s_ym + cols[None, :] * s_yn
    if SPLIT_K > 1:
        tl.atomic_add(dst, acc * weight[:, None], mask=valid[:, None] & col_ok[None, :])
    else:
        tl.store(dst, acc * weight[:, None], mask=valid[:, None] & col_ok[None, :])
