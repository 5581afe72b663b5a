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

The tiles: ``TABLE`` (by ``fused.bucket(T)``, from ``bench_moe.py --fp8 --sweep``),
else the 16-bit table's entry for T (``fused.plan``), never the dense loop (which would
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

# bucket -> Config for 16-bit activations over FP8 experts; a bucket not here takes the
# 16-bit experts' entry (``fused.TABLE``). Empty: no FP8 sweep has been installed yet
TABLE: dict[int, fused.Config] = {}


def plan(num_tokens: int, dtype: torch.dtype, at: int | None = None) -> fused.Config | None:
    """The launch for T tokens (host ints): ``TABLE``'s entry for T's bucket (``at``: the
    step's ``RowsPlan.moe_bucket``; None: ``fused.bucket(T)``), else the 16-bit table's
    (LOOP there: ``fused.launch`` runs the kernel that replaces it)."""
    if dtype == torch.float32:
        return fused.FP32_CONFIG
    bucket = fused.bucket(num_tokens) if at is None else at
    return TABLE.get(bucket) or fused.plan(num_tokens, False, dtype, at=bucket)


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
) -> torch.Tensor:
    """``fp8_gemm_ref.moe_fp8``'s result (signature: ``kernels/linear/protocols.MoEFp8``)
    with the experts dequantised per tile inside the fused kernels. Accumulates in fp32
    whatever ``sum_dtype``; ``config``: the launch (None: the plan for the step's bucket,
    ``rows.moe_bucket``, or T's without a plan)."""
    check_moe_args(x, topk_weights, topk_ids, w1, w2, None, None, activation, "concat")
    check_fp8_experts(x, w1, w1_scale, w2, w2_scale, tuple(block), activation)
    cfg = config or plan(x.shape[0], x.dtype, None if rows is None else rows.moe_bucket)
    blocks = fused.Fp8Blocks(*block)
    s1, s2 = w1_scale.contiguous(), w2_scale.contiguous()  # no copy when loaded contiguous
    return fused.launch(x, topk_weights, topk_ids, w1, w2, s1, s2, cfg, activation=activation,
                        fp8=blocks)  # fmt: skip
