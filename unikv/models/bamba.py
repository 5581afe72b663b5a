"""Bamba (``BambaForCausalLM``): Mamba-2 and rope attention layers, each followed by
a SwiGLU MLP.

    x = x + mixer(input_layernorm(x))        mixer: Mamba-2 (``mamba``) or attention
    x = x + feed_forward(pre_ff_layernorm(x))

Layer i runs attention where ``i in attn_layer_indices``, a Mamba-2 mixer elsewhere.
The attention is standard GQA with rope on the first half of each head
(transformers' BambaConfig fixes ``partial_rotary_factor`` at 0.5). The Mamba-2
mixer is ``mamba2.Mamba2Mixer`` with two differences from NemotronH's: its gated
RMSNorm normalises the whole inner width at once (one group, whatever
``mamba_n_groups`` is) and its step size is clamped to ``time_step_limit``.

State: Mamba layers keep conv + SSM state in the engine's Mamba sub-pool,
attention layers K/V in the full-attention sub-pool. Names are transformers'
(``model.layers.i.mamba.*`` / ``.self_attn.*``, ``.feed_forward.*``,
``model.final_layernorm``). Granite-4.0-H (``granitemoehybrid.py``) reuses the mixer.

Tensor parallelism (``models/parallel.py``): the Mamba-2 heads (their state with
them), the attention heads and the MLP columns; the whole-width gated norm sums its
mean square over the ranks.
"""

from __future__ import annotations

import dataclasses

from unikv.models import decoder
from unikv.models.config import ModelConfig
from unikv.models.hf import Fields, as_float
from unikv.models.layers import Attention, GatedMLP, RMSNorm
from unikv.models.mamba2 import GatedRMSNorm, Mamba2Dims, Mamba2Mixer
from unikv.models.parallel import tp_size
from unikv.models.rope import Rotary

MAMBA, ATTENTION = "linear_attention", "full_attention"


def mamba_dims(cfg: Fields) -> Mamba2Dims:
    """The Mamba-2 mixer dims of a Bamba or Granite-4.0-H config (the pool's state
    spec and the model's mixer both come from here); defaults are transformers'
    BambaConfig's. The inner width is ``mamba_expand * hidden_size``; ``mamba_d_head``
    "auto" is that over ``mamba_n_heads``."""
    inner = cfg.get("mamba_expand", 2) * cfg.need("hidden_size")
    heads = cfg.get("mamba_n_heads", 128)
    d_head = cfg.get("mamba_d_head", "auto")
    limit = cfg.get("time_step_limit")
    bias = bool(cfg.get("mamba_proj_bias", False))
    return Mamba2Dims(
        hidden_size=cfg.need("hidden_size"),
        num_heads=heads,
        head_dim=inner // heads if d_head == "auto" else d_head,
        n_groups=cfg.get("mamba_n_groups", 1),
        state_size=cfg.get("mamba_d_state", 256),
        conv_kernel=cfg.get("mamba_d_conv", 4),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bias,
        out_bias=bias,
        activation=cfg.get("hidden_act", "silu"),
        eps=float(cfg.get("rms_norm_eps", 1e-5)),
        dt_limit=(0.0, float("inf")) if limit is None else tuple(map(as_float, limit)),
        fields=("mamba_n_heads", "mamba_n_groups"),
    )


class BambaMixer(Mamba2Mixer):
    """The Mamba-2 mixer whose gated RMSNorm spans the whole inner width (transformers'
    BambaRMSNormGated: gate, normalise over all I channels, cast, weight). Under ``tp``
    that one group spans every rank: each holds its heads' slice of the norm weight
    and the mean square is summed over the ranks (``GatedRMSNorm.across_ranks``)."""

    def __init__(self, dims: Mamba2Dims, layer: int, tp=None) -> None:
        super().__init__(dims, layer, tp)
        inner = dims.intermediate_size // tp_size(tp)
        shared = None if tp is None else (tp, 1, 0, dims.intermediate_size)
        self.norm = GatedRMSNorm(inner, 1, dims.eps, False, False, shared)
        if tp is not None:
            self.norm.tp_shards = {"weight": 0}


def config_extras(hf_config) -> dict:
    """Bamba's own fields (for ``ModelConfig.extra``): the layer types, ``mlp_bias``."""
    return {
        "layer_types": tuple(hf_config.layers_block_type),
        "mlp_bias": bool(getattr(hf_config, "mlp_bias", False)),
    }


class DecoderLayer(decoder.DecoderLayer):
    """The mixer behind ``input_layernorm``, the MLP behind ``pre_ff_layernorm``
    (two ``decoder.Block`` s: each norm fused with the residual add and, where the
    body's first GEMM is a plain ``Linear``, with that GEMM)."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.block_type = config.extra["layer_types"][layer]
        mlp_config = dataclasses.replace(config, mlp_bias=config.extra["mlp_bias"])
        self.feed_forward = GatedMLP(mlp_config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps)
        if self.block_type == MAMBA:
            self.mamba = mixer = BambaMixer(config.state_dims, layer, tp)
        else:
            self.self_attn = mixer = Attention(config, layer, rotary, tp)
        self.blocks = [
            decoder.Block(self.input_layernorm, mixer, mixes=True),
            decoder.Block(self.pre_ff_layernorm, self.feed_forward, mixes=False),
        ]


def hybrid_tp_dims(config: ModelConfig) -> dict[str, int]:
    """The attention heads where a layer attends, ``mamba_n_heads`` where one is Mamba
    (the groups: ``Mamba2Dims.shard``): the fields a tp size must divide."""
    types, dims = set(config.extra["layer_types"]), {}
    if ATTENTION in types:
        dims["num_attention_heads"] = config.num_heads
        dims["num_key_value_heads"] = config.num_kv_heads
    if MAMBA in types:
        dims["mamba_n_heads"] = config.state_dims.num_heads
    return dims


def check_layer_types(config: ModelConfig, family: str) -> None:
    types = config.extra["layer_types"]
    bad = sorted(set(types) - {MAMBA, ATTENTION})
    if bad or len(types) != config.num_layers:
        raise ValueError(
            f"{family} layer types must list {config.num_layers} entries out of "
            f"{(MAMBA, ATTENTION)}, got {list(types)}; fix the config"
        )


class BambaForCausalLM(decoder.DecoderLM):
    """Bamba over unikv's step object (paged attention + recurrent-state ops), on the
    shared decoder with all its fused pieces (the embedding inside the first GEMM,
    each residual add inside the next norm, the argmax inside the head).

    Args:
        config: ModelConfig with Bamba's fields in ``extra`` (``config_extras``).
        max_positions: length of the rope table.
        tp: None, or a ``models.parallel.TensorParallel``: this rank's Mamba-2 heads (and
            their state), attention heads and MLP columns.
        ops: as ``decoder.DecoderLM``.
    """

    tensor_parallel = True

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        return {**hybrid_tp_dims(config), "intermediate_size": config.intermediate_size}

    def check(self, config: ModelConfig, tp) -> None:
        super().check(config, tp)
        check_layer_types(config, "Bamba")
        if config.hidden_act != "silu":
            raise ValueError(f"Bamba hidden_act must be 'silu', got {config.hidden_act!r}")

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        rotary = Rotary(config.rope, config.head_dim, max_positions)
        layers = [DecoderLayer(config, i, rotary, tp) for i in range(config.num_layers)]
        return decoder.rms_backbone(config, layers, rotary, ("embed_tokens", "final_layernorm"))
