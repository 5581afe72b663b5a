"""The torch reference of the fused MoE (``kernels/moe/fused.py``), same signature.

Semantics: each token's top-k experts, weighted by the router and summed. Per
expert ``e``, on a token row ``h`` (model dtype):

    silu     a = silu(h @ W_gate^T) * (h @ W_up^T)                (Llama-style SwiGLU)
    gpt_oss  g, u = h @ W_gate^T + b_gate, h @ W_up^T + b_up
             a = (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha g'), g' = min(g, limit)
    relu2    a = relu(h @ W_up^T) ** 2                            (NemotronH, not gated)
    y_e      = a @ W_down^T (+ b_down)

Weights are stacked per expert, rows = output features, K = input features:
``w1`` (E, N1, K) with N1 = 2I (gated) or I (relu2), ``w2`` (E, d, I), any strides.
``gate_up``: "concat" (rows [gate (I) | up (I)], checkpoints with gate_proj/up_proj)
or "interleaved" (gate row 2j, up row 2j+1: gpt-oss). MXFP4 (``w*_scales`` given):
``w`` is uint8 blocks (E, N, K / 32, 16) (two e2m1 codes per byte, low nibble first)
and ``w*_scales`` uint8 e8m0 exponents (E, N, K / 32) (see ``kernels/moe/mxfp4_ref.py``).

This is the routed loop unikv's MoE families ran before the kernel: experts added
in index order, each weighted output rounded to ``sum_dtype`` (None: x.dtype).
Dense (every expert on every token, zero weight where not routed: no host sync,
fixed shapes, CUDA-graph safe) for T <= ``DENSE_MAX_TOKENS``, sparse (each expert
on its own tokens; syncs the host) above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from unikv.kernels.moe.mxfp4_ref import dequantize_mxfp4

if TYPE_CHECKING:
    from unikv.kernels.backend import RowsPlan

DENSE_MAX_TOKENS = 256


def dense_rows(num_tokens: int) -> bool:
    """The rule: T tokens run the dense table (T <= ``DENSE_MAX_TOKENS``), else the
    sparse loop. The step planner applies it once per step (``RowsPlan.moe_dense``);
    a call without a plan applies it to x's rows."""
    return num_tokens <= DENSE_MAX_TOKENS


ACTIVATIONS = ("silu", "gpt_oss", "relu2")
GATE_UP_LAYOUTS = ("concat", "interleaved")


def _check_weight(name: str, w: torch.Tensor, scales: torch.Tensor | None, e: int, rows: int):
    """The logical (E, rows, K) of a dense or MXFP4 weight; ValueError if malformed."""
    if scales is None:
        if w.dim() != 3 or w.shape[0] != e or (rows and w.shape[1] != rows):
            raise ValueError(f"{name} must be (E={e}, {rows or 'N'}, K), got {tuple(w.shape)}")
        return w.shape[2]
    ok = w.dtype == torch.uint8 and scales.dtype == torch.uint8 and w.dim() == 4
    if not ok or w.shape[-1] != 16 or w.shape[:3] != scales.shape or w.shape[0] != e:
        raise ValueError(
            f"MXFP4 {name} must be uint8 blocks (E={e}, N, K/32, 16) with uint8 scales "
            f"(E, N, K/32); got {w.dtype} {tuple(w.shape)} and {scales.dtype} "
            f"{tuple(scales.shape)}"
        )
    if rows and w.shape[1] != rows:
        raise ValueError(f"{name} must have {rows} rows, got {tuple(w.shape)}")
    return w.shape[2] * 32


def check_moe_args(x, topk_weights, topk_ids, w1, w2, w1_scales, w2_scales, activation, gate_up):
    """ValueError for malformed arguments; returns (E, I) (experts, intermediate)."""
    if activation not in ACTIVATIONS or gate_up not in GATE_UP_LAYOUTS:
        raise ValueError(
            f"activation must be one of {ACTIVATIONS} and gate_up one of {GATE_UP_LAYOUTS}, "
            f"got {activation!r} and {gate_up!r}"
        )
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[:1] != x.shape[:1]:
        raise ValueError(
            f"x must be (T, d) and topk_weights/topk_ids (T, k); got {tuple(x.shape)}, "
            f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64 expert ids, got {topk_ids.dtype}")
    e = w1.shape[0]
    k1 = _check_weight("w1", w1, w1_scales, e, 0)
    n1 = w1.shape[1]
    inter = n1 if activation == "relu2" else n1 // 2
    if k1 != x.shape[1] or (activation != "relu2" and n1 % 2):
        raise ValueError(
            f"w1 must be (E, 2I or I, d={x.shape[1]}) for {activation}, got K={k1}, N={n1}"
        )
    k2 = _check_weight("w2", w2, w2_scales, e, x.shape[1])
    if k2 != inter:
        raise ValueError(f"w2 must be (E, d, I={inter}), got K={k2}")
    return e, inter


def _dense(w: torch.Tensor, scales: torch.Tensor | None, e: int, dtype) -> torch.Tensor:
    """Expert e's (N, K) weight in ``dtype`` (MXFP4 dequantised, this expert only)."""
    if scales is None:
        return w[e]
    return dequantize_mxfp4(w[e : e + 1], scales[e : e + 1])[0].to(dtype).t()  # (N, K) view


def _expert(h, e, w1, w2, w1_scales, w2_scales, b1, b2, activation, gate_up, alpha, limit):
    """Expert e on rows h: (n, d) -> (n, d) in h.dtype."""
    w_in = _dense(w1, w1_scales, e, h.dtype)  # (N1, d)
    bias = None if b1 is None else b1[e]
    if activation == "relu2":
        return _down(torch.relu(F.linear(h, w_in, bias)).square(), e, w2, w2_scales, b2, F.linear)
    if activation == "silu":  # gate and up as two GEMMs, as per-expert checkpoints ran
        rows = _gate_up_rows(w_in.shape[0], gate_up)
        g, u = (F.linear(h, w_in[r], None if bias is None else bias[r]) for r in rows)
        return _down(F.silu(g) * u, e, w2, w2_scales, b2, F.linear)
    gu = h @ w_in.t()  # gpt-oss: (n, 2I), one GEMM then the bias, as transformers
    if bias is not None:
        gu = gu + bias
    gate, up = (gu[..., r] for r in _gate_up_rows(gu.shape[-1], gate_up))
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    a = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return _down(a, e, w2, w2_scales, b2, lambda a, w: a @ w.t())


def _gate_up_rows(n1: int, gate_up: str) -> tuple[slice, slice]:
    """The gate rows and the up rows of a (2I, ...) gate|up weight."""
    if gate_up == "interleaved":
        return slice(0, None, 2), slice(1, None, 2)
    return slice(0, n1 // 2), slice(n1 // 2, None)


def _down(a, e, w2, w2_scales, b2, matmul) -> torch.Tensor:
    """a: (n, I) activations -> (n, d) through expert e's down projection."""
    y = matmul(a, _dense(w2, w2_scales, e, a.dtype))  # (d, I) weight
    return y if b2 is None else y + b2[e]


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
    rows: RowsPlan | None = None,
) -> torch.Tensor:
    """x: (T, d) model dtype; topk_weights: (T, k) routing weights (any float dtype);
    topk_ids: (T, k) int32/int64 expert ids in [0, E) (not checked: a device value);
    w1/w2 (+ scales, biases b1 (E, N1), b2 (E, d) or None): see the module docstring
    -> (T, d) in x.dtype. rows: the step's plan (``RowsPlan.moe_dense``: the dense
    table or the sparse loop); None: ``dense_rows`` of x's rows."""
    num_experts, _ = check_moe_args(
        x, topk_weights, topk_ids, w1, w2, w1_scales, w2_scales, activation, gate_up
    )
    args = (w1, w2, w1_scales, w2_scales, b1, b2, activation, gate_up, alpha, limit)
    acc = sum_dtype or x.dtype
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    ids = topk_ids.long()
    table = dense_rows(x.shape[0]) if rows is None else rows.moe_dense  # a host bool
    if table:
        dense = torch.zeros(x.shape[0], num_experts, dtype=topk_weights.dtype, device=x.device)
        dense.scatter_(1, ids, topk_weights)  # (T, E), zero where not routed
        for e in range(num_experts):
            out += (_expert(x, e, *args) * dense[:, e, None]).to(acc)
        return out.to(x.dtype)
    for e in range(num_experts):
        token_idx, slot = torch.where(ids == e)
        if token_idx.numel():
            y = _expert(x[token_idx], e, *args) * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(acc))
    return out.to(x.dtype)
