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


def _sparse(extra: dict, layer: int) -> bool:
    """Whether ``layer`` runs the MoE (else the dense SwiGLU)."""
    on_grid = extra["num_experts"] > 0 and (layer + 1) % extra["decoder_sparse_step"] == 0
    return on_grid and layer not in extra["mlp_only_layers"]


class Qwen3MoeForCausalLM(MoEDecoderLM):
    """Qwen3-MoE over unikv's paged attention; under tensor parallelism the heads shard
    as Llama's, the experts on ``moe_intermediate_size``, the dense layers' SwiGLU on
    ``intermediate_size``."""

    def __init__(
        self, config: ModelConfig, max_positions: int, tp=None, *, ops: KernelBackend | None = None
    ) -> None:
        super().__init__(dataclasses.replace(config, qk_norm=True), max_positions, tp, ops=ops)

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """Heads, KV heads, and the intermediate size of each MLP kind the model has."""
        e = config.extra
        sparse = [_sparse(e, i) for i in range(config.num_layers)]
        dims = {"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads}
        if any(sparse):
            dims["moe_intermediate_size"] = e["moe_intermediate_size"]
        if not all(sparse):
            dims["intermediate_size"] = config.intermediate_size
        return dims

    def make_mlp(self, config: ModelConfig, layer: int, tp) -> nn.Module:
        e = config.extra
        if _sparse(e, layer):
            names = ("gate_proj", "up_proj", "down_proj")
            intermediate, norm = e["moe_intermediate_size"], e["norm_topk_prob"]
            return SparseMoE(config, intermediate, names, norm, True, tp)
        return GatedMLP(config, tp)
