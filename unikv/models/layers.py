"""Building blocks shared by unikv's models: RMSNorm, the attention block, the
gated MLP.

Attention is split in two: the model owns the projections, norms and rope; the
paged part (store K/V, read the cache) is an ``AttentionFn`` the engine passes
to ``forward`` for each step, already planned (write locations and block
tables translated once for the whole step). A model never sees the pool.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from unikv.models.config import ModelConfig
from unikv.models.parallel import linear_layers, tp_size
from unikv.models.rope import Rotary


class AttentionFn(Protocol):
    """The engine's per-step attention: stores this step's K/V rows of model
    layer ``layer`` and attends over the cache.

    q: (T, Hq, D), k: (T, H, D), v: (T, H, D) in the model dtype, T = tokens of
    the step in batch order; sinks: None or (Hq,) learned sink logits.
    Returns (T, Hq, D)."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class StateFn(Protocol):
    """The engine's per-step recurrent-state ops (Gated DeltaNet, Mamba-2 layers).

    The step object passed to ``forward`` as ``attn`` implements these beside
    ``AttentionFn``. Each reads the state of model layer ``layer`` for every
    request of the step from the request's state slot and writes it back
    updated; T = tokens of the step in batch order. See ``unikv/kernels/
    recurrent_ref.py`` for the exact semantics (the torch references)."""

    def causal_conv1d(
        self,
        layer: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str | None,
    ) -> torch.Tensor:
        """x: (T, C), weight: (C, K), bias: (C,) or None -> (T, C) in x.dtype."""
        ...

    def gated_delta_rule(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        scale: float,
        use_qk_l2norm: bool,
    ) -> torch.Tensor:
        """q, k: (T, H, Dk), v: (T, H, Dv), g, beta: (T, H) -> (T, H, Dv) in v.dtype."""
        ...

    def mamba2_ssd(
        self,
        layer: int,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        *,
        dt_softplus: bool,
        dt_limit: tuple[float, float],
    ) -> torch.Tensor:
        """x: (T, H, P), dt: (T, H), A, D, dt_bias: (H,), B, C: (T, G, N) -> (T, H, P)."""
        ...


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32.

    ``weight_in_fp32``: gpt-oss multiplies by the weight before casting back
    (``(w * x).to(dtype)``); Llama casts first (``w * x.to(dtype)``)."""

    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight * h).to(dtype)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    """q/k/v projections, optional q/k norm (Qwen3), rope, paged attention, o_proj.

    Weight names follow transformers (``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj``, ``q_norm``, ``k_norm``, ``sinks``).

    With ``tp`` (``models.parallel``), this rank holds heads ``1/tp`` of them:
    q/k/v column-parallel by heads, o_proj row-parallel (all-reduce)."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__()
        hidden, d, n = config.hidden_size, config.head_dim, tp_size(tp)
        column, row = linear_layers(tp)
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads // n, config.num_kv_heads // n
        self.head_dim = d
        self.q_proj = column(hidden, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = column(hidden, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = column(hidden, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = row(self.num_heads * d, hidden, bias=config.o_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        if tp is not None:
            self.tp_shards = {"sinks": 0}  # sinks follow the q heads
        self.rotary = [rotary]  # shared, kept out of this module's parameters

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """x: (T, hidden); positions: (T,) int64 -> (T, hidden)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = attn(self.layer, q, k, v, self.sinks)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (Llama family). With ``tp``:
    gate/up column-parallel on the intermediate dim, down row-parallel."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size // tp_size(tp), config.mlp_bias
        column, row = linear_layers(tp)
        self.gate_proj = column(h, i, bias=bias)
        self.up_proj = column(h, i, bias=bias)
        self.down_proj = row(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
