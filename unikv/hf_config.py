"""From a Hugging Face model config to unikv sub-pool specs.

Each model layer is classified as one kind of cached state, and the layers of
one kind form one sub-pool (docs/design.md section 4):

    full   full attention K/V            -> MHASpec                 (page_size ps)
    swa    sliding-window attention K/V  -> MHASpec(sliding_window) (page_size ps)
    mla    multi-head latent attention   -> MLASpec                 (page_size ps)
    mamba  recurrent state: Mamba-2 conv + SSM state, or Gated DeltaNet conv +
           delta-rule state                 -> MambaSpec               (page_size 1)
    none   no cached state (MLP-only or MoE-only layers of NemotronH)

Attention specs come from ``_mha`` (one KV head count and width for every layer)
unless the architecture has its own builder in ``MHA_SPECS``: MiMo-V2-Flash has
asymmetric K/V heads (``head_dim`` 192, ``v_head_dim`` 128) and twice the KV heads
on its sliding layers.

The input may be a transformers config object, a plain dict (config.json's
content) or a path to a config.json or its directory. Dicts are read without
transformers: where a field is missing, the rule transformers' own config class
applies is reproduced here (e.g. Gemma-2's alternating layer pattern).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from unikv.pool import SubPoolConfig
from unikv.specs import FP8_DTYPES, MambaSpec, MHASpec, MLASpec, StatePart

DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a dtype or one of ``DTYPE_NAMES`` (e.g. "bf16", "fp8")."""
    if isinstance(value, torch.dtype):
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(
            f"dtype must be one of {sorted(DTYPE_NAMES)} or a torch.dtype, got {value!r}"
        )
    return DTYPE_NAMES[key]


@dataclass(frozen=True)
class ModelSpecs:
    """The sub-pools of one model plus the model facts a pool plan needs.

    ``layer_kinds[i]`` is the kind of model layer ``i`` ("full", "swa", "mla",
    "mamba", or "none" for a layer without cache; "full+mamba" for a layer with
    attention and a Mamba mixer side by side, Falcon-H1, which is in both sub-pools);
    ``subpools`` lists one SubPoolConfig per kind present, whose ``layers`` name the
    model layers it serves.
    """

    model_type: str
    num_hidden_layers: int
    max_position_embeddings: int | None
    layer_kinds: tuple[str, ...]
    subpools: tuple[SubPoolConfig, ...]


class _Fields:
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

    def need(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise ValueError(
                f"{self.get('model_type')!r} config lacks {name!r}; give a complete config"
            )
        return value


# -- per-architecture layer kinds -------------------------------------------------

_HF_KIND = {
    "full_attention": "full",
    "sliding_attention": "swa",
    "linear_attention": "mamba",  # Gated DeltaNet (Qwen3.5/Next), Mamba-2 (NemotronH)
    "mamba": "mamba",
    "mlp": "none",
    "moe": "none",
}


def _kinds_from(cfg: _Fields, default: Callable[[int], str]) -> list[str]:
    """``layer_types`` if the config has it, else ``default(i)`` per layer."""
    layer_types = cfg.get("layer_types")
    n = len(layer_types) if layer_types is not None else cfg.need("num_hidden_layers")
    if layer_types is None:
        return [default(i) for i in range(n)]
    unknown = sorted(set(layer_types) - set(_HF_KIND))
    if unknown or len(layer_types) != n:
        raise ValueError(
            f"layer_types must list {n} entries out of {sorted(_HF_KIND)}, got {list(layer_types)}"
        )
    return [_HF_KIND[t] for t in layer_types]


def _kinds_uniform(cfg: _Fields) -> list[str]:  # Llama, Mistral, Mixtral: window on every layer
    return _kinds_from(cfg, lambda i: "swa" if cfg.get("sliding_window") else "full")


def _kinds_qwen(cfg: _Fields) -> list[str]:  # sliding from layer max_window_layers on, if enabled
    on = cfg.get("use_sliding_window", False) and cfg.get("sliding_window")
    first = cfg.get("max_window_layers", 0)
    return _kinds_from(cfg, lambda i: "swa" if on and i >= first else "full")


def _kinds_every(pattern: int) -> Callable[[_Fields], list[str]]:  # gemma, gpt-oss
    def kinds(cfg: _Fields) -> list[str]:
        period = cfg.get("sliding_window_pattern", pattern)
        return _kinds_from(cfg, lambda i: "swa" if (i + 1) % period else "full")

    return kinds


def _kinds_mla(cfg: _Fields) -> list[str]:
    return ["mla"] * cfg.need("num_hidden_layers")


def _kinds_linear(cfg: _Fields) -> list[str]:  # Qwen3.5 / Qwen3-Next: linear every 4th full
    interval = cfg.get("full_attention_interval", 4)
    return _kinds_from(cfg, lambda i: "mamba" if (i + 1) % interval else "full")


_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _kinds_nemotron_h(cfg: _Fields) -> list[str]:
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
    return _kinds_from(_Fields({"layer_types": list(types)}), lambda i: "full")


def _kinds_bamba(cfg: _Fields) -> list[str]:
    attn = set(cfg.get("attn_layer_indices", []))
    return ["full" if i in attn else "mamba" for i in range(cfg.need("num_hidden_layers"))]


def _kinds_jamba(cfg: _Fields) -> list[str]:
    """Jamba: attention on layers ``i % attn_layer_period == attn_layer_offset``, Mamba-1
    elsewhere (transformers' JambaConfig.layers_block_type)."""
    period, offset = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
    return _kinds_from(cfg, lambda i: "full" if i % period == offset else "mamba")


def _kinds_mimo_v2_flash(cfg: _Fields) -> list[str]:
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
    return _kinds_from(cfg, lambda i: "full" if i == 0 or (i + 1) % 6 == 0 else "swa")


def _kinds_falcon_h1(cfg: _Fields) -> list[str]:
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


ARCHITECTURES: dict[str, Callable[[_Fields], list[str]]] = {
    "llama": _kinds_uniform,
    "mistral": _kinds_uniform,
    "mixtral": _kinds_uniform,
    "qwen2": _kinds_qwen,
    "qwen2_moe": _kinds_qwen,
    "qwen3": _kinds_qwen,
    "qwen3_moe": _kinds_qwen,
    "gpt_oss": _kinds_every(2),
    "gemma2": _kinds_every(2),
    "gemma3_text": _kinds_every(6),
    "deepseek_v2": _kinds_mla,
    "deepseek_v3": _kinds_mla,
    "bamba": _kinds_bamba,
    "qwen3_5_text": _kinds_linear,
    "qwen3_next": _kinds_linear,
    "nemotron_h": _kinds_nemotron_h,
    "qwen3_5_moe_text": _kinds_linear,
    "jamba": _kinds_jamba,
    "falcon_h1": _kinds_falcon_h1,
    "mimo_v2_flash": _kinds_mimo_v2_flash,
}


# -- specs per kind ---------------------------------------------------------------


def _mha(cfg: _Fields, num_layers: int, dtype: torch.dtype, window: int | None) -> MHASpec:
    heads = cfg.need("num_attention_heads")
    head_dim = cfg.get("head_dim") or cfg.need("hidden_size") // heads
    return MHASpec(
        num_layers=num_layers,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=head_dim,
        dtype=dtype,
        sliding_window=window,
    )


def _mha_mimo_v2_flash(
    cfg: _Fields, num_layers: int, dtype: torch.dtype, window: int | None
) -> MHASpec:
    """MiMo-V2-Flash: K heads of ``head_dim``, V heads of ``v_head_dim`` (asymmetric);
    sliding layers have ``swa_num_key_value_heads`` (the hub's field; transformers:
    twice ``num_key_value_heads``) and the hub's ``swa_head_dim`` / ``swa_v_head_dim``
    where given. Defaults are transformers' MiMoV2FlashConfig's."""
    kv, d = cfg.get("num_key_value_heads", 4), cfg.get("head_dim", 192)
    dv = cfg.get("v_head_dim", 128)
    if window is not None:
        kv = cfg.get("swa_num_key_value_heads", 2 * kv)
        d, dv = cfg.get("swa_head_dim", d), cfg.get("swa_v_head_dim", dv)
    return MHASpec(
        num_layers=num_layers,
        num_kv_heads=kv,
        head_dim=d,
        v_head_dim=dv,
        dtype=dtype,
        sliding_window=window,
    )


# model_type -> the MHASpec builder of its "full" and "swa" layers (default: ``_mha``)
MHA_SPECS: dict[str, Callable[[_Fields, int, torch.dtype, int | None], MHASpec]] = {
    "mimo_v2_flash": _mha_mimo_v2_flash,
}


def _swa_window(cfg: _Fields) -> int:
    window = cfg.need("sliding_window")
    if (
        cfg.is_dict
        and cfg.get("model_type") == "gemma3_text"
        and cfg.get("use_bidirectional_attention")
    ):
        window = window // 2 + 1  # what Gemma3TextConfig.__post_init__ does
    return window


def _mla(cfg: _Fields, num_layers: int, dtype: torch.dtype) -> MLASpec:
    return MLASpec(
        num_layers=num_layers,
        kv_lora_rank=cfg.need("kv_lora_rank"),
        rope_dim=cfg.need("qk_rope_head_dim"),
        dtype=dtype,
    )


def _mamba2(
    cfg: _Fields, num_layers: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype
) -> MambaSpec:
    """Bamba's Mamba-2 mixer: conv state ``(conv_dim, d_conv)`` over x, B and C;
    SSM state ``(n_heads, d_head, d_state)`` (transformers' BambaMixer)."""
    intermediate = cfg.get("mamba_expand", 2) * cfg.need("hidden_size")
    n_heads = cfg.get("mamba_n_heads", 128)
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = intermediate // n_heads if d_head == "auto" else d_head
    d_state = cfg.get("mamba_d_state", 256)
    conv_dim = intermediate + 2 * cfg.get("mamba_n_groups", 1) * d_state
    return MambaSpec(
        num_layers=num_layers,
        conv=(StatePart((conv_dim, cfg.get("mamba_d_conv", 4)), conv_dtype),),
        temporal=StatePart((n_heads, d_head, d_state), ssm_dtype),
    )


def _gated_deltanet(
    cfg: _Fields, num_layers: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype
) -> MambaSpec:
    """Qwen3.5 / Qwen3-Next Gated DeltaNet: conv state ``(2 Hk Dk + Hv Dv, K)`` over
    q, k and v; delta-rule state ``(Hv, Dk, Dv)`` (transformers' LinearAttentionLayer)."""
    hk, dk = cfg.get("linear_num_key_heads", 16), cfg.get("linear_key_head_dim", 128)
    hv, dv = cfg.get("linear_num_value_heads", 32), cfg.get("linear_value_head_dim", 128)
    return MambaSpec(
        num_layers=num_layers,
        conv=(
            StatePart((2 * hk * dk + hv * dv, cfg.get("linear_conv_kernel_dim", 4)), conv_dtype),
        ),
        temporal=StatePart((hv, dk, dv), ssm_dtype),
    )


def _mamba2_nemotron(
    cfg: _Fields, num_layers: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype
) -> MambaSpec:
    """NemotronH's Mamba-2 mixer: conv state ``(H P + 2 G N, d_conv)`` over x, B and C;
    SSM state ``(H, P, N)``."""
    heads, head_dim = cfg.get("mamba_num_heads", 128), cfg.get("mamba_head_dim", 64)
    state = cfg.get("ssm_state_size", 128)
    groups = cfg.get("n_groups") or cfg.get("mamba_n_groups", 8)  # legacy names too
    kernel = cfg.get("conv_kernel") or cfg.get("mamba_d_conv", 4)
    conv_dim = heads * head_dim + 2 * groups * state
    return MambaSpec(
        num_layers=num_layers,
        conv=(StatePart((conv_dim, kernel), conv_dtype),),
        temporal=StatePart((heads, head_dim, state), ssm_dtype),
    )


def _mamba1_jamba(
    cfg: _Fields, num_layers: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype
) -> MambaSpec:
    """Jamba's Mamba-1 mixer: conv state ``(I, d_conv)`` over x and SSM state
    ``(I, d_state)``, with ``I = mamba_expand * hidden_size`` (transformers' JambaMambaMixer)."""
    intermediate = cfg.get("mamba_expand", 2) * cfg.need("hidden_size")
    return MambaSpec(
        num_layers=num_layers,
        conv=(StatePart((intermediate, cfg.get("mamba_d_conv", 4)), conv_dtype),),
        temporal=StatePart((intermediate, cfg.get("mamba_d_state", 16)), ssm_dtype),
    )


def _falcon_h1_d_ssm(cfg: _Fields) -> int:
    """Falcon-H1's Mamba inner width: ``mamba_d_ssm``, or ``mamba_expand * hidden_size``
    when it is explicitly null; transformers' default (1024) when the field is absent."""
    if cfg.is_dict and "mamba_d_ssm" not in cfg.source:
        return 1024
    return cfg.get("mamba_d_ssm") or cfg.get("mamba_expand", 2) * cfg.need("hidden_size")


def _mamba2_falcon_h1(
    cfg: _Fields, num_layers: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype
) -> MambaSpec:
    """Falcon-H1's Mamba-2 mixer: conv state ``(d_ssm + 2 G N, d_conv)`` over x, B and C;
    SSM state ``(n_heads, d_head, N)`` with ``d_head = d_ssm // n_heads`` when "auto"
    (transformers' FalconH1Mixer)."""
    d_ssm = _falcon_h1_d_ssm(cfg)
    n_heads = cfg.get("mamba_n_heads", 128)
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = d_ssm // n_heads if d_head == "auto" else d_head
    d_state = cfg.get("mamba_d_state", 256)
    conv_dim = d_ssm + 2 * cfg.get("mamba_n_groups", 1) * d_state
    return MambaSpec(
        num_layers=num_layers,
        conv=(StatePart((conv_dim, cfg.get("mamba_d_conv", 4)), conv_dtype),),
        temporal=StatePart((n_heads, d_head, d_state), ssm_dtype),
    )


# model_type -> the recurrent state spec of its "mamba" layers (default: Bamba's Mamba-2)
STATE_SPECS: dict[str, Callable[[_Fields, int, torch.dtype, torch.dtype], MambaSpec]] = {
    "qwen3_5_text": _gated_deltanet,
    "qwen3_next": _gated_deltanet,
    "nemotron_h": _mamba2_nemotron,
    "qwen3_5_moe_text": _gated_deltanet,
    "jamba": _mamba1_jamba,
    "falcon_h1": _mamba2_falcon_h1,
}


# -- entry points -----------------------------------------------------------------


def load_config(config: Any) -> Any:
    """A config object or dict from an object, a dict, a config.json path or its directory."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"no config.json at {os.fspath(config)!r}; give a model directory or a JSON file"
            )
        with open(path) as f:
            return json.load(f)
    return config


def _text_config(config: Any) -> _Fields:
    cfg = _Fields(config)
    text = cfg.get("text_config")
    if text is not None and cfg.get("model_type") not in ARCHITECTURES:
        return _Fields(text)  # multimodal wrapper (e.g. gemma3): the decoder is its text config
    return cfg


def model_specs_from_hf_config(
    config: Any,
    *,
    page_size: int = 16,
    dtype: str | torch.dtype = "bfloat16",
    ssm_dtype: str | torch.dtype = "float32",
) -> ModelSpecs:
    """Classify every layer of a Hugging Face config and build one SubPoolConfig per kind.

    Args:
        config: transformers config object, config dict, or path to config.json / its directory.
        page_size: slots per page of the attention sub-pools (Mamba always uses 1).
        dtype: KV dtype (fp8 is stored as uint8); Mamba conv state uses it too,
            except that fp8 falls back to bfloat16 for the conv state.
        ssm_dtype: dtype of the Mamba SSM (temporal) state.
    """
    cfg = _text_config(load_config(config))
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unknown architecture {model_type!r}; unikv knows {sorted(ARCHITECTURES)} "
            "(multimodal configs such as gemma3 are read through their text_config)"
        )
    kv_dtype, ssm = parse_dtype(dtype), parse_dtype(ssm_dtype)
    kinds = ARCHITECTURES[model_type](cfg)
    subpools = []
    for kind in ("full", "swa", "mla", "mamba"):
        layers = tuple(i for i, k in enumerate(kinds) if kind in k.split("+"))
        if not layers:
            continue
        if kind == "full":
            spec = MHA_SPECS.get(model_type, _mha)(cfg, len(layers), kv_dtype, None)
        elif kind == "swa":
            spec = MHA_SPECS.get(model_type, _mha)(cfg, len(layers), kv_dtype, _swa_window(cfg))
        elif kind == "mla":
            spec = _mla(cfg, len(layers), kv_dtype)
        else:
            conv_dtype = torch.bfloat16 if kv_dtype in FP8_DTYPES else kv_dtype
            spec = STATE_SPECS.get(model_type, _mamba2)(cfg, len(layers), conv_dtype, ssm)
        ps = 1 if kind == "mamba" else page_size
        subpools.append(SubPoolConfig(name=kind, spec=spec, page_size=ps, layers=layers))
    return ModelSpecs(
        model_type=model_type,
        num_hidden_layers=len(kinds),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        layer_kinds=tuple(kinds),
        subpools=tuple(subpools),
    )


def specs_from_hf_config(config: Any, **options: Any) -> list[SubPoolConfig]:
    """The sub-pools of a Hugging Face config; see ``model_specs_from_hf_config``."""
    return list(model_specs_from_hf_config(config, **options).subpools)
