"""What a unikv model needs from a Hugging Face config, in one frozen object.

The HF config (read with ``transformers.AutoConfig``, which fills defaults and
standardises the rope parameters) is translated once into a ``ModelConfig``;
the model code never reads the HF config again. Per-layer attention windows
follow transformers: ``layer_types[i] == "sliding_attention"`` selects
``sliding_window`` for layer i; Mistral (no ``layer_types``) applies its window
to every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module  # family readers load lazily (no import cycle)
from typing import Any

# HF architecture name -> unikv model family
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3NextForCausalLM": "qwen3_next",
    "NemotronHForCausalLM": "nemotron_h",
    "FalconH1ForCausalLM": "falcon_h1",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "MiMoV2FlashForCausalLM": "mimo_v2",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

# Multimodal wrappers whose text decoder unikv runs: architecture -> (the decoder's
# weight prefix in the checkpoint, unikv's prefix, checkpoint prefixes not loaded).
# Their config's fields are read from ``text_config``.
TEXT_DECODERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "Qwen3_5ForConditionalGeneration": ("model.language_model.", "model.", ("model.visual.",)),
}
SUPPORTED_ARCHITECTURES.update({"Qwen3_5ForConditionalGeneration": "qwen3_5"})

# unikv family -> reader of the family's own config fields (into ModelConfig.extra);
# the readers live in the families' model modules and register here.
FAMILY_EXTRAS: dict[str, Callable[[Any], dict]] = {}
FAMILY_EXTRAS["qwen3_5"] = lambda c: import_module("unikv.models.qwen3_5").config_extras(c)
FAMILY_EXTRAS["qwen3_next"] = lambda c: import_module("unikv.models.qwen3_next").config_extras(c)
FAMILY_EXTRAS["nemotron_h"] = lambda c: import_module("unikv.models.nemotron_h").config_extras(c)
FAMILY_EXTRAS["falcon_h1"] = lambda c: import_module("unikv.models.falcon_h1").config_extras(c)
FAMILY_EXTRAS["deepseek"] = lambda c: import_module("unikv.models.deepseek").config_extras(c)
FAMILY_EXTRAS["gemma"] = lambda c: import_module("unikv.models.gemma").config_extras(c)
FAMILY_EXTRAS["mimo_v2"] = lambda c: import_module("unikv.models.mimo_v2").config_extras(c)
FAMILY_EXTRAS["mixtral"] = lambda c: import_module("unikv.models.mixtral").config_extras(c)
FAMILY_EXTRAS["qwen3_moe"] = lambda c: import_module("unikv.models.qwen3_moe").config_extras(c)
FAMILY_EXTRAS["gpt_oss"] = lambda c: import_module("unikv.models.gpt_oss").config_extras(c)

# HF layer types that hold no attention K/V of their own (recurrent mixers, MLP-only
# layers): their window is None and their state, if any, lives in the Mamba sub-pool.
NON_ATTENTION_LAYER_TYPES = frozenset({"linear_attention", "mamba", "mlp", "moe"})


@dataclass(frozen=True)
class ModelConfig:
    """Model hyper-parameters (plain Python values).

    ``windows[i]``: None for full attention, else the number of keys layer i's
    query sees, itself included (transformers' ``sliding_window``).
    """

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    windows: tuple[int | None, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    attention_sinks: bool = False
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)

    @property
    def sm_scale(self) -> float:
        """Softmax scale: the family's own (e.g. Gemma's query_pre_attn_scalar), else
        head_dim ** -0.5."""
        return self.extra.get("sm_scale", self.head_dim**-0.5)


def _architecture(hf_config) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        raise ValueError(
            "config.json names no architecture (the 'architectures' field is empty); "
            f"unikv supports {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; unikv runs {sorted(SUPPORTED_ARCHITECTURES)}. "
            "Pick a checkpoint of one of these families"
        )
    return arch


def _windows(hf_config, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return (window,) * num_layers  # Mistral: one window for every layer
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config.layer_types names {len(layer_types)} layers but num_hidden_layers is "
            f"{num_layers}; fix config.json"
        )
    known = {"full_attention", "sliding_attention", "hybrid"} | NON_ATTENTION_LAYER_TYPES
    unknown = sorted(set(layer_types) - known)
    if unknown:
        raise ValueError(
            f"unsupported layer types {unknown}; unikv runs {sorted(known)}; fix config.layer_types"
        )
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _first(hf_config, *names: str):
    """The first of ``names`` the config has (families name some fields differently)."""
    for name in names:
        value = getattr(hf_config, name, None)
        if value is not None:
            return value
    raise ValueError(f"config.json has none of {list(names)}; give a complete config")


def _eos_ids(hf_config) -> tuple[int, ...]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def model_config_from_hf(hf_config) -> ModelConfig:
    """Translate a transformers ``PretrainedConfig`` into a ``ModelConfig``.

    Raises ValueError for an unsupported architecture or layer type."""
    arch = _architecture(hf_config)
    family = SUPPORTED_ARCHITECTURES[arch]
    outer = hf_config
    if arch in TEXT_DECODERS:  # a multimodal wrapper: unikv runs its text decoder
        hf_config = hf_config.text_config
    num_layers = hf_config.num_hidden_layers
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    if "rope_theta" not in rope:
        rope["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    act = getattr(hf_config, "hidden_act", "silu")
    if family == "llama" and act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; unikv's Llama family runs 'silu'")
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    extra = FAMILY_EXTRAS[family](hf_config) if family in FAMILY_EXTRAS else {}
    common = {
        "architecture": arch,
        "family": family,
        "vocab_size": hf_config.vocab_size,
        "hidden_size": hf_config.hidden_size,
        "intermediate_size": getattr(hf_config, "intermediate_size", 0) or 0,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": getattr(hf_config, "num_key_value_heads", None) or num_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_first(hf_config, "rms_norm_eps", "layer_norm_epsilon")),
        "max_position_embeddings": hf_config.max_position_embeddings,
        "rope": rope,
        "windows": _windows(hf_config, num_layers),
        "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        "hidden_act": act,
        "eos_token_ids": _eos_ids(hf_config) or _eos_ids(outer),
        "extra": extra,
    }
    if arch == "Qwen2ForCausalLM":
        return ModelConfig(**common, qkv_bias=True)
    if arch == "Qwen3ForCausalLM":
        return ModelConfig(**common, qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
    if arch == "GptOssForCausalLM":
        return ModelConfig(
            **common,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            num_experts=hf_config.num_local_experts,
            num_experts_per_tok=hf_config.num_experts_per_tok,
            attention_sinks=True,
        )
    if family not in ("llama", "gpt_oss"):  # a hybrid family: its own fields are in extra
        return ModelConfig(**common, qkv_bias=attention_bias, o_bias=attention_bias)
    return ModelConfig(
        **common,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
    )
