"""Qwen3-Next (``Qwen3NextForCausalLM``): Qwen3.5's hybrid decoder (``qwen3_5.py``)
with packed Gated DeltaNet projections and a sparse MoE block.

- ``in_proj_qkvz`` (hidden -> 2 Hk Dk + 2 Hv Dv) is grouped by key head: for each
  of the Hk key heads, [q (Dk) | k (Dk) | v (r Dv) | z (r Dv)] with r = Hv / Hk;
  ``in_proj_ba`` (hidden -> 2 Hv) likewise, [b (r) | a (r)] per key head.
- MoE (``mlp``): softmax router over all experts in fp32, top-k, renormalised when
  ``norm_topk_prob``; SwiGLU experts stored per expert as in released checkpoints
  and in what ``save_pretrained`` writes (``experts.{e}.gate_proj`` ...); plus a
  shared expert scaled by ``sigmoid(shared_expert_gate(x))``. Layers in
  ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid use a dense MLP.

The routed experts run in the fused MoE (``models/moe.RoutedExperts``: Triton on
CUDA, the torch reference loop elsewhere).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from unikv.models import qwen3_5
from unikv.models.config import ModelConfig
from unikv.models.layers import GatedMLP, Linear, model_ops
from unikv.models.moe import RoutedExperts
from unikv.models.parallel import reduce_partial

MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
)


def config_extras(hf_config) -> dict:
    """Qwen3-Next's own fields: Qwen3.5's plus the MoE ones."""
    extra = qwen3_5.config_extras(hf_config)
    extra.update({name: int(getattr(hf_config, name)) for name in MOE_FIELDS})
    extra["norm_topk_prob"] = bool(hf_config.norm_topk_prob)
    extra["mlp_only_layers"] = tuple(hf_config.mlp_only_layers or ())
    return extra


class PackedGatedDeltaNet(qwen3_5.GatedDeltaNet):
    """Gated DeltaNet with Qwen3-Next's per-key-head packed projections, run as one
    GEMM (``in_proj``: ``in_proj_qkvz`` then ``in_proj_ba``, ``packed``)."""

    def make_projections(self, hidden: int) -> None:
        self.split = (2 * self.key_dim + 2 * self.value_dim, 2 * self.num_v_heads)
        self.in_proj = Linear(hidden, sum(self.split), bias=False)
        self.packed = {"in_proj": ("in_proj_qkvz", "in_proj_ba")}

    def projection_shards(self, full) -> dict:
        """Both checkpoint projections are grouped by key head: the rank's contiguous
        key heads (``tp_dims`` asks linear_num_key_heads divisible)."""
        return {"in_proj_qkvz.weight": 0, "in_proj_ba.weight": 0}

    def unpack(self, y: torch.Tensor):
        """y (T, 2 Hk Dk + 2 Hv Dv + 2 Hv) -> (qkv (T, conv_dim) as [q | k | v], z (T,
        Hv, Dv), b (T, Hv), a (T, Hv)), unpacked from the per-key-head groups."""
        t, hk, dk = y.shape[0], self.num_k_heads, self.head_k_dim
        rv = self.num_v_heads // hk * self.head_v_dim  # value dims per key head
        r = self.num_v_heads // hk
        qkvz, ba = y.split(self.split, dim=-1)
        q, k, v, z = qkvz.view(t, hk, 2 * dk + 2 * rv).split([dk, dk, rv, rv], dim=-1)
        b, a = ba.view(t, hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        z = z.reshape(t, self.num_v_heads, self.head_v_dim)
        return qkv, z, b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads)


class Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e = config.extra
        self.top_k, self.norm_topk_prob = e["num_experts_per_tok"], e["norm_topk_prob"]
        self.weight = nn.Parameter(torch.zeros(e["num_experts"], config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) -> (weights (T, k) in x.dtype, expert indices (T, k) int64)."""
        logits = nn.functional.linear(x, self.weight)  # (T, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:  # a host bool fixed by the config
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), indices


class SparseMoE(nn.Module):
    """``mlp.gate`` (router), ``mlp.experts.{e}`` (SwiGLU each, the
    checkpoint's per-expert names), ``mlp.shared_expert``, ``mlp.shared_expert_gate``."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        super().__init__()
        e = config.extra
        self.gate = Router(config)  # replicated under tp: every rank routes alike
        self.experts = RoutedExperts(  # under tp: each expert's intermediate slice
            e["num_experts"], config.hidden_size, e["moe_intermediate_size"], tp=tp
        )
        self.tp = tp
        shared = dataclasses.replace(config, intermediate_size=e["shared_expert_intermediate_size"])
        # routed and gated shared partial sums added, then reduced once
        self.shared_expert = GatedMLP(shared, tp, reduce=False)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.ops = model_ops()  # sigmoid(gate) * shared in one kernel (``sigmoid_mul``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        weights, indices = self.gate(x)
        out = self.experts(x, weights, indices)
        gate = self.shared_expert_gate(x)  # (T, 1): one gate per row, broadcast in place
        shared = self.shared_expert(x)
        out = out + self.ops.sigmoid_mul(shared, gate.expand_as(shared))
        return reduce_partial(self.tp, out)


class Qwen3NextForCausalLM(qwen3_5.Qwen3_5ForCausalLM):
    """Qwen3-Next over unikv's paged attention and recurrent-state slots; under ``tp``
    as Qwen3.5, the routed and shared experts sharded on their intermediate dims."""

    mixer = PackedGatedDeltaNet

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """Qwen3.5's, the key heads (the packed projections are grouped by key head),
        the expert widths where a layer is sparse, ``intermediate_size`` only where
        one is dense."""
        e, types = config.extra, range(config.num_layers)
        dims = {
            **super().tp_dims(config),
            "linear_num_key_heads": config.state_dims.num_k_heads,
        }
        if not any(_sparse(config, i) for i in types):
            return dims
        if all(_sparse(config, i) for i in types):
            dims.pop("intermediate_size")
        dims["moe_intermediate_size"] = e["moe_intermediate_size"]
        dims["shared_expert_intermediate_size"] = e["shared_expert_intermediate_size"]
        return dims

    @staticmethod
    def make_mlp(config: ModelConfig, layer: int, tp=None) -> nn.Module:
        return SparseMoE(config, tp) if _sparse(config, layer) else GatedMLP(config, tp)


def _sparse(config: ModelConfig, layer: int) -> bool:
    """Whether ``layer``'s MLP is the sparse MoE block."""
    e = config.extra
    sparse = e["num_experts"] > 0 and (layer + 1) % e["decoder_sparse_step"] == 0
    return sparse and layer not in e["mlp_only_layers"]
