"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``, and the text decoder of the released
``Qwen3_5MoeForConditionalGeneration``): Qwen3.5's hybrid decoder (``qwen3_5.py``:
Gated DeltaNet with separate input projections, gated full attention) with
Qwen3-Next's sparse MoE block (``qwen3_next.SparseMoE``) on EVERY layer.

What differs from its two parents, as transformers 5.17 has it:

- no dense MLP anywhere: ``Qwen3_5MoeTextConfig`` has no ``intermediate_size``,
  ``decoder_sparse_step`` or ``mlp_only_layers``;
- the router always renormalises its top-k probabilities (no ``norm_topk_prob``
  field);
- the routed experts are SwiGLU, stored per expert as ``save_pretrained`` writes them
  (``mlp.experts.{e}.gate_proj`` ...), beside a shared expert gated by
  ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

from torch import nn

from unikv.models import qwen3_5
from unikv.models.config import ModelConfig
from unikv.models.hf import Fields
from unikv.models.qwen3_next import SparseMoE

MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def config_extras(hf_config) -> dict:
    """Qwen3.5's own fields plus the MoE ones (into ``ModelConfig.extra``);
    ValueError naming a missing or non-positive MoE field."""
    extra = qwen3_5.config_extras(hf_config)
    cfg = Fields(hf_config)
    for name in MOE_FIELDS:
        value = cfg.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"Qwen3.5-MoE needs a positive int {name!r}, got {value!r}; fix config.json"
            )
        extra[name] = value
    if extra["num_experts_per_tok"] > extra["num_experts"]:
        raise ValueError(
            f"num_experts_per_tok ({extra['num_experts_per_tok']}) exceeds num_experts "
            f"({extra['num_experts']}); fix config.json"
        )
    extra["norm_topk_prob"] = True  # transformers' Qwen3_5MoeTopKRouter always renormalises
    return extra


class Qwen3_5MoeForCausalLM(qwen3_5.Qwen3_5ForCausalLM):
    """Qwen3.5-MoE over unikv's paged attention and recurrent-state slots, on the
    shared decoder; under tensor parallelism its pieces shard as Qwen3.5's (Gated
    DeltaNet and attention heads) and Qwen3-Next's (routed and shared experts on their
    intermediate widths, one all-reduce per MoE block)."""

    tensor_parallel = True

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """Qwen3.5's heads and the experts' widths (no dense MLP anywhere)."""
        dims = super().tp_dims(config)
        dims.pop("intermediate_size")
        e = config.extra
        dims["moe_intermediate_size"] = e["moe_intermediate_size"]
        dims["shared_expert_intermediate_size"] = e["shared_expert_intermediate_size"]
        return dims

    @staticmethod
    def make_mlp(config: ModelConfig, layer: int, tp=None) -> nn.Module:
        return SparseMoE(config, tp)
