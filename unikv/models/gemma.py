"""Gemma-2 (``Gemma2ForCausalLM``) and Gemma-3 text (``Gemma3ForCausalLM``) on
unikv's layers; also the text decoder of the multimodal ``Gemma3ForConditionalGeneration``
(the ``text_decoders`` entry of ``models/family.py``: weights under
``language_model.``, the vision tower not loaded, no final soft-cap, as transformers'
wrapper).

    x = embed(ids) * sqrt(hidden)                   (the scale rounded to the model dtype)
    per layer:
      x = x + post_attention_layernorm(self_attn(input_layernorm(x)))
      x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    logits = cap * tanh(lm_head(norm(x)) / cap)     (final soft-capping, when set)

- Norms are Gemma's ``x_hat * (1 + w)`` in fp32, cast back after the product
  (the zero-centred RMSNorm of ``qwen3_5.py``). Each post-norm, the residual add
  and the next pre-norm (the next layer's ``input_layernorm`` too) run as one op,
  ``sandwich_rms_norm`` (``decoder.chain``), each value rounded as transformers
  rounds it (the residual stream in the model dtype).
- Sliding and full layers follow ``layer_types`` (Gemma-2 alternates, Gemma-3
  has five sliding layers per full one); each layer type has its own rope table
  (Gemma-3: ``rope_parameters[layer_type]``, transformers' standardisation of
  the legacy ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``).
- Attention: softmax scale ``query_pre_attn_scalar ** -0.5``; Gemma-2 soft-caps
  the attention logits (``attn_logit_softcapping``), Gemma-3 q/k-normalises each
  head instead. transformers 5.17's Gemma-3 never passes its
  ``attn_logit_softcapping`` to attention, so neither does unikv. The scale and
  the cap reach the kernels through ``ModelConfig.extra`` ("sm_scale",
  "attn_soft_cap"), read by the engine's runner.
- MLP: ``down(gelu_tanh(gate(x)) * up(x))``; embeddings tied to ``lm_head``.

Names mirror transformers (``model.layers.i.self_attn.q_proj``,
``...pre_feedforward_layernorm``), so a checkpoint loads by name.
"""

from __future__ import annotations

import functools

import torch

from unikv.models import decoder
from unikv.models.config import ModelConfig
from unikv.models.layers import Attention, GatedMLP
from unikv.models.qwen3_5 import ZeroCenteredRMSNorm as GemmaRMSNorm
from unikv.models.rope import Rotary

LAYER_TYPES = ("sliding_attention", "full_attention")


def _cap(hf_config, name: str) -> float:
    value = getattr(hf_config, name, None)
    if value is not None and not value > 0:
        raise ValueError(
            f"{name} must be a positive number or null, got {value!r}; fix config.json"
        )
    return float(value or 0.0)


def _rope_by_type(hf_config) -> dict[str, dict]:
    """Layer type -> standardised rope parameters (Gemma-2: one set for both)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if hf_config.model_type == "gemma2":
        params.setdefault("rope_type", "default")
        params.setdefault("rope_theta", 10000.0)
        return {t: params for t in LAYER_TYPES}
    missing = [t for t in LAYER_TYPES if not isinstance(params.get(t), dict)]
    if missing:
        raise ValueError(
            f"Gemma-3 rope_parameters must hold one dict per layer type {list(LAYER_TYPES)}, "
            f"got {params!r}; read config.json with transformers' Gemma3TextConfig"
        )
    return {t: dict(params[t]) for t in LAYER_TYPES}


def config_extras(hf_config) -> dict:
    """Gemma's own fields of a transformers ``Gemma2Config`` / ``Gemma3TextConfig``
    (into ``ModelConfig.extra``). ValueError for what unikv does not run:
    bidirectional attention, an MLP activation other than gelu-tanh, unknown
    layer types."""
    gemma3 = hf_config.model_type == "gemma3_text"
    act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"Gemma hidden_activation {act!r} is not supported; unikv runs 'gelu_pytorch_tanh'"
        )
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError(
            "use_bidirectional_attention=True (an encoder-style Gemma) is not supported by "
            "unikv's causal engine; use a causal checkpoint"
        )
    layer_types = tuple(hf_config.layer_types)
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad or len(layer_types) != hf_config.num_hidden_layers:
        raise ValueError(
            f"Gemma needs layer_types of {hf_config.num_hidden_layers} entries out of "
            f"{list(LAYER_TYPES)}, got {list(layer_types)}; fix config.json"
        )
    return {
        "layer_types": layer_types,
        "rope_by_type": _rope_by_type(hf_config),
        "sm_scale": float(hf_config.query_pre_attn_scalar) ** -0.5,
        "attn_soft_cap": 0.0 if gemma3 else _cap(hf_config, "attn_logit_softcapping"),
        "final_soft_cap": _cap(hf_config, "final_logit_softcapping"),
        "qk_norm": gemma3,
    }


class GemmaAttention(Attention):
    """unikv's attention block (q/k/v/o projections, rope, ``attn``) with Gemma-3's
    per-head ``(1 + w)`` q/k norms before the rope; ``tp`` shards the heads as
    ``layers.Attention`` (the per-head norms and soft-cap need nothing more)."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__(config, layer, rotary, tp)
        if config.extra["qk_norm"]:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)


class GeluMLP(GatedMLP):
    """``down(gelu_tanh(gate(x)) * up(x))`` (transformers' ``gelu_pytorch_tanh``):
    gate|up one GEMM (the decoder fuses the pre-norm into it) and the activation one
    elementwise op (the backend's ``gelu_tanh_mul``), then down."""

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:  # (the GEMV fuses SwiGLU only)
        return self.down_proj(self.ops.gelu_tanh_mul(gate_up))


class DecoderLayer(decoder.DecoderLayer):
    """Attention and MLP, each between a pre-norm and a post-norm (sandwich norms:
    ``decoder.Block``'s ``post``; ``decoder.chain`` runs each post-norm with the
    residual add and the next pre-norm in one ``sandwich_rms_norm``, as Gemma adds the
    residual after the post-norm). ``tp``: this rank's heads and MLP columns; the norms
    act on the whole (all-reduced) hidden state, so they stay replicated."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(config, layer, rotary, tp)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        # GeLU-tanh, not SwiGLU: the activation is a launch of its own before down
        self.mlp = GeluMLP(config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.blocks = [
            decoder.Block(
                self.input_layernorm, self.self_attn, mixes=True, post=self.post_attention_layernorm
            ),
            decoder.Block(
                self.pre_feedforward_layernorm, self.mlp, mixes=False,
                post=self.post_feedforward_layernorm,
            ),
        ]  # fmt: skip


class GemmaForCausalLM(decoder.DecoderLM):
    """Gemma-2 / Gemma-3 (text) over unikv's paged attention, on the shared decoder
    (``decoder.DecoderLM``: residual adds inside the next pre-norm, each pre-norm of
    attention inside its q|k|v GEMM).

    Two fused pieces are off, where Gemma's math differs: the embedding is scaled by
    sqrt(hidden) before the first norm (``scale_embedding``: no gather inside the first
    GEMM), and with a final soft-cap the greedy argmax runs on the capped logits after
    the head (``finish_logits``: tanh's rounding may tie logits the head kept apart).

    Args:
        config: the model's hyper-parameters (``extra`` from ``config_extras``).
        max_positions: length of the rope tables (the engine's max context).
        tp: None, or a ``models.parallel.TensorParallel``: this rank's heads and MLP
            columns (``parallel.py``); the default ``tp_dims`` (heads, KV heads,
            ``intermediate_size``) are Gemma's sharded fields.
        ops: as ``decoder.DecoderLM``.
    """

    scales_embedding = True
    tensor_parallel = True

    def __init__(self, config: ModelConfig, max_positions: int, tp=None, **kw) -> None:
        super().__init__(config, max_positions, tp, **kw)
        self.final_soft_cap = config.extra["final_soft_cap"]
        if config.architecture == "Gemma3ForConditionalGeneration":
            # transformers' multimodal wrapper never applies text_config's
            # final_logit_softcapping (Gemma3ForCausalLM does); released Gemma-3
            # configs leave it null, so the two agree on every released checkpoint
            self.final_soft_cap = 0.0
        self.register_buffer("embed_scale", torch.empty(()), persistent=False)

    @property
    def finishes_logits(self) -> bool:  # a host float fixed at construction
        return self.final_soft_cap > 0

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        layer = functools.partial(DecoderLayer, tp=tp)
        return decoder.typed_rope_backbone(config, max_positions, LAYER_TYPES, layer, norm)

    def build(self, device: torch.device) -> None:
        """Non-parameter tables on ``device``: the rope cos/sin per layer type and
        the embedding scale sqrt(hidden), rounded to the model dtype as transformers
        does (an fp32 scalar cast to the embedding's dtype)."""
        super().build(device)
        scale = torch.tensor(self.config.hidden_size**0.5)  # fp32
        self.embed_scale = scale.to(self.model.embed_tokens.weight.dtype).to(device)

    def scale_embedding(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.embed_scale

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Final soft-capping, in the model dtype."""
        return torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
