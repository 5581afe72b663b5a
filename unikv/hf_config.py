"""From a Hugging Face model config to unikv sub-pool specs.

Each model layer is classified as one kind of cached state, and the layers of
one kind form one sub-pool (docs/design.md section 4):

    full   full attention K/V            -> MHASpec                 (page_size ps)
    swa    sliding-window attention K/V  -> MHASpec(sliding_window) (page_size ps)
    mla    multi-head latent attention   -> MLASpec                 (page_size ps)
    mamba  recurrent state: Mamba-2 conv + SSM state, Gated DeltaNet conv +
           delta-rule state, or an LFM2 short-conv window alone
                                            -> MambaSpec               (page_size 1)
    none   no cached state (MLP-only or MoE-only layers of NemotronH)

The family table (``models/family.py``) says, per HF ``model_type``, how its layers
are classified (``models/hf.py``'s rules, which the model's windows use too), which
function gives its recurrent state's dims (the one its model's mixer is built
from) and, where its K/V heads are not uniform, its attention spec builder
(default ``mha``; MiMo-V2-Flash has asymmetric K/V heads and twice the KV heads on
its sliding layers).

The input may be a transformers config object, a plain dict (config.json's
content) or a path to a config.json or its directory. Dicts are read without
transformers (``models/hf.Fields``): where a field is missing, the rule
transformers' own config class applies is reproduced (e.g. Gemma-2's alternating
layer pattern).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from unikv.models import family
from unikv.models.hf import Fields, StateDims, swa_window
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


# HF model_type -> unikv family: a view of models/family.FAMILIES, taken at import
ARCHITECTURES: dict[str, str] = {t: f.name for f in family.FAMILIES for t in f.model_types}


# -- specs per kind ---------------------------------------------------------------


def mha(cfg: Fields, num_layers: int, dtype: torch.dtype, window: int | None) -> MHASpec:
    """One KV head count and width for every attention layer (the default builder)."""
    heads = cfg.need("num_attention_heads")
    head_dim = cfg.get("head_dim") or cfg.need("hidden_size") // heads
    return MHASpec(
        num_layers=num_layers,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=head_dim,
        dtype=dtype,
        sliding_window=window,
    )


def mha_mimo_v2_flash(
    cfg: Fields, num_layers: int, dtype: torch.dtype, window: int | None
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


def mha_zamba2(cfg: Fields, num_layers: int, dtype: torch.dtype, window: int | None) -> MHASpec:
    """Zamba2's hybrid layers: the shared attention runs on [stream | embeddings], 2
    hidden wide, so its heads are ``2 hidden / heads`` wide (transformers derives
    ``attention_head_dim`` so; the hub's config.json may omit it)."""
    heads = cfg.need("num_attention_heads")
    return MHASpec(
        num_layers=num_layers,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("attention_head_dim") or 2 * cfg.need("hidden_size") // heads,
        dtype=dtype,
        sliding_window=window,
    )


def _mla(cfg: Fields, num_layers: int, dtype: torch.dtype) -> MLASpec:
    return MLASpec(
        num_layers=num_layers,
        kv_lora_rank=cfg.need("kv_lora_rank"),
        rope_dim=cfg.need("qk_rope_head_dim"),
        dtype=dtype,
    )


def jamba_dims(cfg: Fields) -> StateDims:
    """Jamba's Mamba-1 mixer: conv over x ``(I, d_conv)``, SSM state ``(I, d_state)``,
    ``I = mamba_expand * hidden_size`` (transformers' JambaMambaMixer)."""
    intermediate = cfg.get("mamba_expand", 2) * cfg.need("hidden_size")
    return StateDims(
        intermediate, cfg.get("mamba_d_conv", 4), (intermediate, cfg.get("mamba_d_state", 16))
    )


def _state(dims, num_layers: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> MambaSpec:
    """The MambaSpec of a family's recurrent dims (``StateDims`` or the same names);
    an empty ``state_shape`` gives a conv-only slot (LFM2)."""
    return MambaSpec(
        num_layers=num_layers,
        conv=(StatePart((dims.conv_dim, dims.conv_kernel), conv_dtype),),
        temporal=StatePart(tuple(dims.state_shape), ssm_dtype) if dims.state_shape else None,
    )


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


def _text_config(config: Any) -> Fields:
    cfg = Fields(config)
    text = cfg.get("text_config")
    if text is not None and family.of_model_type(cfg.get("model_type")) is None:
        return Fields(text)  # multimodal wrapper (e.g. gemma3): the decoder is its text config
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
    fam = family.of_model_type(model_type)
    if fam is None:
        raise ValueError(
            f"unknown architecture {model_type!r}; unikv knows {family.model_types()} "
            "(multimodal configs such as gemma3 are read through their text_config)"
        )
    kv_dtype, ssm = parse_dtype(dtype), parse_dtype(ssm_dtype)
    kinds = fam.layer_kinds(cfg)
    attention = family.load(fam.attention_spec or mha)
    subpools = []
    for kind in ("full", "swa", "mla", "mamba"):
        layers = tuple(i for i, k in enumerate(kinds) if kind in k.split("+"))
        if not layers:
            continue
        if kind == "full":
            spec = attention(cfg, len(layers), kv_dtype, None)
        elif kind == "swa":
            spec = attention(cfg, len(layers), kv_dtype, swa_window(cfg))
        elif kind == "mla":
            spec = _mla(cfg, len(layers), kv_dtype)
        else:
            if fam.state_dims is None:
                raise ValueError(f"family {fam.name!r} has recurrent layers but no state_dims")
            conv_dtype = torch.bfloat16 if kv_dtype in FP8_DTYPES else kv_dtype
            spec = _state(family.load(fam.state_dims)(cfg), len(layers), conv_dtype, ssm)
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
