"""Block-scaled FP8 linear: the torch reference (the torch backend's ``fp8_linear``).

A weight kept in FP8 (``models/fp8_linear.Fp8BlockLinear``) is ``weight`` (N, K)
float8_e4m3fn with ``scale_inv`` (ceil(N / bn), ceil(K / bk)) fp32, one multiplier
per block of bn rows x bk columns (edge blocks partial). The real weight is

    W[n, k] = float(weight[n, k]) * scale_inv[n // bn, k // bk]      (fp32)

and ``fp8_linear(x, weight, scale_inv, bias, block=(bn, bk))`` is ``x @ W^T + bias``
in fp32, cast to x's dtype. The reference dequantises the whole weight each call
(a CPU reference for tiny models; the GPU runs ``kernels/linear/fp8_gemm.py``).

``quantize_act`` is the activation side of the GPU's prefill variant (DeepSeek's
dynamic scheme): each row of x split in groups of ``group`` columns, a group scaled so
its largest |value| maps to the e4m3 maximum (448). ``fp8_linear_w8a8`` is that
variant's reference: both operands quantised, then multiplied in fp32.
``fp8_linear_quantized`` is its second half, for an x quantised before the call (by
the pre-norm, ``add_rms_norm_quant``: ``Fp8Quant`` says how); the torch backend's
``fp8_act_quant`` never asks for that (its ``fp8_linear`` does not quantise x).
``moe_fp8_w8a8`` is the same scheme for the fused MoE over FP8 experts (the W8A8
prefill variant of ``kernels/moe/fp8.py``), in fp32 or (``exact``) in fp64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from unikv.kernels.backend import RowsPlan

FP8_MAX = 448.0  # largest finite float8_e4m3fn
ACT_SCALE_MIN = 1e-12  # an all-zero group keeps a finite scale


class Fp8Quant(NamedTuple):
    """How an FP8 linear's prefill variant quantises x (``fp8_act_quant``): per row and
    ``group`` columns (the weight's bk), its scales (M, groups) row-major (the Triton
    w8a8 GEMM) or M-major, strides (1, M) (``m_major``: cuBLAS's ``_scaled_mm``)."""

    group: int
    m_major: bool


def fp8_act_quant(
    m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype,
    rows: RowsPlan | None = None,
) -> Fp8Quant | None:  # fmt: skip
    """The torch reference never quantises x (``fp8_linear`` multiplies it as it is):
    None for every shape and row count."""
    return None


def check_operands(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block, out_features=None
) -> None:
    """ValueError unless x is (..., K) float, weight (N, K) float8_e4m3fn and scale_inv
    fp32 (ceil(N / bn), ceil(K / bk)), and ``out_features`` (the real rows of a weight
    held padded) None or 1..N."""
    bn, bk = block
    n, k = weight.shape if weight.dim() == 2 else (None, None)
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"fp8_linear: weight must be a float8_e4m3fn (N, K) matrix, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    if x.shape[-1] != k or not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise ValueError(
            f"fp8_linear: x must be (..., {k}) fp32/bf16/fp16 for a weight of shape "
            f"{tuple(weight.shape)}, got {x.dtype} {tuple(x.shape)}"
        )
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected or scale_inv.dtype != torch.float32:
        raise ValueError(
            f"fp8_linear: scale_inv must be fp32 of shape {expected} (weight {tuple(weight.shape)}"
            f" in blocks of {list(block)}), got {scale_inv.dtype} {tuple(scale_inv.shape)}"
        )
    if out_features is not None and not 0 < out_features <= n:
        raise ValueError(
            f"fp8_linear: out_features (the weight's real rows) must be 1..{n} for a weight "
            f"held as {tuple(weight.shape)}, got {out_features}"
        )


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """(N, K) fp8 and its block scales -> the fp32 weight (one fp32 product each)."""
    bn, bk = block
    n, k = weight.shape
    scales = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * scales


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block: tuple[int, int],
    rows: RowsPlan | None = None,
    out_features: int | None = None,
) -> torch.Tensor:
    """x (..., K) @ dequantize(weight, scale_inv)^T (+ bias) in fp32 -> (..., N) in x.dtype
    (one path at every row count: ``rows``, the step's plan, changes nothing).
    ``out_features``: N, the real rows of a weight held padded (``padded_rows``): the
    product of every held row, then its first N columns (a view, as the GPU's)."""
    check_operands(x, weight, scale_inv, block, out_features)
    n = weight.shape[0] if out_features is None else out_features
    out = F.linear(x.float(), dequantize(weight, scale_inv, block))  # (..., held rows)
    if bias is not None:
        out[..., :n] += bias.float()
    out = out.to(x.dtype)
    return out if n == weight.shape[0] else out[..., :n]


def padded_rows(n: int, k: int, block) -> int:
    """The reference multiplies any shape: an FP8 weight is held as it is (n rows)."""
    return n


def quantize_act(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (xq (M, K) float8_e4m3fn, scales (M, ceil(K / group)) fp32) with
    x ~= xq * scales per group of ``group`` columns (the Triton kernel's arithmetic:
    scale = max(amax / 448, 1e-12), xq = fp8(x / scale))."""
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(-1)  # (M, G)
    # amax / 448 as an IEEE division on every device: torch's CUDA kernel multiplies by
    # the reciprocal when the divisor is a Python scalar (one ulp off, now and then)
    scales = amax.div(torch.full_like(amax, FP8_MAX)).clamp(min=ACT_SCALE_MIN)
    xq = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq.view(m, groups * group)[:, :k], scales


def fp8_linear_w8a8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block: tuple[int, int],
) -> torch.Tensor:
    """The prefill variant's reference: x quantised per token and group of bk columns
    (``quantize_act``), both operands dequantised, multiplied in fp32, cast to x.dtype."""
    check_operands(x, weight, scale_inv, block)
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_act(x2, block[1])
    xd = dequantize(xq, xs, (1, block[1]))
    out = F.linear(xd, dequantize(weight, scale_inv, block))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


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
) -> torch.Tensor:
    """``fp8_linear_w8a8`` from x already quantised: xq (M, K) float8_e4m3fn with xs (M,
    ceil(K / bk)) fp32 (any strides), both operands dequantised, multiplied in fp32,
    (+ bias), cast to ``out_dtype``; ``out_features`` as ``fp8_linear`` (a view of the
    real rows)."""
    check_quantized(xq, xs, weight, block)
    check_operands(xq.new_empty(0, xq.shape[-1], dtype=torch.float32, device="meta"),
                   weight, scale_inv, block, out_features)  # fmt: skip
    n = weight.shape[0] if out_features is None else out_features
    out = F.linear(dequantize(xq, xs, (1, block[1])), dequantize(weight, scale_inv, block))
    if bias is not None:
        out[:, :n] += bias.float()
    out = out.to(out_dtype)
    return out if n == weight.shape[0] else out[:, :n]


def check_quantized(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, block) -> None:
    """ValueError unless xq is (M, K) float8_e4m3fn for the weight's K and xs fp32 (M,
    ceil(K / bk)): the pre-quantised FP8 linear's activation operands."""
    k = weight.shape[-1]
    groups = -(-k // block[1])
    if xq.dim() != 2 or xq.shape[1] != k or xq.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"fp8_linear_quantized: xq must be float8_e4m3fn (M, {k}) for a weight of shape "
            f"{tuple(weight.shape)}, got {xq.dtype} {tuple(xq.shape)}"
        )
    if tuple(xs.shape) != (xq.shape[0], groups) or xs.dtype != torch.float32:
        raise ValueError(
            f"fp8_linear_quantized: xs must be fp32 ({xq.shape[0]}, {groups}) (a scale per row "
            f"and group of {block[1]}), got {xs.dtype} {tuple(xs.shape)}"
        )


MOE_CHUNK_BYTES = 1 << 30  # 16-bit expert bytes dequantised at once by ``moe_fp8``


def dequantize_experts(
    w: torch.Tensor, scale: torch.Tensor, parts: int, block, dtype: torch.dtype
) -> torch.Tensor:
    """Stacked FP8 experts (E, parts * R, K) with scales (E, parts * ceil(R / bn),
    ceil(K / bk)), each part blocked on its own -> the real weights (E, parts * R, K)
    in ``dtype`` (each element one fp32 product, then rounded)."""
    e, rows, k = w.shape
    (bn, bk), r = block, rows // parts
    s = scale.float().view(e, parts, -1, scale.shape[-1])  # (E, parts, ceil(R / bn), .)
    s = s.repeat_interleave(bn, dim=2)[:, :, :r].repeat_interleave(bk, dim=3)[..., :k]
    return (w.view(e, parts, r, k).float() * s).view(e, rows, k).to(dtype)


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
    moe=None,
    chunk_bytes: int = MOE_CHUNK_BYTES,
) -> torch.Tensor:
    """The fused MoE over block-scaled FP8 experts: ``w1`` (E, N1, d) float8_e4m3fn with
    ``w1_scale`` (E, parts * ceil(I / bn), ceil(d / bk)) (parts: gate and up, each
    blocked on its own; relu2: one), ``w2`` (E, d, I) with ``w2_scale`` (E, ceil(d / bn),
    ceil(I / bk)); other arguments as ``moe_ref.fused_moe`` (``rows``, the step's plan,
    goes to ``moe``).

    The experts are dequantised to x.dtype per call, ``chunk_bytes`` of them at a time,
    and run by ``moe`` (a dense MoE op, ``moe_ref.fused_moe`` by default); with several
    chunks each runs every token, its choices outside the chunk sent to zero experts with
    zero weight (no host sync), and their outputs are summed in fp32. One chunk (the tiny models'
    case) is exactly ``moe`` on the dequantised experts. The torch backend's op and the
    reference of the Triton backend's (``kernels/moe/fp8.py``, which dequantises per
    tile inside the fused kernels and never writes a dequantised expert)."""
    if moe is None:
        from unikv.kernels.moe.ref import fused_moe as moe
    if w1.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"moe_fp8: w1 and w2 must be float8_e4m3fn, got {w1.dtype} and {w2.dtype}; "
            "16-bit experts run the backend's moe"
        )
    parts = 1 if activation == "relu2" else 2
    experts = w1.shape[0]
    per_expert = (w1[0].numel() + w2[0].numel()) * x.element_size()
    step = max(1, min(experts, chunk_bytes // max(1, per_expert)))
    kw = {"activation": activation, "sum_dtype": sum_dtype, "rows": rows}
    if step == experts:
        a = dequantize_experts(w1, w1_scale, parts, block, x.dtype)
        b = dequantize_experts(w2, w2_scale, 1, block, x.dtype)
        return moe(x, topk_weights, topk_ids, a, b, **kw)
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    k = topk_ids.shape[1]
    slots = torch.arange(k, device=topk_ids.device)
    for e0 in range(0, experts, step):
        e1 = min(e0 + step, experts)
        # a choice outside the chunk goes to one of k zero experts after it (slot j to
        # the j-th, so a token's choices stay distinct), with zero weight
        mine = (topk_ids >= e0) & (topk_ids < e1)
        ids = torch.where(mine, topk_ids - e0, (e1 - e0) + slots)
        weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
        a = dequantize_experts(w1[e0:e1], w1_scale[e0:e1], parts, block, x.dtype)
        b = dequantize_experts(w2[e0:e1], w2_scale[e0:e1], 1, block, x.dtype)
        a = torch.cat([a, a.new_zeros(k, *a.shape[1:])])
        b = torch.cat([b, b.new_zeros(k, *b.shape[1:])])
        total += moe(x, weights, ids, a, b, **kw).float()
    return total.to(x.dtype)


def _act_fp32(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    """The fused MoE's gated activation on fp32 gate / up (``moe_ref``'s definitions,
    gpt_oss at its default alpha 1.702 and limit 7.0; relu2 ignores g)."""
    if activation == "silu":
        return F.silu(g) * u
    if activation == "relu2":
        return torch.relu(u).square()
    gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    return (uc + 1) * (gc * torch.sigmoid(gc * 1.702))


def _dequantize_at(q: torch.Tensor, scales: torch.Tensor, block, dtype) -> torch.Tensor:
    """(N, K) fp8 codes and their fp32 block multipliers -> ``dtype``: fp32, one rounded
    fp32 product each (``dequantize``'s); fp64, each element exact (an e4m3 value has 4
    significant bits and an fp32 multiplier 24: the product fits 53)."""
    bn, bk = block
    n, k = q.shape
    s = scales.to(dtype).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float().to(dtype) * s  # fp8 -> fp32 -> dtype, each exact


def moe_fp8_w8a8(
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
    with_act: bool = False,
    exact: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 fused MoE over FP8 experts (``moe_fp8``'s arguments; 16-bit x), from its
    definition:

        xd = x quantised per token and group of bk columns (``quantize_act``), dequantised
        per expert e, on its routed tokens' rows of xd:
            g, u = xd @ Wgate_e^T, xd @ Wup_e^T        (W dequantised, each part blocked
                                                        on its own)
            a    = act(g, u) rounded to x.dtype        (the kernel stores it so)
            ad   = a quantised per row and group of bk, dequantised
            y    = (ad @ Wdown_e^T) * routing weight
        out = sum over the token's k choices.

    ``exact`` False (the kernel's reference): operands dequantised to fp32, every
    product and sum in fp32, the (T, d) result cast to x.dtype. True (its exact
    description): the same codes and scales dequantised exactly to fp64, every product
    and sum in fp64, the result left in fp64, unrounded. The fp32 reference and the
    kernel each sit at a distance from the exact one (their sums' rounding, then the
    output's bf16 rounding): ``w8a8_errors`` measures it, ``W8A8_RMS_BOUND`` and
    ``W8A8_ROW_BOUND`` bound it.

    One expert's weights at a time (the GPU benchmark's shapes fit); syncs the host
    (``torch.where`` per expert): a reference, never on the engine's path. ``with_act``:
    also the activation each assignment t * k + j quantises, (T * k, I) in x.dtype (a
    diagnostic: where a side's codes move)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"moe_fp8_w8a8: x must be bf16 or fp16 (W8A8 is a 16-bit path), got {x.dtype}"
        )
    dtype = torch.float64 if exact else torch.float32
    bk, parts = block[1], 1 if activation == "relu2" else 2
    rows1 = w1.shape[1]
    xq, xs = quantize_act(x, bk)
    xd = _dequantize_at(xq, xs, (1, bk), dtype)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    k = topk_ids.shape[1]
    acts = x.new_zeros(x.shape[0] * k, w2.shape[2]) if with_act else None
    for e in range(w1.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if not token.numel():
            continue
        s1 = w1_scale[e].view(parts, -1, w1_scale.shape[-1])  # each part blocked on its own
        wa = torch.cat([_dequantize_at(p, s, block, dtype) for p, s in
                        zip(w1[e].view(parts, rows1 // parts, -1), s1, strict=True)])  # fmt: skip
        gu = xd[token] @ wa.t()
        g, u = (gu, gu) if parts == 1 else gu.chunk(2, dim=-1)
        a = _act_fp32(g, u, activation).to(x.dtype)
        if acts is not None:
            acts[token * k + slot] = a
        aq, a_s = quantize_act(a, bk)
        wb = _dequantize_at(w2[e], w2_scale[e], block, dtype)
        y = _dequantize_at(aq, a_s, (1, bk), dtype) @ wb.t()
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(dtype))
    out = out if exact else out.to(x.dtype)
    return (out, acts) if acts is not None else out


# The W8A8 MoE's distance to its exact description (``moe_fp8_w8a8(exact=True)``), as relative
# rms: ||got - exact|| / ||exact|| over the whole (T, d) output, and over each row. Sources:
# - the output's rounding to bf16: an error uniform over +-ulp / 2, ulp <= 2^-7 of the
#   element, so rms <= 2^-7 / sqrt(12) = 2.3e-3 of the output (observed 1.7e-3);
# - the intermediate's codes: the activation is rounded to bf16 and quantised to e4m3,
#   both discontinuous, so a sum rounded otherwise (fp32 in another order; on sm_90
#   the FP8 MMA's own accumulation, which Triton keeps for a whole K tile: its default
#   ``max_num_imprecise_acc`` there is 2^30) puts an element near a rounding boundary
#   on the other side: its code moves one e4m3 step (2^-4 .. 2^-3 of it) instead of staying within
#   half a step. Allowing 1/64 of the codes to move adds sqrt(1/64) x 2^-4 = 7.8e-3.
# Together sqrt(2.3e-3^2 + 7.8e-3^2) = 8.1e-3 (``W8A8_RMS_BOUND``). Per row
# (``W8A8_ROW_BOUND``): moved codes cluster (a group's scale moves with its largest
# element), so a row may lose more, but even every code of a row one step off (<= 2^-3 of
# each activation element) keeps the row's rms error within 2^-3 of its rms; a wrong row
# (garbage, a wrong expert or scale) is off by O(1). The max error over max |output| (the
# earlier 1 % check) is a tail statistic: one moved code of a large activation element
# moves an output row by up to ~10 % of the row's rms at one column, so its maximum grows
# with T x d and crossed 1 % at T 2048 with neither side wrong (docs/perf.md). Measured on
# CPU (E 8, top-2, d 1024, I 512, T 2048; overall / worst row): the exact result rounded
# to bf16 1.7e-3 / 1.9e-3, the fp32 reference 1.7e-3 overall; gate / up sums perturbed by
# 1e-7 of their absolute terms (about fp32's) 1.7e-3 / 3.6e-3, by 1e-5 4.5e-3 / 0.028, by
# 3e-5 7.3e-3 / 0.036; the intermediate quantised from fp32 instead of bf16 (a real bug:
# about one code in 30 moved) 1.1e-2 / 0.042; e4m3 truncation instead of rounding 0.13 /
# 0.18.
W8A8_RMS_BOUND = 8.1e-3
W8A8_ROW_BOUND = 2.0**-3


def w8a8_errors(got: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(||got - exact|| / ||exact|| over the whole (T, d) output, the largest such ratio
    over its rows), in fp64: what ``W8A8_RMS_BOUND`` and ``W8A8_ROW_BOUND`` bound."""
    if got.shape != exact.shape or got.dim() != 2:
        raise ValueError(
            f"w8a8_errors: got and exact must be the same (T, d), got {tuple(got.shape)} "
            f"and {tuple(exact.shape)}"
        )
    exact = exact.double()
    diff = got.double() - exact
    rows = diff.norm(dim=1) / exact.norm(dim=1).clamp_min(1e-300)
    total = diff.norm() / exact.norm().clamp_min(1e-300)
    return total.item(), (rows.max().item() if rows.numel() else 0.0)
