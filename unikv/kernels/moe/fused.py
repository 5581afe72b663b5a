"""Fused MoE in Triton: only the routed experts run, MXFP4 weights stay packed (and
block-scaled FP8 experts stay FP8: ``kernels/moe/fp8.py`` through ``launch``).

Semantics and argument layouts: ``kernels/moe/ref.py`` (same signature). Kernel
bodies: ``kernels/moe/fused_kernels.py``.

    topk_ids (T, k) ──align──> sorted_ids (num_blocks * BLOCK_M,)  assignment ids t*k+j,
                               grouped by expert, each expert's run padded to BLOCK_M
                               (padding = M, the sentinel); block_experts (num_blocks,)
                               the expert of each BLOCK_M rows, -1 past the last block
    gate_up  grid (num_blocks, cdiv(I, BLOCK_N), SPLIT_K) -> act (rows, I) x.dtype, or
             fp32 gate|up partial sums (rows, 2I) when SPLIT_K > 1
    down     grid (num_blocks, cdiv(d, BLOCK_N), SPLIT_K) -> y (M, d) fp32
    out = y.view(T, k, d).sum(1).to(x.dtype)

Launch plan, host ints only (CUDA graphs capture one T each, so a per-T choice is
fixed inside a graph): ``TABLE[(bucket(T), mxfp4)]`` is a ``Config`` or ``LOOP``;
``LOOP`` runs the dense torch loop (``moe_ref.fused_moe``) instead, allowed only for
unpacked experts (MXFP4 stays packed, so always fused). ``moe`` applies the rule;
``fused_moe`` always runs the kernel. The alignment has no host sync (``num_blocks``
is an upper bound from the host ints T, k, E): one Triton program for decode-sized
steps (``ALIGN_KERNEL_MAX_WORK``, ``moe_align.py``), torch ops above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from unikv.env import FLAGS
from unikv.kernels.linear.fp8_gemm import quantize_act
from unikv.kernels.moe import ref as moe_ref
from unikv.kernels.moe.align import align_by_expert_kernel
from unikv.kernels.moe.fused_kernels import _decode_kernel, _down_kernel, _gate_up_kernel
from unikv.kernels.moe.ref import check_moe_args
from unikv.kernels.runtime.interpret import patch_interpreter

if TYPE_CHECKING:
    from unikv.kernels.backend import RowsPlan

patch_interpreter()  # run-time loop bounds under TRITON_INTERPRET=1 (no-op otherwise)

INTERPRETED = FLAGS.triton_interpret  # fixed at import
# MXFP4 decode (``moe_triton``'s docstring): 1 the two-halves decode, 2 the interleaved
# one before it; "table" (the default, 0): as each Config's ``interleave`` says (the
# two halves at 1-256 tokens, interleaved for prefill chunks, where it ran 1.13-1.23x
# the halves in a same-run A/B, docs/perf.md); ``UNIKV_MXFP4_DECODE=halves`` or
# ``=interleave`` forces one everywhere (the A/B)
MXFP4_DECODES = {"table": 0, "halves": 1, "interleave": 2}
_decode = FLAGS.mxfp4_decode  # validated by unikv.env
MXFP4_DECODE = MXFP4_DECODES[_decode]


def mxfp4_mode(cfg: Config, mxfp4: bool) -> int:
    """The kernels' MXFP4 constexpr for a launch: 0 dense experts, 1 the two halves,
    2 interleaved (``UNIKV_MXFP4_DECODE`` if forced, else ``cfg.interleave``)."""
    return (MXFP4_DECODE or (2 if cfg.interleave else 1)) if mxfp4 else 0


ACT_CODES = {"silu": 0, "gpt_oss": 1, "relu2": 2}
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class Config(NamedTuple):
    """Rows per tile (0: by mean tokens per expert, ``block_m_for``), output features
    and K per tile (block_k a multiple of 32, the MXFP4 group), K slices (> 1: fp32
    atomics, not bit-deterministic), warps, pipeline stages; swap: the transposed
    product, the output features as the MMA's M rows (for few rows an expert; in the
    table at 8-64 tokens since a sweep, docs/perf.md); interleave: MXFP4 tiles through the
    interleaved decode instead of the two halves (``MXFP4_DECODES``)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    swap: bool = False
    interleave: bool = False


LOOP = None  # a TABLE entry: the dense torch loop, not the kernel (unpacked experts only)
BUCKETS = (1, 8, 16, 64, 256, 2048, 8192)  # T buckets: the smallest >= T, else the last
FP32_CONFIG = Config(0, 64, 64, 1, 4, 3)  # fp32 models: exact fp32 dots, small tiles
# What the sweep times (and the interpreter tests run), most promising first: a time
# budget cuts the tail. Small T: few rows, so narrow N tiles, long K tiles and K
# splits give the 132 SMs enough programs; large T: wider tiles, more warps; prefill
# T: tall tiles (hundreds of rows per expert).
CANDIDATES = {
    "small": (
        Config(16, 64, 128, 1, 4, 3, True),
        Config(16, 64, 256, 1, 4, 3, True),
        Config(16, 128, 128, 1, 8, 3, True),
        Config(16, 64, 128, 1, 4, 3),
        Config(16, 32, 128, 1, 4, 4),
        Config(16, 64, 128, 2, 4, 3),
        Config(16, 32, 256, 1, 4, 3),
        Config(16, 64, 64, 1, 4, 3),  # the old kernel's tiles
        Config(16, 32, 128, 4, 4, 3),
    ),
    "large": (
        Config(0, 64, 128, 1, 4, 3, True),
        Config(0, 128, 128, 1, 8, 3, True),
        Config(0, 64, 64, 1, 4, 4, True),
        Config(64, 128, 64, 1, 8, 3, True),
        Config(0, 128, 64, 1, 8, 3),
        Config(0, 64, 128, 1, 4, 3),
        Config(64, 128, 64, 1, 8, 4),
        Config(64, 64, 64, 1, 4, 3),
        Config(16, 128, 64, 1, 4, 3),
        # the two-halves MXFP4 decode: 64-value halves (block_k 128) keep 128-byte rows
        Config(64, 128, 128, 1, 8, 3),
        Config(64, 64, 256, 1, 4, 3),
        Config(0, 64, 128, 1, 4, 4),
        Config(64, 128, 128, 1, 4, 3),
        Config(32, 64, 64, 1, 4, 3, True),
        Config(32, 64, 128, 1, 4, 3, True),
        Config(32, 64, 64, 1, 4, 3),
        Config(64, 32, 64, 1, 4, 3),
        Config(64, 64, 64, 1, 4, 2),
        Config(64, 64, 64, 1, 4, 4),
    ),
    "prefill": (
        Config(128, 128, 64, 1, 8, 4),
        Config(128, 64, 64, 1, 4, 4),
        Config(64, 128, 64, 1, 4, 4, True),
        Config(128, 128, 64, 1, 8, 3, True),
        Config(128, 128, 64, 1, 8, 3),
        Config(64, 128, 64, 1, 4, 3),
        Config(128, 64, 64, 1, 4, 3),
        Config(128, 128, 128, 1, 8, 3),
        Config(128, 64, 128, 1, 4, 3),
    ),
}
# 16-bit activations: (bucket, mxfp4) -> Config or LOOP, installed from H200 sweeps
# (``benchmarks/bench_moe.py --sweep`` prints INSTALL lines), gpt-oss's expert shape;
# the sweeps, by commit, with each entry's time: docs/perf.md. Swapped operands win at
# 8-64 tokens (1.04-1.08x the entry before); an integer MXFP4 decode swept then ran
# 0.6-0.9x and was removed. The kernel beat the dense loop at every bucket (2.6-2.9x on
# bf16 experts at decode, 4.7-7.9x at 2048-token prefill chunks), so no entry is LOOP
# today; the dense loop stays the rule's other arm. From 256 tokens up, dense experts
# are stored K-contiguous, as gpt-oss now loads them (1.24-1.90x the N-major storage's
# best tile); 8192 is the engine's prefill chunk; bf16 below 256 tokens: 1-7 % over the
# entries before, timed on the same layout. MXFP4 at 1-256 tokens: the two-halves
# decode's own sweep. Per entry: its time and fraction of the roofline.
TABLE: dict[tuple[int, bool], Config | None] = {
    (1, True): Config(16, 32, 128, 1, 4, 4),  # 93.0 us, 13.7 % of roofline
    (1, False): Config(16, 32, 128, 1, 4, 4),  # 123.2 us, 38.9 % (K-major)
    (8, True): Config(16, 64, 64, 1, 4, 3),  # 320.0 us, 24.0 %
    (8, False): Config(16, 128, 128, 1, 8, 3, True),  # 301.7 us, 75.6 % (K-major)
    (16, True): Config(32, 64, 64, 1, 4, 3, True),  # 329.9 us, 28.1 %
    (16, False): Config(16, 64, 128, 1, 4, 3, True),  # 412.2 us, 84.4 % (K-major)
    (64, True): Config(0, 64, 64, 1, 4, 4, True),  # 362.8 us, 28.2 %
    (64, False): Config(16, 64, 128, 1, 4, 3, True),  # 473.2 us, 81.2 % (505.0 before)
    (256, True): Config(64, 64, 64, 1, 4, 3),  # 511.9 us, 20.1 % (interleaved 594.3)
    (256, False): Config(64, 64, 64, 1, 4, 3),  # 508.9 us, 75.8 % (632.4 N-major)
    (2048, True): Config(128, 64, 64, 1, 4, 3, interleave=True),  # 2202.2 us, 4.9 %
    (2048, False): Config(128, 128, 64, 1, 8, 3),  # 1194.0 us (2060.4 N-major)
    (8192, True): Config(128, 64, 64, 1, 4, 3, interleave=True),  # 6949.3 us
    (8192, False): Config(128, 128, 64, 1, 8, 4),  # 3681.3 us, 57 % of the matmul rate
}
KERNEL_FOR_LOOP = TABLE[256, False]  # ``fused_moe`` where the table says LOOP


def bucket(num_tokens: int) -> int:
    """The table bucket of T tokens: the smallest of ``BUCKETS`` >= T, else the last."""
    return next((b for b in BUCKETS if num_tokens <= b), BUCKETS[-1])


def plan(
    num_tokens: int, mxfp4: bool, dtype: torch.dtype, table: dict | None = None,
    *, at: int | None = None,
):  # fmt: skip
    """The launch for T tokens (host ints): a ``Config`` for the kernel, or ``LOOP``.
    fp32 runs ``FP32_CONFIG`` where the table picks the kernel. at: the bucket the
    step's plan chose (``RowsPlan.moe_bucket``); None: ``bucket(num_tokens)``."""
    cfg = (TABLE if table is None else table)[bucket(num_tokens) if at is None else at, mxfp4]
    assert cfg is not LOOP or not mxfp4, "MXFP4 experts stay packed: never the dense loop"
    return cfg if cfg is LOOP or dtype != torch.float32 else FP32_CONFIG


def moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    w1_scales: torch.Tensor | None = None,
    w2_scales: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    gate_up: str = "concat",
    alpha: float = 1.702,
    limit: float = 7.0,
    sum_dtype: torch.dtype | None = None,
    rows: RowsPlan | None = None,
) -> torch.Tensor:
    """``fused_moe`` or the dense loop (``moe_ref.fused_moe``), as ``plan`` says for
    the step's bucket (``rows``: its ``RowsPlan``; None: T = x.shape[0]'s) and the
    experts' format; same arguments and result (the signature is
    ``kernels/moe/protocols.MoE``)."""
    kw = {"w1_scales": w1_scales, "w2_scales": w2_scales, "b1": b1, "b2": b2,
          "activation": activation, "gate_up": gate_up, "alpha": alpha, "limit": limit,
          "sum_dtype": sum_dtype}  # fmt: skip
    at = None if rows is None else rows.moe_bucket
    cfg = plan(x.shape[0], w1_scales is not None, x.dtype, at=at)
    if cfg is LOOP:
        return moe_ref.fused_moe(x, topk_weights, topk_ids, w1, w2, rows=rows, **kw)
    return fused_moe(x, topk_weights, topk_ids, w1, w2, config=cfg, **kw)


def block_m_for(num_assign: int, num_experts: int) -> int:
    """Rows per tile: about the mean tokens per expert, 16..64 (host ints only)."""
    mean = num_assign // max(num_experts, 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


# the one-program Triton alignment takes steps with M * next_pow2(E) <= this (its one-hot
# work): gpt-oss at B 256 (1,024 x 32) ran in 14 us against about 62 for the torch form
# (docs/perf.md); 4x that work is about where the two would meet, if the time scales with it
ALIGN_KERNEL_MAX_WORK = 1 << 17


def num_blocks_for(m: int, num_experts: int, block_m: int) -> int:
    """Host bound on the BLOCK_M blocks M assignments over E experts can fill."""
    return max(1, min(m, (m + num_experts * (block_m - 1)) // block_m))


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_by_expert_torch``'s result: one Triton launch (``moe_align.py``) where
    its work fits ALIGN_KERNEL_MAX_WORK (decode steps), else the torch form (host ints)."""
    m = topk_ids.numel()
    if m * triton.next_power_of_2(max(num_experts, 2)) <= ALIGN_KERNEL_MAX_WORK:
        blocks = num_blocks_for(m, num_experts, block_m)
        return align_by_expert_kernel(topk_ids, num_experts, block_m, blocks)
    return align_by_expert_torch(topk_ids, num_experts, block_m)


def align_by_expert_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids: (T, k) expert ids -> (sorted_ids (num_blocks * block_m,) int32
    assignment ids (t * k + j) grouped by expert, each run padded to block_m with M =
    T * k; block_experts (num_blocks,) int32 expert of each block, -1 for unused).
    Device ops only, no host sync; num_blocks is a host bound on the blocks used."""
    flat = topk_ids.reshape(-1).long()
    m = flat.numel()
    num_blocks = num_blocks_for(m, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    starts = counts.cumsum(0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(m, device=flat.device) - starts[sorted_experts]
    dest = padded_ends[sorted_experts] - padded[sorted_experts] + rank
    sorted_ids = torch.full((num_blocks * block_m,), m, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_ids, block_experts.to(torch.int32)


def _w_args(w: torch.Tensor, scales: torch.Tensor | None) -> tuple:
    """(scales or a dummy, s_we, s_wn, s_wk, s_se, s_sn) in elements."""
    if scales is None:
        return (w, *w.stride(), 0, 0)
    if w.dtype == torch.float8_e4m3fn:  # block scales (E, rows, cols), contiguous along cols
        return (scales, *w.stride(), scales.stride(0), scales.stride(1))
    return (scales, w.stride(0), w.stride(1), 1, scales.stride(0), scales.stride(1))


def _check_mxfp4_contiguous(w: torch.Tensor, scales: torch.Tensor | None) -> None:
    if scales is not None and (w.stride(3) != 1 or w.stride(2) != 16 or scales.stride(2) != 1):
        raise ValueError("MXFP4 blocks must have contiguous (G, 16) rows and scales (G,) rows")


def check_config(cfg: Config) -> None:
    """ValueError unless the tiles are powers of two >= 16 (block_k >= 32) and the
    split, warps and stages positive."""
    sizes_ok = all(v >= 16 and v & (v - 1) == 0 for v in cfg[1:3]) and cfg.block_k >= 32
    bm_ok = cfg.block_m == 0 or (cfg.block_m >= 16 and cfg.block_m & (cfg.block_m - 1) == 0)
    if not (sizes_ok and bm_ok and min(cfg.split_k, cfg.num_warps, cfg.num_stages) >= 1):
        raise ValueError(
            f"a MoE Config needs block_m 0 or a power of two >= 16, block_n / block_k powers "
            f"of two >= 16 / 32, split_k, num_warps, num_stages >= 1; got {cfg}"
        )


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    w1_scales: torch.Tensor | None = None,
    w2_scales: torch.Tensor | None = None,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    gate_up: str = "concat",
    alpha: float = 1.702,
    limit: float = 7.0,
    sum_dtype: torch.dtype | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """x: (T, d) model dtype; topk_weights: (T, k); topk_ids: (T, k) int32/int64 in
    [0, E) -> (T, d) in x.dtype. Layouts: ``moe_ref.fused_moe``. Accumulates in fp32
    whatever ``sum_dtype`` (kept for the reference's signature). ``config``: the
    launch (None: ``plan``'s kernel config for T, even where ``plan`` says LOOP)."""
    check_moe_args(x, topk_weights, topk_ids, w1, w2, w1_scales, w2_scales, activation, gate_up)
    _check_mxfp4_contiguous(w1, w1_scales)
    _check_mxfp4_contiguous(w2, w2_scales)
    cfg = config or plan(x.shape[0], w1_scales is not None, x.dtype)
    kw = {"b1": b1, "b2": b2, "activation": activation, "gate_up": gate_up, "alpha": alpha,
          "limit": limit}  # fmt: skip
    return launch(x, topk_weights, topk_ids, w1, w2, w1_scales, w2_scales, cfg, **kw)


class Fp8Blocks(NamedTuple):
    """``launch``'s block-scaled FP8 experts: the scales' block (bn rows, bk columns);
    the w*_scales are fp32 multipliers, gate's and up's scale rows each blocked on their
    own (``kernels/moe/fp8.py``)."""

    bn: int
    bk: int


def launch(
    x, topk_weights, topk_ids, w1, w2, w1_scales, w2_scales, cfg, *, b1=None, b2=None,
    activation="silu", gate_up="concat", alpha=1.702, limit=7.0, fp8: Fp8Blocks | None = None,
    w8a8: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The two kernels on checked arguments (``fused_moe``; ``fp8.moe_fp8`` with ``fp8``
    set: w1 / w2 float8_e4m3fn, w*_scales their block scales) under ``cfg`` (LOOP: the
    kernel that replaces the loop) -> (T, d) in x.dtype. ``w8a8`` (``fp8`` set, 16-bit
    x, the K tile inside one scale block: ``fp8.w8a8_fits``): x, then the activation
    between the two kernels, quantised per row and group of ``fp8.bk`` columns
    (``fp8_gemm.quantize_act``; the activation in the gate/up epilogue where
    ``cfg.block_n`` holds whole groups) and FP8 x FP8 dots; it runs unsplit (split_k 1:
    the activation is quantised whole, never from partial sums)."""
    num_experts, m = w1.shape[0], topk_ids.numel()
    inter = w2.shape[2] if w2_scales is None or fp8 is not None else w2.shape[2] * 32
    if m == 0:
        return torch.zeros_like(x)
    if cfg is LOOP:  # asked for the kernel where the table runs the loop
        cfg = FP32_CONFIG if x.dtype == torch.float32 else KERNEL_FOR_LOOP
    if w8a8:
        assert fp8 is not None and fp8.bk % cfg.block_k == 0, "w8a8: K tiles in one scale block"
        cfg = Config(*cfg[:3], 1, *cfg[4:])  # split_k 1
    check_config(cfg)
    block_m = cfg.block_m or block_m_for(m, num_experts)
    sorted_ids, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    geo = (sorted_ids, block_experts, block_m, inter, INTERPRETED or x.dtype == torch.float32)
    interleaved = gate_up == "interleaved"
    row_step = 2 if interleaved and activation != "relu2" else 1
    up_offset = 0 if activation == "relu2" else (1 if interleaved else inter)
    act_args = (row_step, up_offset, float(alpha), float(limit))
    mode = mxfp4_mode(cfg, w1_scales is not None and fp8 is None)
    blocks = (0, 1, 1, 0)  # (FP8 mode, BN, BK, up's first scale row): dense or MXFP4
    if fp8 is not None:
        up_row = 0 if activation == "relu2" else -(-inter // fp8.bn)
        blocks = (3 if w8a8 else fp8_mode(cfg, fp8), fp8.bn, fp8.bk, up_row)
        cfg = fp8_config(cfg, blocks[0])
    xq = xs = a_scales = None
    if w8a8:  # one quantisation pass over x (tokens, not assignments)
        xq, xs = quantize_act(x if x.stride(-1) == 1 else x.contiguous(), fp8.bk)
    a = _gate_up(x, topk_ids.shape[1], w1, w1_scales, b1, activation, act_args, geo, cfg, mode,
                 blocks, xq=xq, xs=xs)  # fmt: skip
    if isinstance(a, tuple):  # quantised in the gate/up kernel's epilogue
        a, a_scales = a
    elif w8a8:  # the activation (rows, I) in x.dtype, quantised as x was
        a, a_scales = quantize_act(a, fp8.bk)
    y = _down(x, a, topk_weights, w2, w2_scales, b1, b2, activation, act_args, geo, cfg, mode,
              blocks, a_scales=a_scales)  # fmt: skip
    return y.view(x.shape[0], -1, x.shape[1]).sum(1).to(x.dtype)


def fp8_mode(cfg: Config, fp8: Fp8Blocks) -> int:
    """The FP8 kernels' scale mode: 1 where a K tile lies inside one scale block (one
    scale per row a tile: the release checkpoints' 128 x 128), 2 otherwise (a scale per
    element, gathered: odd blocks such as 16 x 24)."""
    return 1 if fp8.bk % cfg.block_k == 0 else 2


def fp8_config(cfg: Config, mode: int) -> Config:
    """The launch of FP8 scale mode ``mode``: mode 2 pipelines its per-element scale
    tiles too, which took 299 KB of shared memory at the 8-token entry's three stages
    (sm_90 allows 227 KB: ``tests/kernels/test_kernels_sm90_compile.py``), so it runs
    unpipelined (one stage); mode 1 keeps the table's launch."""
    if mode != 2:
        return cfg
    return Config(cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, 1,
                  cfg.swap, cfg.interleave)  # fmt: skip


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks (..., G, 16) uint8 and scales (..., G) -> bf16 (..., G * 32) in k
    order, through the fused MoE's own decode (``moe_triton._decode_mxfp4``: its inline
    PTX on CUDA); ``mxfp4_ref.dequantize_mxfp4`` is the reference (transposed)."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks must be uint8 (..., G, 16) with uint8 scales (..., G); got "
            f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}"
        )
    groups = scales.shape[-1]
    rows = scales.numel() // max(groups, 1)
    out = torch.empty(*scales.shape[:-1], groups * 32, dtype=torch.bfloat16, device=blocks.device)
    if out.numel():
        grid = (triton.cdiv(rows, 32), triton.cdiv(groups, 4))
        _decode_kernel[grid](blocks.contiguous(), scales.contiguous(), out, rows, groups,
                             ASM=not INTERPRETED, BLOCK_R=32, BLOCK_G=4)  # fmt: skip
    return out


def permute_groups(x: torch.Tensor) -> torch.Tensor:
    """x (T, d) with each group of 32 columns reordered [even | odd] (``perm_col``:
    column 32g + 2i + h at 32g + 16h + i): the two-halves MXFP4 decode's A order."""
    t, d = x.shape
    return x.view(t, d // 32, 16, 2).transpose(2, 3).reshape(t, d)


def _gate_up(x, top_k, w1, s1, b1, activation, act_args, geo, cfg, mode, blocks, xq=None,
             xs=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gate/up kernel -> act (rows, I) in x.dtype, or zero-started fp32 gate|up
    sums (rows, 2I) when ``cfg.split_k`` > 1; with the two-halves MXFP4 decode (mode
    1) it reads x permuted (``permute_groups``) and writes its columns permuted. W8A8
    (``blocks[0]`` 3): it reads ``xq`` (x in FP8) and its group scales ``xs``; where its
    N tile holds whole groups (``cfg.block_n % bk == 0``) its epilogue quantises the
    activation too -> (act (rows, I) FP8, scales (rows, cdiv(I, bk)) fp32)."""
    sorted_ids, block_experts, block_m, inter, ieee = geo
    rows, split = sorted_ids.shape[0], cfg.split_k
    quant_out = blocks[0] == 3 and cfg.block_n % blocks[2] == 0
    out_scales = None
    if split > 1:
        out = torch.zeros(rows, 2 * inter, dtype=torch.float32, device=x.device)
    elif quant_out:
        out = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=x.device)
        groups = triton.cdiv(inter, blocks[2])
        out_scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    dtype = TL_DTYPES[x.dtype]
    bias = b1 if b1 is not None else x
    if mode == 1:
        x = permute_groups(x)
    scales = x if xs is None else xs  # a placeholder pointer where x is not quantised
    if xq is not None:
        x = xq
    grid = (block_experts.shape[0], triton.cdiv(inter, cfg.block_n), split)
    _gate_up_kernel[grid](
        x, w1, *_w_args(w1, s1)[:1], bias, out, sorted_ids, block_experts,
        x.shape[0] * top_k, top_k, x.shape[1], inter,
        *x.stride(), *_w_args(w1, s1)[1:], bias.stride(0), bias.stride(-1), *out.stride(),
        *act_args, blocks[3], scales, scales.stride(0) if xs is not None else 0,
        out if out_scales is None else out_scales, 0 if out_scales is None else out_scales.stride(0),
        ACT=ACT_CODES[activation], MXFP4=mode,
        HAS_BIAS=b1 is not None, IEEE=ieee,
        SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SWAP=bool(cfg.swap), ASM=not INTERPRETED, FP8=blocks[0], BN=blocks[1], BK=blocks[2],
        QUANT_OUT=quant_out, DTYPE=dtype, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out if out_scales is None else (out, out_scales)


def _down(x, a, topk_weights, w2, s2, b1, b2, activation, act_args, geo, cfg, mode, blocks,
          a_scales=None):  # fmt: skip
    """The down kernel -> y (M, d) fp32, each assignment's weighted expert output (W8A8:
    ``a`` in FP8 with its group scales ``a_scales``)."""
    sorted_ids, block_experts, block_m, inter, ieee = geo
    m, d, split = topk_weights.numel(), x.shape[1], cfg.split_k
    alloc = torch.zeros if split > 1 else torch.empty
    y = alloc(m, d, dtype=torch.float32, device=x.device)
    bias2 = b2 if b2 is not None else x
    bias1 = b1 if b1 is not None and split > 1 else x
    grid = (block_experts.shape[0], triton.cdiv(d, cfg.block_n), split)
    _down_kernel[grid](
        a, w2, *_w_args(w2, s2)[:1], bias2, bias1, topk_weights.reshape(-1), y,
        sorted_ids, block_experts, m, d, inter,
        *a.stride(), *_w_args(w2, s2)[1:], bias2.stride(0), bias2.stride(-1),
        bias1.stride(0), bias1.stride(-1), *y.stride(), *act_args,
        y if a_scales is None else a_scales, 0 if a_scales is None else a_scales.stride(0),
        MXFP4=mode, HAS_BIAS=b2 is not None,
        IEEE=ieee, ACT_IN_A=split > 1,
        ACT=ACT_CODES[activation], HAS_B1=b1 is not None and split > 1,
        DTYPE=TL_DTYPES[x.dtype], SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SWAP=bool(cfg.swap), ASM=not INTERPRETED,
        FP8=blocks[0], BN=blocks[1], BK=blocks[2],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y
