"""Mixtral (``MixtralForCausalLM``): Mistral's decoder (``llama.py``'s layers, a
window on every layer when the config has one) with a sparse MoE block per layer.

- ``block_sparse_moe.gate``: softmax over all experts in fp32, top-k, renormalised;
  the weights stay fp32 (transformers' ``MixtralTopKRouter``).
- ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down): SwiGLU
  experts as released checkpoints (and transformers' ``save_pretrained``) store
  them, run by the fused MoE (``models/moe.RoutedExperts``).

``MoEDecoderLM`` is the causal LM of the Llama layout with a per-layer MLP factory;
Qwen3-MoE (``qwen3_moe.py``) shares it.
"""

from __future__ import annotations

import torch
from torch import nn

from unikv.models.config import ModelConfig
from unikv.models.llama import CausalLM
from unikv.models.moe import RoutedExperts, top_k_softmax
from unikv.models.parallel import reduce_partial


def config_extras(hf_config) -> dict:
    """Mixtral's MoE fields; ValueError for an activation unikv does not run."""
    if hf_config.hidden_act != "silu":
        raise ValueError(f"Mixtral experts run 'silu', the config has {hf_config.hidden_act!r}")
    return {
        "num_experts": int(hf_config.num_local_experts),
        "num_experts_per_tok": int(hf_config.num_experts_per_tok),
    }


class Router(nn.Module):
    """``weight`` (E, hidden): softmax over every expert in fp32, then top-k,
    renormalised when ``norm_topk_prob``; weights returned in fp32, or in the model
    dtype when ``to_model_dtype`` (Qwen3-MoE)."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, to_model_dtype: bool
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.to_model_dtype = top_k, norm_topk_prob, to_model_dtype
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) -> (weights (T, k), expert indices (T, k) int64)."""
        logits = nn.functional.linear(x, self.weight)  # (T, E)
        dtype = logits.dtype if self.to_model_dtype else torch.float32  # host bools fixed
        return top_k_softmax(logits, self.top_k, self.norm_topk_prob, dtype)  # by the config


class SparseMoE(nn.Module):
    """``gate`` (router) and ``experts`` (fused): x (T, hidden) -> (T, hidden).

    With ``tp``: the router replicated (every rank routes alike), the experts sharded
    on their intermediate dim (``moe.RoutedExperts``), one all-reduce after them."""

    def __init__(
        self,
        config: ModelConfig,
        intermediate: int,
        names: tuple[str, str, str],
        norm_topk_prob: bool,
        to_model_dtype: bool,
        tp=None,
    ) -> None:
        super().__init__()
        e, hidden = config.extra, config.hidden_size
        self.gate = Router(
            hidden, e["num_experts"], e["num_experts_per_tok"], norm_topk_prob, to_model_dtype
        )
        self.experts = RoutedExperts(e["num_experts"], hidden, intermediate, names=names, tp=tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x)
        return reduce_partial(self.tp, self.experts(x, weights, indices))


class MoEDecoderLM(CausalLM):
    """A Llama-layout causal LM whose MLPs come from ``make_mlp``; everything else is
    ``llama.CausalLM``'s (the shared decoder, tensor parallelism included); ``ops`` as
    there."""

    def make_mlp(self, config: ModelConfig, layer: int, tp) -> nn.Module:
        raise NotImplementedError


class MixtralForCausalLM(MoEDecoderLM):
    """Mixtral over unikv's paged attention; its MLP is named ``block_sparse_moe`` (the
    checkpoint's name). Under tensor parallelism its experts shard on
    ``intermediate_size`` (the default ``tp_dims``: heads, KV heads, that)."""

    mlp_name = "block_sparse_moe"

    def make_mlp(self, config: ModelConfig, layer: int, tp) -> nn.Module:
        names = ("w1", "w3", "w2")  # gate, up, down
        return SparseMoE(config, config.intermediate_size, names, True, False, tp)
