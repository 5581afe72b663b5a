"""LFM2 (``Lfm2ForCausalLM``, Liquid AI): gated short-convolution layers beside
GQA attention layers, on the shared decoder.

    per layer:  x = x + mixer(operator_norm(x));  x = x + feed_forward(ffn_norm(x))
    logits = lm_head(embedding_norm(x))               (embeddings tied by default)

- Short convolution (``layer_types[i] == "conv"``): ``in_proj`` (hidden -> 3 hidden)
  gives B, C and x; the depthwise causal conv of ``conv_L_cache`` taps runs over
  ``B * x`` (no activation), then ``out_proj(C * conv)``. Its only state is the conv
  window: the last ``conv_L_cache`` inputs of the layer, per request.
- Attention: q/k/v, per-head RMSNorm of q and k (``q_layernorm``, ``k_layernorm``),
  full rope, ``out_proj``.
- Feed-forward: SwiGLU ``w2(silu(w1 x) * w3 x)`` whose width transformers derives
  from ``intermediate_size`` (``block_auto_adjust_ff_dim``: 2/3 of it, times
  ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``).
- Norms are Llama's (cast to the model dtype, then times the weight).

Where the conv window lives: a conv-only ``MambaSpec`` slot (``temporal`` None,
``specs.py``), one per request, read and written by the step's ``causal_conv1d``
exactly as Mamba-2's and Gated DeltaNet's conv windows are; the capacity oracle
counts it as a slot of ``entry_bytes``. Module names are unikv's fused ones; the
checkpoint's names reach them through the ``packed`` maps (one name for a rename:
``o_proj`` <- ``out_proj``, ``down_proj`` <- ``w2``, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from unikv.models import decoder
from unikv.models.config import ModelConfig
from unikv.models.hf import Fields, StateDims
from unikv.models.layers import Attention, GatedMLP, Linear, RMSNorm, StateFn
from unikv.models.parallel import Segments, linear_layers, shard_rows, tp_size
from unikv.models.rope import Rotary

LAYER_TYPES = ("conv", "full_attention")


@dataclass(frozen=True)
class ShortConvDims(StateDims):
    """A short-conv layer's state (``StateDims`` with no temporal part) and how it
    splits over tensor-parallel ranks: each rank its contiguous 1/tp of the channels."""

    def shard(self, size: int) -> ShortConvDims:
        if self.conv_dim % size:
            raise ValueError(
                f"tensor parallelism of {size} needs hidden_size ({self.conv_dim}, the short "
                f"convolution's channels) divisible by {size}; use a tensor-parallel size "
                "that divides it"
            )
        return dataclasses.replace(self, conv_dim=self.conv_dim // size)


def conv_dims(cfg: Fields) -> ShortConvDims:
    """One short-conv layer's state: the conv window (hidden, conv_L_cache) and no
    temporal state (the pool's spec and the model's mixer both come from here)."""
    return ShortConvDims(cfg.need("hidden_size"), int(cfg.get("conv_L_cache", 3)), ())


def ff_dim(cfg: Fields) -> int:
    """The feed-forward width transformers' Lfm2MLP builds."""
    width = cfg.need("intermediate_size")
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = cfg.get("block_multiple_of", 256)
            width = multiple * -(-int(multiplier * width) // multiple)
    return width


def config_extras(hf_config) -> dict:
    """LFM2's own fields (into ``ModelConfig.extra``); ValueError for layer types
    other than "conv" / "full_attention"."""
    cfg = Fields(hf_config)
    types = tuple(cfg.need("layer_types"))
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad or len(types) != cfg.need("num_hidden_layers"):
        raise ValueError(
            f"LFM2 needs layer_types of {cfg.need('num_hidden_layers')} entries out of "
            f"{list(LAYER_TYPES)}, got {list(types)}; fix config.json"
        )
    return {"layer_types": types, "ff_dim": ff_dim(cfg), "conv_bias": bool(cfg.get("conv_bias"))}


class ShortConv(nn.Module):
    """LFM2's gated short convolution; ``in_proj`` is the GEMM the decoder fuses the
    pre-norm into (``input_linear``). Under ``tp`` a rank holds 1/tp of the channels:
    B, C and x rows of ``in_proj`` each (``Segments``), the conv's channels (so its
    state slot holds only their window), ``out_proj`` row-parallel."""

    def __init__(self, config: ModelConfig, layer: int, tp=None) -> None:
        super().__init__()
        full, kernel, bias = (
            config.hidden_size,
            config.state_dims.conv_kernel,
            config.extra["conv_bias"],
        )
        hidden = full // tp_size(tp)
        self.layer, self.hidden = layer, hidden
        self.in_proj = Linear(full, 3 * hidden, bias=bias)
        # weight (hidden, 1, K); run by the step's causal conv, never as nn.Conv1d
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=bias)
        self.out_proj = linear_layers(tp)[1](hidden, full, bias=bias)
        if tp is not None:
            shard_rows(self.in_proj, Segments(0, ((full, full),) * 3))
            shard_rows(self.conv)

    def input_linear(self) -> nn.Linear:
        return self.in_proj

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: StateFn) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden); continues the layer's conv window in its slot."""
        return self.from_input(self.in_proj(x), positions, attn)

    def from_input(self, y: torch.Tensor, positions: torch.Tensor, attn: StateFn) -> torch.Tensor:
        b, c, x = y.chunk(3, dim=-1)  # transformers' order: B, C, x
        weight = self.conv.weight.view(self.hidden, -1)  # (C, K)
        h = attn.causal_conv1d(self.layer, b * x, weight, self.conv.bias, None)
        return self.out_proj(c * h)


class Lfm2Attention(Attention):
    """unikv's attention block with q/k norms, under LFM2's checkpoint names."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__(dataclasses.replace(config, qk_norm=True), layer, rotary, tp)
        self.packed.update(o_proj=("out_proj",), q_norm=("q_layernorm",), k_norm=("k_layernorm",))


class Lfm2MLP(GatedMLP):
    """SwiGLU of width ``ff_dim``: gate|up loaded from ``w1``, ``w3``; down from ``w2``."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        width = config.extra["ff_dim"]
        super().__init__(dataclasses.replace(config, intermediate_size=width), tp)
        self.packed = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}


class DecoderLayer(decoder.DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.operator_norm = RMSNorm(h, eps)
        if config.extra["layer_types"][layer] == "conv":
            self.conv = body = ShortConv(config, layer, tp)
        else:
            self.self_attn = body = Lfm2Attention(config, layer, rotary, tp)
        self.ffn_norm = RMSNorm(h, eps)
        self.feed_forward = Lfm2MLP(config, tp)
        self.blocks = [
            decoder.Block(self.operator_norm, body, mixes=True),
            decoder.Block(self.ffn_norm, self.feed_forward, mixes=False),
        ]


class Lfm2ForCausalLM(decoder.DecoderLM):
    """LFM2 over unikv's paged attention and conv-only state slots; under tensor
    parallelism the attention heads, the short convolutions' channels (and their
    windows) and the feed-forward columns are split."""

    tensor_parallel = True

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """The heads where a layer attends, ``hidden_size`` (the short convolutions'
        channels) where one convolves, and the feed-forward width transformers derives
        from ``intermediate_size``."""
        types, dims = set(config.extra["layer_types"]), {}
        if "full_attention" in types:
            dims["num_attention_heads"] = config.num_heads
            dims["num_key_value_heads"] = config.num_kv_heads
        if "conv" in types:
            dims["hidden_size"] = config.hidden_size
        dims["intermediate_size (the feed-forward width, ff_dim)"] = config.extra["ff_dim"]
        return dims

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        rotary = Rotary(config.rope, config.head_dim, max_positions)
        layers = [DecoderLayer(config, i, rotary, tp) for i in range(config.num_layers)]
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        return decoder.Backbone(
            embed, layers, norm, rotary, names=("embed_tokens", "embedding_norm")
        )
