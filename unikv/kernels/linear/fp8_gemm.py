"""Block-scaled FP8 GEMM in Triton: y = x @ W^T (+ b) for a weight kept in FP8.

W is ``weight`` (N, K) float8_e4m3fn with ``scale_inv`` (ceil(N / bn), ceil(K / bk))
fp32 per block of bn x bk (``fp8_gemm_ref``'s definition, edge blocks partial). Two
variants, picked by ``plan`` from host ints (rows M, N, K, the block, x's dtype), never
by reading the device. What the rows decide (``row_choice``: the tile class, w8a8,
``_scaled_mm``) is the step's ``RowsPlan.fp8``, made once per step by the step
planner (a CUDA graph's: its captured batch size's); ``plan`` adds the layer's part:

- ``w8a16`` (decode and small batches, and every fp32 input): x stays in its dtype;
  each weight tile is loaded as FP8 (one byte an element: the weight stream is the
  cost at small M) and widened to x's dtype in registers. Where the K tile lies inside
  one scale block (``bk % BLOCK_K == 0``) the tile's product is scaled after the dot,
  one multiplier per output column (``acc += dot(x, Wq^T) * s[n // bn, k // bk]``);
  otherwise (odd block sizes) each element is dequantised before the dot. Few output
  tiles split K (``split_k``): each split program writes its fp32 partial tile to a
  workspace and counts its arrival on the tile's counter; the program that arrives last
  sums the tile's partials in split order (``Fp8Plan.fused_split``; below).
- ``w8a8`` (prefill: M >= ``W8A8_MIN_ROWS``, 16-bit x, ``bk`` a multiple of the K
  tile): x is quantised per token and group of bk columns to FP8 first (one small
  kernel, DeepSeek's dynamic scheme, ``fp8_gemm_ref.quantize_act``), then both operands
  feed the FP8 tensor cores: ``acc += dot(xq, Wq^T) * xs[m, k // bk] * s[n // bn, k // bk]``.
- ``scaled_mm`` (prefill, M >= ``SCALED_MM_MIN_ROWS``, 16-bit x, 128 x 128 blocks, N a
  multiple of 128 and K of 512): the same quantised x, then cuBLAS's block-scaled GEMM
  (``torch._scaled_mm`` with 1 x 128 activation and 128 x 128 weight scales), where the
  backend found it at construction (``scaled_mm_supported``: this torch and GPU run it
  and match the reference); the plan takes it only when told so (``scaled_mm``), never
  by reading the device per call.

Where a block's pre-norm quantises x itself (``norm_quant.add_rms_norm_quant``, one
pass over x instead of the norm's write and ``quantize_act``'s read), ``fp8_act_quant``
says how (the group and scale layout the plan's variant reads, or None: no
quantisation at these rows) and ``fp8_linear_quantized`` runs that variant's launch
from the codes and scales: the unfused call's result bit for bit.

    grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), split_k)   grouped along M for L2 reuse

A weight whose N is not whole 128-row blocks (DeepSeek's kv_a_proj_with_mqa, 576, and
its packed q_a | kv_a, 2112) is held padded (``padded_rows``: zero rows, finite scale
rows, made once at load by ``models/fp8_linear.Fp8BlockLinear``) so ``scaled_mm`` takes
it; ``out_features`` names the real rows. Every variant then returns the (M, N) view of
an (M, N padded) buffer: ``scaled_mm`` multiplies the padded weight, the Triton
variants mask at N (the pad rows are never read), the reference slices its product.

fp32 inputs run the dot in IEEE fp32 (no TF32), so fp32 models match a model whose
weights are the dequantised ones to rounding.

Split K in one launch (``fused_split``, the plan's default): a split program stores its
partial (rows < M) at its (tile, split) slot of an fp32 workspace, then adds 1 to the
tile's arrival counter (``atomic_add``, acq_rel, after a barrier so every thread's
stores are released). The program that sees S - 1 arrived sums the S partials in split
order 0..S-1 (so the bytes do not depend on which split came last), adds the bias,
stores y in its dtype and sets the counter back to 0: the counters are zero between
launches, with no memset, under CUDA graph replay too. The split count is a kernel
constant (its loads unrolled: one compile per split count the plans make). Workspace and counters
(``split_buffers``) are made once per device and size class, on first use, which
must not be inside a CUDA graph capture (the engine runs every graph's step once
before capturing it), and are never freed (a captured graph holds their addresses).
One workspace serves every launch of its size class: this assumes launches never
overlap, which holds in this engine (one compute stream; the GEMM does not launch
with PDL). Two streams running split-K GEMMs at once would mix partials.
``fused_split=False`` keeps the former path for the benchmark's A/B: the partials in a
per-call (split, M, N) fp32 tensor, summed by torch (``sum``, ``+= bias``, ``copy_``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from unikv.kernels.linear.fp8_gemm_ref import (
    ACT_SCALE_MIN,
    FP8_MAX,
    Fp8Quant,
    check_operands,
    check_quantized,
)
from unikv.kernels.runtime.interpret import patch_interpreter

if TYPE_CHECKING:
    from unikv.kernels.backend import RowsPlan

patch_interpreter()

W8A8_MIN_ROWS = 256  # below: the weight stream dominates; x stays 16-bit
SCALED_MM_MIN_ROWS = 256  # cuBLAS's block-scaled GEMM from here (prefill), where usable
SCALED_MM_BLOCK = (128, 128)
TARGET_PROGRAMS = 264  # about two waves on a 132-SM H100: split K below this
MIN_K_PER_SPLIT = 512
# the activation quantisation's tiling (``quantize_act``): rows and groups of x a
# program takes, its warps; candidates in ``bench_fp8_gemm.py`` (not yet tuned on a GPU:
# this is the tiling the first version ran, one group of 16 rows a program)
QUANT_TILE = (16, 1, 4)
# w8a16 (block_m, block_n, warps, stages) by ``Fp8Rows.tile``: M <= 16, <= 64, more
TILES = ((16, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3))


class Fp8Rows(NamedTuple):
    """What M rows decide (``row_choice``), before the layer's shape and block: ``tile``
    the w8a16 tile class (0: M <= 16, 1: M <= 64, 2: more), ``w8a8`` (M >=
    ``W8A8_MIN_ROWS``), ``scaled_mm`` (the backend runs ``torch._scaled_mm`` and M >=
    ``SCALED_MM_MIN_ROWS``)."""

    tile: int
    w8a8: bool
    scaled_mm: bool


def row_choice(m: int, scaled_mm: bool = False) -> Fp8Rows:
    """The rows' part of the plan for M rows; ``scaled_mm``: the backend found
    ``torch._scaled_mm``'s block scaling usable (``scaled_mm_supported``)."""
    tile = 0 if m <= 16 else 1 if m <= 64 else 2
    return Fp8Rows(tile, m >= W8A8_MIN_ROWS, scaled_mm and m >= SCALED_MM_MIN_ROWS)


class Fp8Plan(NamedTuple):
    """One launch's choice: ``variant`` ("w8a16" / "w8a8"), the tiles, ``split_k``
    (programs along K; > 1 sums partials in an fp32 workspace), ``per_k_scale`` (the K
    tile lies inside one scale block), warps and pipeline stages; ``fused_split``:
    split partials are summed inside the launch by each tile's last program (one
    launch), else by torch after it (the former path, kept for the benchmark's A/B)."""

    variant: str
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    per_k_scale: bool
    num_warps: int
    num_stages: int
    fused_split: bool = True


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing n, at most cap."""
    return min(n & -n, cap)


@functools.lru_cache(maxsize=1024)
def plan(
    m: int, n: int, k: int, block: tuple[int, int], fp32: bool, scaled_mm: bool = False,
    rows: Fp8Rows | None = None,
) -> Fp8Plan:  # fmt: skip
    """The launch plan for x (m, k) times W (n, k) in blocks ``block`` (host ints only);
    ``scaled_mm``: the backend may run ``torch._scaled_mm`` (``scaled_mm_supported``).
    rows: the step's choice by rows (``RowsPlan.fp8``); None: ``row_choice(m,
    scaled_mm)``."""
    rows = row_choice(m, scaled_mm) if rows is None else rows
    if rows.scaled_mm and not fp32 and scaled_mm_shape(n, k, block):
        return Fp8Plan("scaled_mm", 0, 0, 0, 1, True, 0, 0)
    tile_k = _pow2_divisor(block[1], 128)
    per_k = tile_k >= 16  # tl.dot needs K tiles of >= 16
    if not fp32 and per_k and rows.w8a8:
        return Fp8Plan("w8a8", 128, 128, tile_k, 1, True, 8, 3)
    block_k = tile_k if per_k else 32
    block_m, block_n, warps, stages = TILES[rows.tile]
    if fp32:  # IEEE fp32 dots take more registers and shared memory a tile
        block_k, stages = min(block_k, 32), 2
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = split_count(tiles, k, block_k)
    return Fp8Plan("w8a16", block_m, block_n, block_k, split, per_k, warps, stages)


def split_count(
    tiles: int, k: int, block_k: int, target: int = TARGET_PROGRAMS, min_k: int = MIN_K_PER_SPLIT
) -> int:
    """Splits along K for ``tiles`` output tiles: enough programs to reach ``target``,
    each split at least ``min_k`` of K (whole K tiles of ``block_k``), at most one split
    a K tile, at least one (the plan's rule; the benchmark's candidates vary ``target``
    and ``min_k``)."""
    k_tiles = triton.cdiv(k, block_k)
    return max(1, min(target // tiles, k_tiles * block_k // min_k, k_tiles))


@triton.jit
def e4m3_groups(v, AXIS: tl.constexpr):
    """The activations' 1 x group e4m3 quantisation, shared by every kernel that writes it
    (``_act_quant_kernel``, the fused pre-norm's, the W8A8 MoE epilogue's): v fp32 with
    its groups along ``AXIS`` -> (codes, still fp32, in [-448, 448]; scales, ``AXIS``
    reduced): scale = max(amax / 448, 1e-12), code = clamp(v / scale). IEEE divisions
    (``div_rn``): Triton's fp32 ``/`` is approximate on NVIDIA GPUs, and an element at a
    rounding edge would land on another e4m3 value than the torch reference's."""
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=AXIS), 448.0), 1e-12)
    codes = tl.clamp(tl.math.div_rn(v, tl.expand_dims(scale, AXIS)), -448.0, 448.0)
    return codes, scale


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, n_groups, stride_xm, stride_qm, stride_sm,
                      stride_sg, GROUP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                      GROUPS: tl.constexpr):  # fmt: skip
    """One program per ROWS rows and GROUPS groups (one read of x, one write of xq and
    of the scales): xs = max(amax / 448, 1e-12), xq = fp8(x / xs)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    grps = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, BLOCK)
    cols = grps[:, None] * GROUP + lane[None, :]  # (GROUPS, BLOCK)
    col_ok = (lane < GROUP)[None, :] & (cols < K) & (grps < n_groups)[:, None]
    mask = (rows < M)[:, None, None] & col_ok[None, :, :]
    offs = rows[:, None, None] * stride_xm + cols[None, :, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (ROWS, GROUPS, BLOCK)
    q, scale = e4m3_groups(x, 2)  # scale: (ROWS, GROUPS)
    q_offs = rows[:, None, None] * stride_qm + cols[None, :, :]
    tl.store(q_ptr + q_offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    s_ok = (rows < M)[:, None] & (grps < n_groups)[None, :]
    tl.store(s_ptr + rows[:, None] * stride_sm + grps[None, :] * stride_sg, scale, mask=s_ok)


@triton.jit
def _store_tile(acc, b_ptr, y_ptr, rm, rn, m_ok, n_ok, stride_ym, HAS_BIAS: tl.constexpr):
    """y[rm, rn] = acc (+ bias, in fp32) in y's dtype, inside (M, N)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, count_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xsm, stride_wn, stride_sn, stride_ym, stride_ys,
    BN: tl.constexpr, BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PER_K_SCALE: tl.constexpr, W8A8: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, FUSED_SPLIT: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Program (pid, split): the output tile pid over K range ``split``. One split:
    y = acc (+ bias). ``FUSED_SPLIT``: the partial goes to ``ws_ptr`` at (pid, split)
    and the tile's last program to arrive on ``count_ptr[pid]`` writes y (module
    docstring; ``SPLITS`` the grid's splits, a constant so that the sum's loads are
    unrolled and issued together, not one L2 round trip after another). Else (the
    torch path) the partial goes to y_ptr + split * stride_ys."""
    pid, split = tl.program_id(0), tl.program_id(1)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # programs of GROUP_M row tiles walk N together (L2 reuse)
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    scale_rows = s_ptr + (rn // BN) * stride_sn  # (BLOCK_N,) this tile's scale rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < k_hi
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + rn[:, None] * stride_wn + ks[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        if W8A8:
            xs = tl.load(xs_ptr + rm * stride_xsm + k0 // BK, mask=m_ok, other=0.0)
            ws = tl.load(scale_rows + k0 // BK, mask=n_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w)) * xs[:, None] * ws[None, :]
        elif PER_K_SCALE:
            ws = tl.load(scale_rows + k0 // BK, mask=n_ok, other=0.0)
            if IEEE:
                part = tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
            acc += part * ws[None, :]
        else:  # odd blocks: each element's own scale before the dot
            ws = tl.load(scale_rows[:, None] + ks[None, :] // BK,
                         mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            wd = w.to(tl.float32) * ws
            if IEEE:
                acc += tl.dot(x, tl.trans(wd), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(wd.to(x.dtype)))
    if FUSED_SPLIT:
        lanes = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile = ws_ptr + pid.to(tl.int64) * (SPLITS * BLOCK_M * BLOCK_N) + lanes
        rows_ok = m_ok[:, None] & (rn >= 0)[None, :]  # rows past M: neither stored nor read
        tl.store(tile + split * (BLOCK_M * BLOCK_N), acc, mask=rows_ok)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # the last of the tile's splits: sum them in order
            total = tl.load(tile, mask=rows_ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(tile + s * (BLOCK_M * BLOCK_N), mask=rows_ok, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            _store_tile(total, b_ptr, y_ptr, rm, rn, m_ok, n_ok, stride_ym, HAS_BIAS)
            tl.store(count_ptr + pid, 0)  # self-cleaning: zero for the next launch
    else:
        out_ptr = y_ptr + split * stride_ys
        _store_tile(acc, b_ptr, out_ptr, rm, rn, m_ok, n_ok, stride_ym, HAS_BIAS)


def quantize_act(
    x: torch.Tensor, group: int, tile: tuple[int, int, int] | None = None, *, m_major=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) 16-bit, unit stride along K -> (xq (M, K) fp8, scales (M, cdiv(K, group))
    fp32): ``fp8_gemm_ref.quantize_act`` in one launch. ``tile``: (rows, groups a
    program, warps), powers of two; None: ``QUANT_TILE`` (the benchmark's sweep).
    ``m_major``: the scales written M-major (strides (1, M)), as cuBLAS's block scaling
    reads them (``scaled_mm_linear``), else row-major."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if m_major:
        xs = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    else:
        xs = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        rows, per, warps = QUANT_TILE if tile is None else tile
        per = min(per, triton.next_power_of_2(groups))
        _act_quant_kernel[(triton.cdiv(m, rows), triton.cdiv(groups, per))](
            x, xq, xs, m, k, groups, x.stride(0), xq.stride(0), xs.stride(0), xs.stride(1),
            GROUP=group, BLOCK=triton.next_power_of_2(group), ROWS=rows, GROUPS=per,
            num_warps=warps,
        )  # fmt: skip
    return xq, xs


assert FP8_MAX == 448.0 and ACT_SCALE_MIN == 1e-12, "the kernels' constants"


def scaled_mm_shape(n: int, k: int, block) -> bool:
    """Whether ``torch._scaled_mm``'s block scaling takes W (n, k) in blocks ``block``:
    128 x 128 blocks, whole along N, and K in whole groups of four scale columns."""
    return tuple(block) == SCALED_MM_BLOCK and n % 128 == 0 and k % 512 == 0


def padded_rows(n: int, k: int, block) -> int:
    """The rows an FP8 weight W (n, k) in blocks ``block`` is held in so the ``scaled_mm``
    variant takes it: n up to whole 128-row blocks where only N stands in the way (128 x
    128 blocks, K in whole groups of four scale columns), else n. Asked once per layer at
    load, through the backend's ``fp8_padded_rows`` (where ``scaled_mm_supported``)."""
    if tuple(block) == SCALED_MM_BLOCK and k % 512 == 0:
        return triton.cdiv(n, 128) * 128
    return n


def scaled_mm_linear(x2, weight, scale_inv, bias):
    """x2 (M, K) 16-bit @ W^T (+ bias) through ``torch._scaled_mm``: x quantised per token
    and group of 128 columns (``quantize_act``), its scales written M-major (strides (1,
    M)) and the weight's K-major (a transposed view), as cuBLAS's block scaling reads
    them."""
    xq, xs = quantize_act(x2, 128, m_major=True)
    return scaled_mm_quantized(xq, xs, weight, scale_inv, bias, x2.dtype)


def scaled_mm_quantized(xq, xs, weight, scale_inv, bias, dtype):
    """``scaled_mm_linear`` after the quantisation: xq (M, K) FP8, xs (M, K / 128)
    M-major."""
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale_inv.t(), out_dtype=dtype)
    return y if bias is None else y + bias


@functools.cache
def scaled_mm_supported(device: torch.device) -> bool:
    """Whether this torch runs ``torch._scaled_mm`` with 1 x 128 x 128 x 128 block scales
    on ``device`` and its output matches the reference (``fp8_linear_w8a8``) on a small
    problem: probed once per device, at backend construction (``backend.flags_for``)."""
    from unikv.kernels.linear.fp8_gemm_ref import fp8_linear_w8a8

    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        n, k = 256, 512
        w = (torch.randn(n, k, device=device, generator=g) * 100).clamp(-448, 448)
        w = w.to(torch.float8_e4m3fn)
        s = torch.rand(n // 128, k // 128, device=device, generator=g) * 1e-3 + 1e-4
        x = torch.randn(SCALED_MM_MIN_ROWS, k, device=device, generator=g).to(torch.bfloat16)
        got = scaled_mm_linear(x, w, s, None).float()
        want = fp8_linear_w8a8(x, w, s, block=SCALED_MM_BLOCK).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False  # this torch / GPU has no block-scaled _scaled_mm
    return err < 2e-2


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block: tuple[int, int],
    config: Fp8Plan | None = None,
    scaled_mm: bool = False,
    rows: RowsPlan | None = None,
    out_features: int | None = None,
) -> torch.Tensor:
    """x (..., K) @ W^T (+ bias) -> (..., N) in x.dtype, W = weight * its block scales.
    ``config``: a plan to use instead of ``plan``'s (the benchmark's sweep); ``scaled_mm``:
    the backend found ``torch._scaled_mm``'s block scaling usable (``plan`` may pick it);
    ``rows``: the step's plan (its ``fp8``: the choice by rows, which already holds
    ``scaled_mm``); None: ``row_choice`` of x's rows. ``out_features``: N, the weight's
    real rows where it is held padded (``padded_rows``); the result is then the (..., N)
    view of a buffer of the padded rows (module docstring)."""
    check_operands(x, weight, scale_inv, block, out_features)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, held = x2.shape[0], weight.shape[0]
    n = held if out_features is None else out_features
    if m == 0:
        return torch.empty((*lead, n), dtype=x.dtype, device=x.device)
    by_rows = None if rows is None else rows.fp8
    cfg = config or plan(m, held, k, tuple(block), x.dtype == torch.float32, scaled_mm, by_rows)
    if cfg.variant == "scaled_mm":
        if n == held:
            return scaled_mm_linear(x2, weight, scale_inv, bias).view(*lead, n)
        y = scaled_mm_linear(x2, weight, scale_inv, None)[:, :n]  # the real rows' view
        return (y if bias is None else y + bias).view(*lead, n)
    xs = x2  # a placeholder pointer where x is not quantised
    if cfg.variant == "w8a8":
        x2, xs = quantize_act(x2, block[1])
    return _launch(x2, xs, weight, scale_inv, bias, block, cfg, x.dtype, n).view(*lead, n)


def _scaled_mm_out(xq, xs, weight, scale_inv, bias, dtype, n) -> torch.Tensor:
    """``torch._scaled_mm`` on quantised x (M-major scales): the (M, n) product (+ bias),
    a view of the held rows' product where n is fewer (``fp8_linear``'s steps after
    its ``scaled_mm_linear``'s quantisation)."""
    if n == weight.shape[0]:
        return scaled_mm_quantized(xq, xs, weight, scale_inv, bias, dtype)
    y = scaled_mm_quantized(xq, xs, weight, scale_inv, None, dtype)[:, :n]  # the real rows
    return y if bias is None else y + bias


_SPLIT_BUFFERS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}
SPLIT_MIN_NUMEL = 1 << 16  # the smallest size class (256 KiB of fp32)
# a split tile is at least 16 x 16 (tl.dot's least) and a split launch has >= 2 splits:
# a launch of ``need`` workspace elements has at most need // 512 tiles
_MIN_SPLIT_TILE = 16 * 16 * 2


def split_buffers(need: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace fp32, arrival counters int32, zero) of the fused split-K launch on
    ``device`` for ``need`` workspace elements: those of ``need``'s size class (a power
    of two, at least ``SPLIT_MIN_NUMEL``), made on first use and kept (never per call,
    never freed: a CUDA graph holds their addresses). First use must not be inside a
    CUDA graph capture: run the step once before capturing it (the engine does)."""
    size = max(SPLIT_MIN_NUMEL, triton.next_power_of_2(need))
    key = (device, size)
    got = _SPLIT_BUFFERS.get(key)
    if got is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the FP8 GEMM's split-K workspace of {size} fp32 elements on {device} is "
                "made on first use, outside a CUDA graph capture; run the step once "
                "before capturing it"
            )
        workspace = torch.empty(size, dtype=torch.float32, device=device)
        counters = torch.zeros(size // _MIN_SPLIT_TILE, dtype=torch.int32, device=device)
        got = _SPLIT_BUFFERS[key] = (workspace, counters)
    return got


def _launch(x2, xs, weight, scale_inv, bias, block, cfg: Fp8Plan, dtype, n) -> torch.Tensor:
    """The Triton GEMM of x2 (M, K) (FP8 with its row-major scales ``xs`` for w8a8,
    else 16-bit or fp32) and the weight: the (M, n) view of an (M, held rows) buffer in
    ``dtype``. Split K: one launch where ``cfg.fused_split``, else the kernel's partials
    summed by torch (three or four launches and a per-call workspace)."""
    m, k = x2.shape
    y = torch.empty((m, weight.shape[0]), dtype=dtype, device=x2.device)[:, :n]
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    fused = split > 1 and cfg.fused_split
    out, workspace, counters = y, y, y  # placeholders where unread
    if fused:
        need = tiles * split * cfg.block_m * cfg.block_n
        workspace, counters = split_buffers(need, x2.device)
        assert need <= workspace.numel() and tiles <= counters.numel(), "split_buffers' size class"
    elif split > 1:
        out = torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    has_bias = bias is not None and (split == 1 or fused)
    _fp8_gemm_kernel[(tiles, split)](
        x2, xs, weight, scale_inv, bias if has_bias else scale_inv, out, workspace, counters,
        m, n, k, k_per_split,
        x2.stride(0), xs.stride(0), weight.stride(0), scale_inv.stride(0),
        out.stride(-2), out.stride(0) if split > 1 and not fused else 0,
        BN=block[0], BK=block[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=8, PER_K_SCALE=cfg.per_k_scale,
        W8A8=cfg.variant == "w8a8", HAS_BIAS=has_bias, IEEE=dtype == torch.float32,
        FUSED_SPLIT=fused, SPLITS=split if fused else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1 and not fused:
        total = out.sum(0)
        if bias is not None:
            total += bias.float()
        y.copy_(total)
    return y


def fp8_act_quant(
    m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype,
    rows: RowsPlan | None = None, *, scaled_mm: bool = False,
) -> Fp8Quant | None:  # fmt: skip
    """How ``fp8_linear`` of x (m, k) in ``dtype`` on a weight held as (n, k) quantises
    x at this step's rows (``rows``: its plan; None: by m), from the same ``plan``:
    ``scaled_mm``, per 128 columns with M-major scales; ``w8a8``, per bk with row-major
    ones; else None (x stays in its dtype). Host ints only: a caller that quantises x
    itself (the pre-norm, ``add_rms_norm_quant``) then calls ``fp8_linear_quantized``."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    by_rows = None if rows is None else rows.fp8
    variant = plan(m, n, k, tuple(block), False, scaled_mm, by_rows).variant
    if variant == "scaled_mm":
        return Fp8Quant(128, True)
    return Fp8Quant(block[1], False) if variant == "w8a8" else None


def fp8_linear_quantized(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    rows: RowsPlan | None = None,
    out_features: int | None = None,
    scaled_mm: bool = False,
) -> torch.Tensor:
    """``fp8_linear``'s prefill variants from x already quantised as ``fp8_act_quant``
    said (xq (M, K) float8_e4m3fn, xs its scales in that layout): the same GEMM
    launch the unfused call makes after its own ``quantize_act``, so the result is
    that call's bit for bit. (M, N) in ``out_dtype``, a view where ``out_features``."""
    check_quantized(xq, xs, weight, block)
    check_operands(xq.new_empty(0, xq.shape[-1], dtype=out_dtype, device="meta"),
                   weight, scale_inv, block, out_features)  # fmt: skip
    (m, k), held = xq.shape, weight.shape[0]
    n = held if out_features is None else out_features
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=xq.device)
    by_rows = None if rows is None else rows.fp8
    cfg = plan(m, held, k, tuple(block), False, scaled_mm, by_rows)
    if cfg.variant == "scaled_mm":
        assert xs.stride() == (1, m), "scaled_mm reads M-major scales (fp8_act_quant's m_major)"
        return _scaled_mm_out(xq, xs, weight, scale_inv, bias, out_dtype, n)
    assert cfg.variant == "w8a8", "x quantised only where fp8_act_quant says the plan does"
    assert xs.stride(1) == 1, "the w8a8 GEMM reads row-major scales"
    return _launch(xq, xs, weight, scale_inv, bias, block, cfg, out_dtype, n)
