"""The fused MoE over block-scaled FP8 experts, dequantised per tile (the Triton backend's
``moe_fp8``; the torch reference is ``kernels/linear/fp8_gemm_ref.moe_fp8``).

Experts as a DeepSeek-V3 / MiMo / Qwen3-FP8 checkpoint holds them (``models/moe.py``):

    w1 (E, N1, d) float8_e4m3fn   N1 = 2I: rows [gate (I) | up (I)] (relu2: I, up only)
    w1_scale (E, parts * ceil(I / bn), ceil(d / bk)) fp32   each part blocked on its own
    w2 (E, d, I) float8_e4m3fn,  w2_scale (E, ceil(d / bn), ceil(I / bk)) fp32

The fused MoE's two kernels (``fused.launch``) load each (BLOCK_N, BLOCK_K) weight tile
as FP8 (one byte an element: half the 16-bit experts' weight stream), widen it to fp32,
multiply it by its blocks' multipliers and round it to the activation's dtype before
the dot (``fused_kernels._fp8_tile``): the dot's operand is the reference's dequantised
weight element for element, and no dequantised copy of the experts is ever written.
The activations stay 16-bit (or fp32: IEEE fp32 dots); they are not quantised.

W8A8 (prefill): there the 16-bit dot is the cost (0.73x the bf16 kernel at T 2048 on an
H100), so for a step of at least ``W8A8_MIN_TOKENS`` rows (``w8a8_rows``, the step's
``RowsPlan.moe_w8a8``) the activations are quantised to float8_e4m3fn per row and
group of bk columns (DeepSeek-V3's recipe: ``fp8_gemm.quantize_act``, one pass over x's
tokens; the activation between the two kernels in the gate/up kernel's epilogue where
its N tile holds whole groups, else in a second pass) and the dots run FP8 x FP8
with fp32 accumulation, each K tile's product times its activation scale and weight
block scale (``fused_kernels._dot8``). Its reference is ``fp8_gemm_ref.moe_fp8_w8a8``.
It needs 16-bit x and a K tile inside one scale block (``w8a8_fits``, the layer's part,
fixed for its life); elsewhere the rows' choice falls back to 16-bit activations.

The tiles: ``TABLE`` (by (``fused.bucket(T)``, w8a8), from ``bench_moe.py --fp8 --sweep``),
else (W8A8) the 16-bit activations' entry, else the 16-bit table's entry for T
(``fused.plan``), never the dense loop (which would
need dequantised experts); fp32 runs ``fused.FP32_CONFIG``. Where the K tile lies in one scale
block (``bk % block_k == 0``: 128-column blocks and the table's 64 / 128 tiles) a
tile row takes one multiplier; otherwise (a K tile spanning two blocks, odd block
sizes) one multiplier is gathered per element: correct for any block, but the gather is
a (BLOCK_N, BLOCK_K) fp32 tile through the load pipeline (a 256-column K tile over
128-column blocks needs 344 KiB of shared memory on sm_90), so it is for the tiny test
models' odd blocks, and the sweep (``bench_moe.py --fp8 --sweep``) skips such tiles. An N tile may span several scale rows
(each row takes its own), and gate's and up's rows find their own scale rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from unikv.kernels.moe import fused
from unikv.kernels.moe.ref import check_moe_args

if TYPE_CHECKING:
    from unikv.kernels.backend import RowsPlan

C = fused.Config
# (bucket, w8a8) -> Config over FP8 experts (w8a8 False: 16-bit activations); a key not
# here takes (bucket, False)'s entry, else the 16-bit experts' (``fused.TABLE``). From
# ``bench_moe.py --fp8 --sweep`` (docs/perf.md: the device, the run and each entry's
# speed against the bf16 kernel)
TABLE: dict[tuple[int, bool], fused.Config] = {
    (1, False): C(16, 64, 128, 1, 4, 3, True, False),
    (1, True): C(16, 64, 128, 1, 4, 3, True, False),
    (8, False): C(16, 64, 128, 1, 4, 3, True, False),
    (8, True): C(16, 64, 128, 1, 4, 3, True, False),
    (16, False): C(16, 64, 128, 1, 4, 3, True, False),
    (16, True): C(16, 64, 128, 1, 4, 3, True, False),
    (64, False): C(16, 64, 128, 1, 4, 3, True, False),
    (64, True): C(16, 64, 128, 1, 4, 3, True, False),
    (256, False): C(64, 64, 64, 1, 4, 3, False, False),
    (256, True): C(64, 64, 128, 1, 4, 3, False, False),
    (2048, False): C(128, 128, 64, 1, 8, 4, False, False),
}  # fmt: skip
# W8A8 from this many rows up (``w8a8_rows``). The same sweep has W8A8 ahead at every
# timed T (docs/perf.md), so prefill (T >= 256) takes it; decode keeps 16-bit
# activations (W8A8's rms vs bf16 is 0.043 there: a change of numerics that the FP8
# models' GPU tests have not run with)
W8A8_MIN_TOKENS = 256
# What ``bench_moe.py --fp8 --sweep`` times, by (w8a8, T range), most promising first:
# "small" T <= 64 (decode), "prefill" above. 16-bit activations: the 16-bit table's
# winners at these buckets and their neighbours (K tiles inside a 128-column block);
# W8A8: K tiles of 128 (a 128-byte FP8 row, four of wgmma's K steps), tall tiles for
# prefill. Kept short: the sweep compiles each once and must finish in ~2 minutes
SWEEP = {
    (False, "small"): (C(16, 32, 128, 1, 4, 4), C(16, 128, 128, 1, 8, 3, True),
                       C(16, 64, 128, 1, 4, 3, True), C(16, 64, 128, 2, 4, 3),
                       C(16, 32, 128, 4, 4, 3), C(16, 64, 64, 1, 4, 3)),
    (False, "prefill"): (C(128, 128, 64, 1, 8, 3), C(128, 128, 64, 1, 8, 4),
                         C(64, 64, 64, 1, 4, 3), C(128, 64, 64, 1, 4, 3)),
    (True, "small"): (C(16, 64, 128, 1, 4, 3, True), C(16, 128, 128, 1, 8, 3, True),
                      C(16, 32, 128, 1, 4, 4)),
    # compiled for sm_90 (``benchmarks/aot_sm90.py``): the gate/up kernel spills 0 (N
    # tiles of 64) to 896 bytes (128 x 128 x 128, whose epilogue quantises the activation)
    (True, "prefill"): (C(128, 64, 128, 1, 8, 3), C(128, 128, 128, 1, 8, 3),
                        C(128, 64, 128, 1, 8, 4), C(64, 64, 128, 1, 4, 3),
                        C(128, 128, 64, 1, 8, 4), C(64, 128, 128, 1, 4, 3)),
}  # fmt: skip


def w8a8_rows(num_tokens: int) -> bool:
    """The rows' part of the choice (host ints): W8A8 for a step of at least
    ``W8A8_MIN_TOKENS`` tokens (each bucket has a table entry for either variant). The
    step planner applies it once per step (``RowsPlan.moe_w8a8``); a call without a
    plan applies it to x's rows."""
    return num_tokens >= W8A8_MIN_TOKENS


def w8a8_fits(dtype: torch.dtype, block: tuple[int, int], cfg: fused.Config) -> bool:
    """The layer's part: W8A8 runs for 16-bit x where ``cfg``'s K tile lies inside one
    scale block (one activation and one weight scale per row a K tile)."""
    return dtype in (torch.bfloat16, torch.float16) and block[1] % cfg.block_k == 0


def plan(
    num_tokens: int, dtype: torch.dtype, at: int | None = None, w8a8: bool = False
) -> fused.Config | None:
    """The launch for T tokens (host ints): ``TABLE``'s entry for (T's bucket, w8a8)
    (``at``: the step's ``RowsPlan.moe_bucket``; None: ``fused.bucket(T)``), else (W8A8)
    the 16-bit activations' entry, else the 16-bit table's (LOOP there: ``fused.launch``
    runs the kernel that replaces it)."""
    if dtype == torch.float32:
        return fused.FP32_CONFIG
    bucket = fused.bucket(num_tokens) if at is None else at
    return (
        TABLE.get((bucket, w8a8))
        or TABLE.get((bucket, False))
        or fused.plan(num_tokens, False, dtype, at=bucket)
    )


def check_fp8_experts(x, w1, w1_scale, w2, w2_scale, block, activation) -> None:
    """ValueError unless w1 / w2 are float8_e4m3fn with fp32 block scales of the shapes
    the module docstring gives for ``block`` (the stacks' own shapes: ``check_moe_args``)."""
    if w1.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"moe_fp8: w1 and w2 must be float8_e4m3fn, got {w1.dtype} and {w2.dtype}; "
            "16-bit experts run the backend's moe"
        )
    bn, bk = block
    if not (isinstance(bn, int) and isinstance(bk, int) and bn > 0 and bk > 0):
        raise ValueError(f"moe_fp8: block must be two positive ints (bn, bk), got {block}")
    e, d, inter = w1.shape[0], x.shape[1], w2.shape[2]
    parts = 1 if activation == "relu2" else 2
    want1 = (e, parts * -(-inter // bn), -(-d // bk))
    want2 = (e, -(-d // bn), -(-inter // bk))
    for name, s, want in (("w1_scale", w1_scale, want1), ("w2_scale", w2_scale, want2)):
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ValueError(
                f"moe_fp8: {name} must be fp32 {want} for experts w1 {tuple(w1.shape)}, w2 "
                f"{tuple(w2.shape)} in blocks of {list(block)} ({activation}: {parts} "
                f"part(s) blocked on their own), got {s.dtype} {tuple(s.shape)}"
            )


def moe_fp8(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    block: tuple[int, int],
    activation: str = "silu",
    sum_dtype: torch.dtype | None = None,
    rows: RowsPlan | None = None,
    config: fused.Config | None = None,
    w8a8: bool | None = None,
) -> torch.Tensor:
    """``fp8_gemm_ref.moe_fp8``'s result (signature: ``kernels/linear/protocols.MoEFp8``)
    with the experts dequantised per tile inside the fused kernels, or, W8A8,
    ``fp8_gemm_ref.moe_fp8_w8a8``'s. Accumulates in fp32 whatever ``sum_dtype``.
    ``w8a8``: None: the step's choice (``rows.moe_w8a8``; without a plan ``w8a8_rows`` of
    x's rows), where it fits the layer (``w8a8_fits``, else 16-bit activations); True /
    False: forced (the benchmark; True where it does not fit is a ValueError).
    ``config``: the launch (None: the plan for the step's bucket, ``rows.moe_bucket``, or
    T's without a plan, and the variant)."""
    check_moe_args(x, topk_weights, topk_ids, w1, w2, None, None, activation, "concat")
    block = tuple(block)
    check_fp8_experts(x, w1, w1_scale, w2, w2_scale, block, activation)
    at = None if rows is None else rows.moe_bucket
    want = w8a8
    if want is None:
        want = w8a8_rows(x.shape[0]) if rows is None else rows.moe_w8a8
    cfg = config or plan(x.shape[0], x.dtype, at, want)
    fits = want and w8a8_fits(x.dtype, block, cfg)
    if w8a8 and not fits:
        raise ValueError(
            f"moe_fp8: W8A8 needs 16-bit x and a K tile inside one scale block (block_k "
            f"dividing {block[1]}); got x {x.dtype}, block_k {cfg.block_k}: pass w8a8=None "
            "or False, or a config whose block_k divides the block"
        )
    if want and not fits and config is None:  # the 16-bit activations' tiles
        cfg = plan(x.shape[0], x.dtype, at, False)
    blocks = fused.Fp8Blocks(*block)
    s1, s2 = w1_scale.contiguous(), w2_scale.contiguous()  # no copy when loaded contiguous
    return fused.launch(x, topk_weights, topk_ids, w1, w2, s1, s2, cfg, activation=activation,
                        fp8=blocks, w8a8=bool(fits))  # fmt: skip
