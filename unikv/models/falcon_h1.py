"""Falcon-H1 (``FalconH1ForCausalLM``): attention and a Mamba-2 mixer side by side
in every layer, with muP multipliers.

    h = input_layernorm(x)
    x = x + ssm_out_m * mamba(h) + attn_out_m * self_attn(attn_in_m * h)
    x = x + feed_forward(pre_ff_layernorm(x))

The Mamba-2 mixer (``mamba2.py``) scales its input by ``ssm_in_multiplier`` and
its projection [z | x | B | C | dt] segment-wise by ``ssm_multipliers`` (the
``mup_vector``, rebuilt in ``build``; transformers keeps it out of the
checkpoint); attention is rope attention whose keys are scaled by
``key_multiplier``; the MLP is SwiGLU with ``mlp_multipliers`` (gate, down).
Embeddings and logits are scaled by ``embedding_multiplier`` and
``lm_head_multiplier``.

State: every layer keeps attention K/V in the full-attention sub-pool AND a conv
+ SSM state in the Mamba sub-pool, both under the same model layer index. Names
mirror transformers (``model.layers.i.mamba.*``, ``.self_attn.*``,
``.feed_forward.*``, ``model.final_layernorm``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from unikv.models import decoder
from unikv.models.config import ModelConfig
from unikv.models.hf import Fields, as_float
from unikv.models.layers import Attention, GatedMLP, RMSNorm
from unikv.models.mamba2 import Mamba2Dims, Mamba2Mixer
from unikv.models.parallel import partial_row
from unikv.models.rope import Rotary

# FalconH1Config fields copied into ModelConfig.extra (name -> default)
_EXTRA_FIELDS = {
    "ssm_in_multiplier": 1.0,
    "ssm_out_multiplier": 1.0,
    "ssm_multipliers": None,
    "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 1.0,
    "key_multiplier": 1.0,
    "mlp_multipliers": None,
    "embedding_multiplier": 1.0,
    "lm_head_multiplier": 1.0,
    "mlp_bias": False,
}


def config_extras(hf_config) -> dict:
    """Falcon-H1's own fields of a transformers ``FalconH1Config`` (for
    ``ModelConfig.extra``): every multiplier (the Mamba dims: ``mamba_dims``)."""
    e = {name: getattr(hf_config, name, default) for name, default in _EXTRA_FIELDS.items()}
    e["ssm_multipliers"] = tuple(map(float, e["ssm_multipliers"] or (1.0,) * 5))
    e["mlp_multipliers"] = tuple(map(float, e["mlp_multipliers"] or (1.0, 1.0)))
    return e


def mamba_dims(cfg: Fields) -> Mamba2Dims:
    """The Mamba-2 mixer dims of a Falcon-H1 config (the pool's state spec and the
    model's mixer both come from here); defaults are transformers' FalconH1Config's.
    The inner width is ``mamba_d_ssm``, or ``mamba_expand * hidden_size`` when it is
    explicitly null (1024 when the field is absent); ``mamba_d_head`` "auto" is the
    inner width over ``mamba_n_heads``."""
    if cfg.is_dict and not cfg.has("mamba_d_ssm"):
        d_ssm = 1024
    else:
        d_ssm = cfg.get("mamba_d_ssm") or cfg.get("mamba_expand", 2) * cfg.need("hidden_size")
    heads = cfg.get("mamba_n_heads", 128)
    d_head = cfg.get("mamba_d_head", "auto")
    limit = cfg.get("time_step_limit")
    return Mamba2Dims(
        hidden_size=cfg.need("hidden_size"),
        num_heads=heads,
        head_dim=d_ssm // heads if d_head == "auto" else d_head,
        n_groups=cfg.get("mamba_n_groups", 1),
        state_size=cfg.get("mamba_d_state", 256),
        conv_kernel=cfg.get("mamba_d_conv", 4),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        out_bias=bool(cfg.get("projectors_bias", False)),
        activation=cfg.get("hidden_act", "silu"),
        eps=float(cfg.get("rms_norm_eps", 1e-5)),
        dt_limit=(0.0, float("inf")) if limit is None else tuple(map(as_float, limit)),
        norm=bool(cfg.get("mamba_rms_norm", False)),
        norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
        norm_weight_in_fp32=True,
        fields=("mamba_n_heads", "mamba_n_groups"),
    )


class FalconMixer(Mamba2Mixer):
    """The Mamba-2 mixer with Falcon-H1's input multiplier and muP projection scale."""

    def __init__(self, config: ModelConfig, layer: int, tp=None) -> None:
        super().__init__(config.state_dims, layer, tp)
        self.in_multiplier = config.extra["ssm_in_multiplier"]
        self.register_buffer("mup_vector", torch.ones(self.in_proj.out_features), persistent=False)

    def build(self, multipliers: tuple[float, ...]) -> None:
        """Fill ``mup_vector`` (I + C + H,): [z (I) | x (I) | B (G N) | C (G N) | dt (H)]
        scaled by ``multipliers[0..4]`` (transformers' compute_mup_vector); under tp
        the rank's own widths (``dims`` are its share)."""
        d = self.dims
        inner, gn = d.intermediate_size, d.n_groups * d.state_size
        sizes = [inner, inner, gn, gn, d.num_heads]
        parts = [torch.full((n,), m) for n, m in zip(sizes, multipliers)]
        self.mup_vector.copy_(torch.cat(parts))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj(x * self.in_multiplier) * self.mup_vector


class KeyScaledAttention(Attention):
    """Rope attention with keys scaled by ``key_multiplier`` after k_proj (under ``tp``
    this rank's heads, as ``layers.Attention``). The stock forward: q|k|v is one GEMM
    (the decoder fuses the pre-norm into it) and the keys are scaled after the split."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__(config, layer, rotary, tp)
        self.key_scale = config.extra["key_multiplier"]


class ScaledMLP(GatedMLP):
    """``down(up(x) * silu(gate(x) * m_gate)) * m_down`` (under ``tp``: gate and up
    column-parallel, down row-parallel). gate|up is one GEMM, as ``GatedMLP``'s; the
    multipliers apply after it, in transformers' order."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        super().__init__(dataclasses.replace(config, mlp_bias=bool(config.extra["mlp_bias"])), tp)
        self.gate_multiplier, self.down_multiplier = config.extra["mlp_multipliers"]

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        y = up * nn.functional.silu(gate * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class DecoderLayer(decoder.DecoderLayer):
    """Mamba-2 and attention side by side behind ``input_layernorm`` (one block whose
    body is ``mix``), then the MLP behind ``pre_ff_layernorm`` (``decoder.Block`` s)."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__()
        e, eps = config.extra, config.rms_norm_eps
        self.feed_forward = ScaledMLP(config, tp)
        self.mamba = FalconMixer(config, layer, tp)
        self.self_attn = KeyScaledAttention(config, layer, rotary, tp)
        self.tp = tp
        if tp is not None:  # both mixers' partial sums, scaled and added, reduced once
            self.mamba.out_proj = partial_row(self.mamba.out_proj, tp)
            self.self_attn.o_proj = partial_row(self.self_attn.o_proj, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps)
        self.ssm_out = e["ssm_out_multiplier"]
        self.attn_in, self.attn_out = e["attention_in_multiplier"], e["attention_out_multiplier"]
        self.blocks = [
            decoder.Block(self.input_layernorm, self.mix, mixes=True),
            decoder.Block(self.pre_ff_layernorm, self.feed_forward, mixes=False),
        ]

    def mix(self, h: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """The mixers' muP-scaled sum on the normed stream h: (T, hidden) -> (T, hidden)."""
        m = self.mamba(h, positions, attn) * self.ssm_out
        a = self.self_attn(h * self.attn_in, positions, attn) * self.attn_out
        return m + a if self.tp is None else self.tp.all_reduce(m + a)


class FalconH1ForCausalLM(decoder.DecoderLM):
    """Falcon-H1 over unikv's step object (paged attention + recurrent-state ops), on the
    shared decoder (``decoder.DecoderLM``: each residual add inside the next norm).

    Its muP multipliers opt out of two fused pieces: the embedding is scaled before the
    first norm (``scale_embedding``: no gather inside a GEMM; the first block has none
    anyway) and the logits after the head (``finish_logits``: the greedy argmax runs
    on the scaled logits, after the head, as the sampler would).

    Args:
        config: ModelConfig with Falcon-H1's fields in ``extra`` (``config_extras``).
        max_positions: length of the rope table.
        tp: None, or a ``models.parallel.TensorParallel``: this rank's Mamba-2 heads
            (and their state), attention heads and MLP columns; the two mixers' sum
            and the MLP all-reduce once each.
        ops: as ``decoder.DecoderLM``.
    """

    tensor_parallel = True
    scales_embedding = True
    finishes_logits = True

    def check(self, config: ModelConfig, tp) -> None:
        super().check(config, tp)
        if config.hidden_act != "silu":
            raise ValueError(f"Falcon-H1 hidden_act must be 'silu', got {config.hidden_act!r}")

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        rotary = Rotary(config.rope, config.head_dim, max_positions)
        layers = [DecoderLayer(config, i, rotary, tp) for i in range(config.num_layers)]
        return decoder.rms_backbone(config, layers, rotary, ("embed_tokens", "final_layernorm"))

    def build(self, device: torch.device) -> None:
        """After ``to(dtype).to_empty``: the rope table and every mixer's ``mup_vector``."""
        super().build(device)
        with torch.no_grad():
            for layer in self.model.layers:
                layer.mamba.build(self.config.extra["ssm_multipliers"])

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """Attention heads, the MLP's columns and ``mamba_n_heads`` (the groups:
        ``Mamba2Dims.shard``)."""
        return {**super().tp_dims(config), "mamba_n_heads": config.state_dims.num_heads}

    def scale_embedding(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.config.extra["embedding_multiplier"]

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.config.extra["lm_head_multiplier"]
