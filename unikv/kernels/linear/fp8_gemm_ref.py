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
``moe_fp8_w8a8`` is the same scheme for the fused MoE over FP8 experts (the W8A8
prefill variant of ``kernels/moe/fp8.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

if TYPE_CHECKING:
    from unikv.kernels.backend import RowsPlan

FP8_MAX = 448.0  # largest finite float8_e4m3fn
ACT_SCALE_MIN = 1e-12  # an all-zero group keeps a finite scale


def check_operands(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block) -> None:
    """ValueError unless x is (..., K) float, weight (N, K) float8_e4m3fn and scale_inv
    fp32 (ceil(N / bn), ceil(K / bk))."""
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
) -> torch.Tensor:
    """x (..., K) @ dequantize(weight, scale_inv)^T (+ bias) in fp32 -> (..., N) in x.dtype
    (one path at every row count: ``rows``, the step's plan, changes nothing)."""
    check_operands(x, weight, scale_inv, block)
    out = F.linear(x.float(), dequantize(weight, scale_inv, block))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def quantize_act(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (xq (M, K) float8_e4m3fn, scales (M, ceil(K / group)) fp32) with
    x ~= xq * scales per group of ``group`` columns (the Triton kernel's arithmetic:
    scale = max(amax / 448, 1e-12), xq = fp8(x / scale))."""
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scales = (padded.abs().amax(-1) / FP8_MAX).clamp(min=ACT_SCALE_MIN)  # (M, G)
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
) -> torch.Tensor:
    """The W8A8 fused MoE over FP8 experts (``moe_fp8``'s arguments; 16-bit x), from its
    definition, in fp32 throughout:

        xd = x quantised per token and group of bk columns (``quantize_act``), dequantised
        per expert e, on its routed tokens' rows of xd:
            g, u = xd @ Wgate_e^T, xd @ Wup_e^T        (W dequantised: ``dequantize_experts``)
            a    = act(g, u) rounded to x.dtype        (the kernel stores it so)
            ad   = a quantised per row and group of bk, dequantised
            y    = (ad @ Wdown_e^T) * routing weight   (fp32)
        out = sum over the token's k choices (fp32), cast to x.dtype.

    One expert's fp32 weights at a time (the GPU benchmark's shapes fit); syncs the host
    (``torch.where`` per expert): a reference, never on the engine's path."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"moe_fp8_w8a8: x must be bf16 or fp16 (W8A8 is a 16-bit path), got {x.dtype}"
        )
    bk = block[1]
    parts = 1 if activation == "relu2" else 2
    xq, xs = quantize_act(x, bk)
    xd = dequantize(xq, xs, (1, bk))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if not token.numel():
            continue
        wa = dequantize_experts(w1[e : e + 1], w1_scale[e : e + 1], parts, block, torch.float32)[0]
        wb = dequantize_experts(w2[e : e + 1], w2_scale[e : e + 1], 1, block, torch.float32)[0]
        gu = xd[token] @ wa.t()
        g, u = (gu, gu) if parts == 1 else gu.chunk(2, dim=-1)
        a = _act_fp32(g, u, activation).to(x.dtype)
        aq, as_ = quantize_act(a, bk)
        y = dequantize(aq, as_, (1, bk)) @ wb.t()
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out.to(x.dtype)
