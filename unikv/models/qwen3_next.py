"""Qwen3-Next (``Qwen3NextForCausalLM``): Qwen3.5's hybrid decoder (``qwen3_5.py``)
with packed Gated DeltaNet projections and a sparse MoE block.

- ``in_proj_qkvz`` (hidden -> 2 Hk Dk + 2 Hv Dv) is grouped by key head: for each
  of the Hk key heads, [q (Dk) | k (Dk) | v (r Dv) | z (r Dv)] with r = Hv / Hk;
  ``in_proj_ba`` (hidden -> 2 Hv) likewise, [b (r) | a (r)] per key head. They load
  as one GEMM, ``in_proj``, whose rows are regrouped once after loading into Qwen3.5's
  [q | k | v | z | b | a] (``PackedGatedDeltaNet.finish_loading``): a step slices views.
- MoE (``mlp``): softmax router over all experts in fp32, top-k, renormalised when
  ``norm_topk_prob``; SwiGLU experts stored per expert as in released checkpoints
  and in what ``save_pretrained`` writes (``experts.{e}.gate_proj`` ...); plus a
  shared expert scaled by ``sigmoid(shared_expert_gate(x))`` and added to the routed
  experts' output (one kernel, ``sigmoid_mul``); the router and the shared expert's
  gate are one GEMM (``SparseMoE.router``). Layers in ``mlp_only_layers`` or off the
  ``decoder_sparse_step`` grid use a dense MLP.

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
from unikv.models.moe import RoutedExperts, top_k_softmax
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
        self.regrouped = False  # in_proj's rows as in the checkpoint (``finish_loading``)

    def row_order(self) -> torch.Tensor:
        """in_proj's rows in Qwen3.5's order [q | k | v | z | b | a], as indices of the
        checkpoint's per-key-head groups ([q_h k_h v_h z_h] per key head h, then
        [b_h a_h] per key head): value head j of key head h stays head h * r + j."""
        hk, dk, r = self.num_k_heads, self.head_k_dim, self.num_v_heads // self.num_k_heads
        rv = r * self.head_v_dim
        qkvz = torch.arange(self.split[0]).view(hk, 2 * dk + 2 * rv)
        ba = self.split[0] + torch.arange(self.split[1]).view(hk, 2 * r)
        parts = qkvz.split([dk, dk, rv, rv], dim=1) + ba.split([r, r], dim=1)
        return torch.cat([p.reshape(-1) for p in parts])

    def finish_loading(self) -> None:
        """After the weights load (``loader.load_model``): in_proj's rows reordered once
        into Qwen3.5's [q | k | v | z | b | a], so a step takes views of the one GEMM's
        output (``GatedDeltaNet.unpack``) and launches no concatenation. A kept FP8
        weight (its block scales span the groups) stays as loaded: ``unpack`` gathers."""
        if self.regrouped or type(self.in_proj) is not Linear:
            return
        weight = self.in_proj.weight
        with torch.no_grad():
            weight.copy_(weight[self.row_order().to(weight.device)])
        self.split = (self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads)
        self.regrouped = True

    def projection_shards(self, full) -> dict:
        """Both checkpoint projections are grouped by key head: the rank's contiguous
        key heads (``tp_dims`` asks linear_num_key_heads divisible)."""
        return {"in_proj_qkvz.weight": 0, "in_proj_ba.weight": 0}

    def unpack(self, y: torch.Tensor):
        """y (T, 2 Hk Dk + 2 Hv Dv + 2 Hv) -> (qkv (T, conv_dim) as [q | k | v], z (T,
        Hv, Dv), b (T, Hv), a (T, Hv)), unpacked from the per-key-head groups (views of
        y once ``finish_loading`` regrouped the rows)."""
        if self.regrouped:  # a host bool fixed at load
            return super().unpack(y)
        t, hk, dk = y.shape[0], self.num_k_heads, self.head_k_dim
        rv = self.num_v_heads // hk * self.head_v_dim  # value dims per key head
        r = self.num_v_heads // hk
        qkvz, ba = y.split(self.split, dim=-1)
        q, k, v, z = qkvz.view(t, hk, 2 * dk + 2 * rv).split([dk, dk, rv, rv], dim=-1)
        b, a = ba.view(t, hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        z = z.reshape(t, self.num_v_heads, self.head_v_dim)
        return qkv, z, b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads)


class SparseMoE(nn.Module):
    """``mlp.gate`` (router), ``mlp.experts.{e}`` (SwiGLU each, the checkpoint's
    per-expert names), ``mlp.shared_expert``, ``mlp.shared_expert_gate``. The router
    and the shared expert's gate (both replicated under tp) run as one GEMM,
    ``router``: rows [gate (E) | shared_expert_gate (1)] (``packed``)."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        super().__init__()
        e = config.extra
        self.top_k, self.norm_topk_prob = e["num_experts_per_tok"], e["norm_topk_prob"]
        self.num_experts = e["num_experts"]
        # replicated under tp: every rank routes and gates alike
        self.router = Linear(config.hidden_size, self.num_experts + 1, bias=False)
        self.packed = {"router": ("gate", "shared_expert_gate")}
        self.experts = RoutedExperts(  # under tp: each expert's intermediate slice
            e["num_experts"], config.hidden_size, e["moe_intermediate_size"], tp=tp
        )
        self.tp = tp
        shared = dataclasses.replace(config, intermediate_size=e["shared_expert_intermediate_size"])
        # routed and gated shared partial sums added, then reduced once
        self.shared_expert = GatedMLP(shared, tp, reduce=False)
        self.ops = model_ops()  # routed + sigmoid(gate) * shared in one kernel (``sigmoid_mul``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        logits = self.router(x)  # (T, E + 1): the router's logits, then the gate's
        weights, indices = top_k_softmax(
            logits[:, : self.num_experts], self.top_k, self.norm_topk_prob, logits.dtype
        )
        out = self.experts(x, weights, indices)
        shared = self.shared_expert(x)
        gate = logits[:, self.num_experts :]  # (T, 1): one gate per row, broadcast in place
        out = self.ops.sigmoid_mul(shared, gate.expand_as(shared), out)
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
