"""What a unikv model needs from a Hugging Face config, in one frozen object.

The HF config (read with ``transformers.AutoConfig``, which fills defaults and
standardises the rope parameters) is translated once into a ``ModelConfig``;
the model code never reads the HF config again. Fields are read through
``models/hf.Fields``, the reader the pool specs use; the family comes from the
architecture (``models/family.FAMILIES``). Per-layer attention windows come from
the family's layer kinds, the rule the pool specs classify layers by: a "swa"
layer sees ``sliding_window`` keys (transformers' ``layer_types[i] ==
"sliding_attention"``; Mistral, without ``layer_types``, slides every layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unikv.models import family as families
from unikv.models.hf import Fields, eos_ids, windows

# Views of models/family.FAMILIES taken at import (the code reads the table itself):
# HF architecture -> unikv family
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    a: f.name for f in families.FAMILIES for a in f.architectures
}
# multimodal wrappers whose text decoder unikv runs: architecture -> (the decoder's weight
# prefix in the checkpoint, unikv's prefix, checkpoint prefixes not loaded); their
# config's fields are read from ``text_config``
TEXT_DECODERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    a: prefixes for f in families.FAMILIES for a, prefixes in f.text_decoders.items()
}


@dataclass(frozen=True)
class ModelConfig:
    """Model hyper-parameters (plain Python values).

    ``windows[i]``: None for full attention, else the number of keys layer i's
    query sees, itself included (transformers' ``sliding_window``). ``state_dims``:
    the dims of the recurrent mixers, from the one function the pool's state spec
    uses (``models/family.py``).
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
    # a multimodal wrapper's placeholder ids of an image or video in a prompt: refused,
    # since unikv runs the text decoder only (no vision tower fills them)
    media_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)
    state_dims: Any = None  # the family's recurrent dims (``Family.state_dims``), or None

    @property
    def sm_scale(self) -> float:
        """Softmax scale: the family's own (e.g. Gemma's query_pre_attn_scalar), else
        head_dim ** -0.5."""
        return self.extra.get("sm_scale", self.head_dim**-0.5)


def _family(cfg: Fields) -> tuple[str, families.Family]:
    archs = list(cfg.get("architectures") or [])
    if not archs:
        raise ValueError(
            "config.json names no architecture (the 'architectures' field is empty); "
            f"unikv supports {families.architectures()}"
        )
    fam = families.of_architecture(archs[0])
    if fam is None or fam.model is None:
        raise ValueError(
            f"unsupported architecture {archs[0]!r}; unikv runs {families.architectures()}. "
            "Pick a checkpoint of one of these families"
        )
    return archs[0], fam


MEDIA_FIELDS = ("image_token_index", "image_token_id", "video_token_id")


def media_ids(outer: Fields) -> tuple[int, ...]:
    """The wrapper config's image / video placeholder token ids (Gemma-3:
    ``image_token_index``; Qwen3.5: ``image_token_id``, ``video_token_id``)."""
    return tuple(dict.fromkeys(int(outer.get(n)) for n in MEDIA_FIELDS if outer.get(n) is not None))


def model_config_from_hf(hf_config) -> ModelConfig:
    """Translate a transformers ``PretrainedConfig`` into a ``ModelConfig``.

    Raises ValueError for an unsupported architecture or layer type."""
    outer = Fields(hf_config)
    arch, fam = _family(outer)
    if arch in fam.text_decoders:  # a multimodal wrapper: unikv runs its text decoder
        hf_config = outer.need("text_config")
    cfg = Fields(hf_config)
    num_layers = cfg.need("num_hidden_layers")
    num_heads = cfg.need("num_attention_heads")
    head_dim = cfg.get("head_dim") or cfg.need("hidden_size") // num_heads
    rope = dict(cfg.get("rope_parameters") or {})
    rope.setdefault("rope_type", "default")
    if "rope_theta" not in rope:
        rope["rope_theta"] = cfg.get("rope_theta", 10000.0)
    act = cfg.get("hidden_act", "silu")
    if fam.name == "llama" and act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; unikv's Llama family runs 'silu'")
    attention_bias = bool(cfg.get("attention_bias", False))
    kinds = fam.layer_kinds(cfg)
    if len(kinds) != num_layers:
        raise ValueError(
            f"the config's layer types name {len(kinds)} layers but num_hidden_layers is "
            f"{num_layers}; fix config.json"
        )
    common = {
        "architecture": arch,
        "family": fam.name,
        "vocab_size": cfg.need("vocab_size"),
        "hidden_size": cfg.need("hidden_size"),
        "intermediate_size": cfg.get("intermediate_size", 0),
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or num_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(cfg.first("rms_norm_eps", "layer_norm_epsilon", "norm_eps")),
        "max_position_embeddings": cfg.need("max_position_embeddings"),
        "rope": rope,
        "windows": windows(cfg, kinds),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "hidden_act": act,
        "eos_token_ids": eos_ids(cfg) or eos_ids(outer),
        "media_token_ids": media_ids(outer) if arch in fam.text_decoders else (),
        "extra": fam.config_extras(hf_config),
        "state_dims": families.load(fam.state_dims)(cfg) if fam.state_dims else None,
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
            num_experts=cfg.need("num_local_experts"),
            num_experts_per_tok=cfg.need("num_experts_per_tok"),
            attention_sinks=True,
        )
    if fam.name not in ("llama", "gpt_oss"):  # a hybrid family: its own fields are in extra
        return ModelConfig(**common, qkv_bias=attention_bias, o_bias=attention_bias)
    return ModelConfig(
        **common,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )
