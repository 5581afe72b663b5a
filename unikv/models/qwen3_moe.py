"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's decoder (q/k norm, ``llama.py``'s
layers) with sparse MoE blocks.

- ``mlp.gate``: softmax over all experts in fp32, top-k, renormalised when
  ``norm_topk_prob``, cast to the model dtype (transformers' ``Qwen3MoeTopKRouter``).
- ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``: SwiGLU experts of
  ``moe_intermediate_size``, run by the fused MoE (``models/moe.RoutedExperts``).
- Layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid run a dense
  SwiGLU of ``intermediate_size`` (``layers.GatedMLP``); no shared expert.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from unikv.kernels.backend import KernelBackend
from unikv.models.config import ModelConfig
from unikv.models.layers import GatedMLP
from unikv.models.mixtral import MoEDecoderLM, SparseMoE

FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")


def config_extras(hf_config) -> dict:
    """Qwen3-MoE's own fields; ValueError for an activation unikv does not run."""
    if hf_config.hidden_act != "silu":
        raise ValueError(f"Qwen3-MoE experts run 'silu', the config has {hf_config.hidden_act!r}")
    extra = {name: int(getattr(hf_config, name)) for name in FIELDS}
    extra["norm_topk_prob"] = bool(hf_config.norm_topk_prob)
    extra["mlp_only_layers"] = tuple(hf_config.mlp_only_layers or ())
    return extra


class Qwen3MoeForCausalLM(MoEDecoderLM):
    """Qwen3-MoE over unikv's paged attention (tp must be None)."""

    def __init__(
        self, config: ModelConfig, max_positions: int, tp=None, *, ops: KernelBackend | None = None
    ) -> None:
        super().__init__(dataclasses.replace(config, qk_norm=True), max_positions, tp, ops=ops)

    def make_mlp(self, config: ModelConfig, layer: int, tp) -> nn.Module:
        e = config.extra
        sparse = e["num_experts"] > 0 and (layer + 1) % e["decoder_sparse_step"] == 0
        if sparse and layer not in e["mlp_only_layers"]:
            names = ("gate_proj", "up_proj", "down_proj")
            return SparseMoE(config, e["moe_intermediate_size"], names, e["norm_topk_prob"], True)
        return GatedMLP(config)
