"""The one reader of Hugging Face config fields, and the rules both sides share.

``Fields`` reads a transformers config object or a plain dict (config.json's
content) alike, without transformers. The pool specs (``unikv.hf_config``) and the
model config (``models/config.py``) read every field through it, and both take a
layer's kind and window from the same rules here, so they cannot disagree.

Layer kinds (docs/design.md section 4): "full", "swa", "mla", "mamba" (recurrent
state), "none" (no cached state), "full+mamba" (attention and a Mamba mixer in one
layer: side by side in Falcon-H1, one feeding the other in Zamba2's hybrid layers). Where a dict lacks a field that transformers' config class derives, the
class's own rule is reproduced (e.g. Gemma-2's alternating layer pattern).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class Fields:
    """Uniform read access to a config object or dict."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.is_dict = isinstance(source, Mapping)

    def get(self, name: str, default: Any = None) -> Any:
        if self.is_dict:
            value = self.source.get(name, default)
        else:
            value = getattr(self.source, name, default)
        return default if value is None else value

    def has(self, name: str) -> bool:
        """Whether the field is present at all (even as null)."""
        return name in self.source if self.is_dict else hasattr(self.source, name)

    def need(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise ValueError(
                f"{self.get('model_type')!r} config lacks {name!r}; give a complete config"
            )
        return value

    def first(self, *names: str) -> Any:
        """The first of ``names`` the config has (families name some fields differently)."""
        for name in names:
            value = self.get(name)
            if value is not None:
                return value
        raise ValueError(f"config.json has none of {list(names)}; give a complete config")


def as_float(value: Any) -> float:
    """A float field; transformers writes a non-finite one to JSON as
    ``{"__float__": "Infinity"}``."""
    if isinstance(value, Mapping) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


@dataclass(frozen=True)
class StateDims:
    """A recurrent mixer's state: conv window ``(conv_dim, conv_kernel)`` and the
    temporal state ``state_shape`` (``()``: none, a conv-only mixer such as LFM2's). Family dims classes (``mamba2.Mamba2Dims``,
    ``qwen3_5.GatedDeltaNetDims``) offer the same three names."""

    conv_dim: int
    conv_kernel: int
    state_shape: tuple[int, ...]


# -- layer kinds ------------------------------------------------------------------

KindsFn = Callable[[Fields], list[str]]

HF_KIND = {
    "full_attention": "full",
    "sliding_attention": "swa",
    "linear_attention": "mamba",  # Gated DeltaNet (Qwen3.5/Next), Mamba-2 (NemotronH)
    "mamba": "mamba",
    "mlp": "none",
    "moe": "none",
    "conv": "mamba",  # LFM2's short convolution: a conv window alone, in a state slot
}


def kinds_from(cfg: Fields, default: Callable[[int], str]) -> list[str]:
    """``layer_types`` if the config has it, else ``default(i)`` per layer."""
    layer_types = cfg.get("layer_types")
    n = len(layer_types) if layer_types is not None else cfg.need("num_hidden_layers")
    if layer_types is None:
        return [default(i) for i in range(n)]
    unknown = sorted(set(layer_types) - set(HF_KIND))
    if unknown or len(layer_types) != n:
        raise ValueError(
            f"layer_types must list {n} entries out of {sorted(HF_KIND)}, got {list(layer_types)}"
        )
    return [HF_KIND[t] for t in layer_types]


def kinds_uniform(cfg: Fields) -> list[str]:  # Llama, Mistral, Mixtral: window on every layer
    return kinds_from(cfg, lambda i: "swa" if cfg.get("sliding_window") else "full")


def kinds_qwen(cfg: Fields) -> list[str]:  # sliding from layer max_window_layers on, if enabled
    on = cfg.get("use_sliding_window", False) and cfg.get("sliding_window")
    first = cfg.get("max_window_layers", 0)
    return kinds_from(cfg, lambda i: "swa" if on and i >= first else "full")


def kinds_every(pattern: int) -> KindsFn:  # gemma, gpt-oss
    def kinds(cfg: Fields) -> list[str]:
        period = cfg.get("sliding_window_pattern", pattern)
        return kinds_from(cfg, lambda i: "swa" if (i + 1) % period else "full")

    return kinds


def kinds_mla(cfg: Fields) -> list[str]:
    return ["mla"] * cfg.need("num_hidden_layers")


def kinds_linear(cfg: Fields) -> list[str]:  # Qwen3.5 / Qwen3-Next: linear, every 4th full
    interval = cfg.get("full_attention_interval", 4)
    return kinds_from(cfg, lambda i: "mamba" if (i + 1) % interval else "full")


def kinds_kimi_linear(cfg: Fields) -> list[str]:
    """Kimi-Linear: MLA ("full_attention") and Kimi Delta Attention ("linear_attention")
    layers, from ``layer_types``, else the release's ``linear_attn_config`` (1-based
    ``full_attn_layers`` / ``kda_layers``), else transformers' default (every 4th from
    layer 4 on is MLA)."""
    n = cfg.need("num_hidden_layers")
    types = cfg.get("layer_types")
    lin = cfg.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in lin and "kda_layers" in lin:
        types = [None] * n
        for i in lin["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lin["kda_layers"]:
            types[i - 1] = "linear_attention"
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    kinds = {"full_attention": "mla", "linear_attention": "mamba"}
    if len(types) != n or any(t not in kinds for t in types):
        raise ValueError(
            f"kimi_linear layer types must list {n} entries, each 'full_attention' or "
            f"'linear_attention', got {list(types)}; fix layer_types / linear_attn_config"
        )
    return [kinds[t] for t in types]


_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def kinds_nemotron_h(cfg: Fields) -> list[str]:
    """NemotronH: ``layers_block_type`` (or the legacy ``hybrid_override_pattern``,
    one letter per layer: M Mamba-2, * attention, - MLP, E MoE)."""
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None:
        pattern = cfg.need("hybrid_override_pattern")
        bad = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
        if bad:
            raise ValueError(
                f"hybrid_override_pattern {pattern!r} has letters {bad}; NemotronH uses "
                f"{sorted(_NEMOTRON_PATTERN)}"
            )
        types = [_NEMOTRON_PATTERN[c] for c in pattern]
    types = ["linear_attention" if t == "mamba" else t for t in types]
    return kinds_from(Fields({"layer_types": list(types)}), lambda i: "full")


def kinds_bamba(cfg: Fields) -> list[str]:
    attn = set(cfg.get("attn_layer_indices", []))
    return ["full" if i in attn else "mamba" for i in range(cfg.need("num_hidden_layers"))]


def kinds_lfm2(cfg: Fields) -> list[str]:
    """LFM2: ``layer_types`` ("conv" a short-conv state slot, "full_attention"), else
    attention on ``full_attn_idxs`` (transformers' Lfm2Config: every layer when unset)."""
    idxs = cfg.get("full_attn_idxs")
    return kinds_from(cfg, lambda i: "full" if idxs is None or i in idxs else "mamba")


# transformers' legacy layer-type names (its remap_legacy_layer_types)
_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


def kinds_granite_h(cfg: Fields) -> list[str]:
    """Granite-4.0-H: ``layer_types`` ("mamba" / "attention", or transformers' names),
    every layer Mamba-2 when absent (GraniteMoeHybridConfig's default)."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if types is None:
        return ["mamba"] * cfg.need("num_hidden_layers")
    types = [_LEGACY_TYPES.get(t, t) for t in types]
    return kinds_from(Fields({"layer_types": types}), lambda i: "full")


def _zamba2_default_types() -> list[str]:  # Zamba2Config's pattern when none is given
    types = ["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"]
    return types + ["mamba"] * 3 + ["hybrid"] + ["mamba"] * 2


def kinds_zamba2(cfg: Fields) -> list[str]:
    """Zamba2: ``layers_block_type``, "mamba" (Mamba-2) or "hybrid" (a shared attention
    block, with its own K/V cache, feeding the layer's Mamba-2 mixer: kind
    "full+mamba")."""
    types = cfg.get("layers_block_type") or cfg.get("layer_types") or _zamba2_default_types()
    kinds = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "full+mamba"}
    n = cfg.get("num_hidden_layers", len(types))
    if len(types) != n or set(types) - set(kinds):
        raise ValueError(
            f"a zamba2 config must list {n} layers of 'mamba' or 'hybrid', got layer types "
            f"{list(types)}; fix layers_block_type"
        )
    return [kinds[t] for t in types]


def kinds_jamba(cfg: Fields) -> list[str]:
    """Jamba: attention on layers ``i % attn_layer_period == attn_layer_offset``, Mamba-1
    elsewhere (transformers' JambaConfig.layers_block_type)."""
    period, offset = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
    return kinds_from(cfg, lambda i: "full" if i % period == offset else "mamba")


def kinds_mimo_v2_flash(cfg: Fields) -> list[str]:
    """MiMo-V2-Flash: ``layer_types``, else the hub's ``hybrid_layer_pattern`` (0 full,
    1 sliding), else transformers' default: full on layer 0 and every sixth layer."""
    pattern = cfg.get("hybrid_layer_pattern")
    if cfg.get("layer_types") is None and pattern is not None:
        if set(pattern) - {0, 1} or len(pattern) != cfg.need("num_hidden_layers"):
            raise ValueError(
                f"hybrid_layer_pattern must list num_hidden_layers entries of 0 (full) or 1 "
                f"(sliding), got {list(pattern)}; fix config.json"
            )
        return ["swa" if p else "full" for p in pattern]
    return kinds_from(cfg, lambda i: "full" if i == 0 or (i + 1) % 6 == 0 else "swa")


def kinds_falcon_h1(cfg: Fields) -> list[str]:
    """Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side, so every
    layer is in both the "full" and the "mamba" sub-pool (kind "full+mamba")."""
    n = cfg.need("num_hidden_layers")
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is not None and (len(types) != n or set(types) != {"hybrid"}):
        raise ValueError(
            f"a falcon_h1 config must list {n} 'hybrid' layers (attention and Mamba-2 side by "
            f"side), got layer types {list(types)}; fix layers_block_type"
        )
    return ["full+mamba"] * n


# -- windows, EOS -----------------------------------------------------------------


def swa_window(cfg: Fields) -> int:
    """The sliding layers' window: keys a query sees, itself included."""
    window = cfg.need("sliding_window")
    if (
        cfg.is_dict
        and cfg.get("model_type") == "gemma3_text"
        and cfg.get("use_bidirectional_attention")
    ):
        window = window // 2 + 1  # what Gemma3TextConfig.__post_init__ does
    return window


def windows(cfg: Fields, kinds: list[str]) -> tuple[int | None, ...]:
    """Per layer: ``swa_window`` for a "swa" layer, else None (full attention or none)."""
    return tuple(swa_window(cfg) if kind == "swa" else None for kind in kinds)


def eos_ids(cfg: Fields) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
