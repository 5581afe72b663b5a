"""The one table of model families: ``FAMILIES``, one entry per family.

An entry names everything unikv needs to know about a family, under its one key
(``Family.name``, which is ``ModelConfig.family``):

- ``architectures``: the HF architectures unikv runs with this family's model
  (none: a family known to the pool specs only, e.g. Jamba);
- ``model_types``: HF ``model_type`` -> the function giving its layer kinds
  (``models/hf.py``), which the pool specs and the model's windows both use;
- ``state_dims``: the ONE function deriving its recurrent state's dims from the HF
  fields (Mamba-2, Gated DeltaNet); the pool spec and the model's mixer both use it;
- ``attention_spec``: an ``MHASpec`` builder where its K/V heads are not uniform;
- ``extras``: the reader of the family's own fields into ``ModelConfig.extra``;
- ``model``: its model class;
- ``text_decoders``: multimodal wrappers whose text decoder it runs: architecture ->
  (the decoder's checkpoint prefix, unikv's prefix, checkpoint prefixes not loaded).

Functions that live in model modules are named ``"module:attr"`` and imported on
first use, so importing this table imports no model code. Adding a family is its
module plus one entry here; nothing else names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

from unikv.models import hf

Ref = str | Callable  # "module:attr" (imported lazily) or the object itself


@dataclass(frozen=True, eq=False)
class Family:
    name: str
    model_types: Mapping[str, hf.KindsFn]
    architectures: tuple[str, ...] = ()
    model: Ref | None = None
    extras: Ref | None = None
    state_dims: Ref | None = None
    attention_spec: Ref | None = None
    text_decoders: Mapping[str, tuple[str, str, tuple[str, ...]]] = field(default_factory=dict)

    def layer_kinds(self, cfg: hf.Fields) -> list[str]:
        """Every layer's kind, by the rule of the config's ``model_type`` (the family's
        first rule when the config names none of its model types)."""
        rule = self.model_types.get(cfg.get("model_type"))
        return (rule or next(iter(self.model_types.values())))(cfg)

    def model_class(self) -> type:
        if self.model is None:
            raise ValueError(
                f"family {self.name!r} has no unikv model (its configs give pool specs only); "
                f"unikv runs {sorted(f.name for f in FAMILIES if f.model is not None)}"
            )
        return load(self.model)

    def config_extras(self, hf_config: Any) -> dict:
        return load(self.extras)(hf_config) if self.extras is not None else {}


def load(ref: Ref) -> Any:
    """The object a ``Ref`` names."""
    if not isinstance(ref, str):
        return ref
    module, name = ref.split(":")
    return getattr(import_module(module), name)


_QWEN3_5_VL = ("model.language_model.", "model.", ("model.visual.",))
# released Gemma-3 (4B and up): the decoder under language_model.model., a tied or
# untied language_model.lm_head, a SigLIP tower and its projector beside them
_GEMMA3_VL = ("language_model.", "", ("vision_tower.", "multi_modal_projector."))

FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        {
            "llama": hf.kinds_uniform,
            "mistral": hf.kinds_uniform,
            "qwen2": hf.kinds_qwen,
            "qwen3": hf.kinds_qwen,
        },
        ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"),
        model="unikv.models.llama:CausalLM",
    ),
    Family(
        "gpt_oss",
        {"gpt_oss": hf.kinds_every(2)},
        ("GptOssForCausalLM",),
        model="unikv.models.llama:CausalLM",
        extras="unikv.models.gpt_oss:config_extras",
    ),
    Family(
        "qwen3_5",
        {"qwen3_5_text": hf.kinds_linear},
        ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
        model="unikv.models.qwen3_5:Qwen3_5ForCausalLM",
        extras="unikv.models.qwen3_5:config_extras",
        state_dims="unikv.models.qwen3_5:gdn_dims",
        text_decoders={"Qwen3_5ForConditionalGeneration": _QWEN3_5_VL},
    ),
    Family(
        "qwen3_5_moe",
        {"qwen3_5_moe_text": hf.kinds_linear},
        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        model="unikv.models.qwen3_5_moe:Qwen3_5MoeForCausalLM",
        extras="unikv.models.qwen3_5_moe:config_extras",
        state_dims="unikv.models.qwen3_5:gdn_dims",
        text_decoders={"Qwen3_5MoeForConditionalGeneration": _QWEN3_5_VL},
    ),
    Family(
        "qwen3_next",
        {"qwen3_next": hf.kinds_linear},
        ("Qwen3NextForCausalLM",),
        model="unikv.models.qwen3_next:Qwen3NextForCausalLM",
        extras="unikv.models.qwen3_next:config_extras",
        state_dims="unikv.models.qwen3_5:gdn_dims",
    ),
    Family(
        "nemotron_h",
        {"nemotron_h": hf.kinds_nemotron_h},
        ("NemotronHForCausalLM",),
        model="unikv.models.nemotron_h:NemotronHForCausalLM",
        extras="unikv.models.nemotron_h:config_extras",
        state_dims="unikv.models.nemotron_h:mamba_dims",
    ),
    Family(
        "falcon_h1",
        {"falcon_h1": hf.kinds_falcon_h1},
        ("FalconH1ForCausalLM",),
        model="unikv.models.falcon_h1:FalconH1ForCausalLM",
        extras="unikv.models.falcon_h1:config_extras",
        state_dims="unikv.models.falcon_h1:mamba_dims",
    ),
    Family(
        "deepseek",
        {"deepseek_v2": hf.kinds_mla, "deepseek_v3": hf.kinds_mla},
        ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
        model="unikv.models.deepseek:DeepseekForCausalLM",
        extras="unikv.models.deepseek:config_extras",
    ),
    Family(
        "kimi_linear",
        {"kimi_linear": hf.kinds_kimi_linear},
        ("KimiLinearForCausalLM",),
        model="unikv.models.kimi_linear:KimiLinearForCausalLM",
        extras="unikv.models.kimi_linear:config_extras",
        state_dims="unikv.models.kimi_linear:kda_dims",
    ),
    Family(
        "gemma",
        {"gemma2": hf.kinds_every(2), "gemma3_text": hf.kinds_every(6)},
        ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        model="unikv.models.gemma:GemmaForCausalLM",
        extras="unikv.models.gemma:config_extras",
        text_decoders={"Gemma3ForConditionalGeneration": _GEMMA3_VL},
    ),
    Family(
        "mimo_v2",
        {"mimo_v2_flash": hf.kinds_mimo_v2_flash},
        ("MiMoV2FlashForCausalLM",),
        model="unikv.models.mimo_v2:MiMoV2FlashForCausalLM",
        extras="unikv.models.mimo_v2:config_extras",
        attention_spec="unikv.hf_config:mha_mimo_v2_flash",
    ),
    Family(
        "mixtral",
        {"mixtral": hf.kinds_uniform},
        ("MixtralForCausalLM",),
        model="unikv.models.mixtral:MixtralForCausalLM",
        extras="unikv.models.mixtral:config_extras",
    ),
    Family(
        "qwen3_moe",
        {"qwen3_moe": hf.kinds_qwen, "qwen2_moe": hf.kinds_qwen},
        ("Qwen3MoeForCausalLM",),
        model="unikv.models.qwen3_moe:Qwen3MoeForCausalLM",
        extras="unikv.models.qwen3_moe:config_extras",
    ),
    Family(
        "lfm2",
        {"lfm2": hf.kinds_lfm2},
        ("Lfm2ForCausalLM",),
        model="unikv.models.lfm2:Lfm2ForCausalLM",
        extras="unikv.models.lfm2:config_extras",
        state_dims="unikv.models.lfm2:conv_dims",
    ),
    Family(
        "bamba",
        {"bamba": hf.kinds_bamba},
        ("BambaForCausalLM",),
        model="unikv.models.bamba:BambaForCausalLM",
        extras="unikv.models.bamba:config_extras",
        state_dims="unikv.models.bamba:mamba_dims",
    ),
    Family(
        "granitemoehybrid",
        {"granitemoehybrid": hf.kinds_granite_h},
        ("GraniteMoeHybridForCausalLM",),
        model="unikv.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
        extras="unikv.models.granitemoehybrid:config_extras",
        state_dims="unikv.models.bamba:mamba_dims",
    ),
    Family(
        "zamba2",
        {"zamba2": hf.kinds_zamba2},
        ("Zamba2ForCausalLM",),
        model="unikv.models.zamba2:Zamba2ForCausalLM",
        extras="unikv.models.zamba2:config_extras",
        state_dims="unikv.models.zamba2:mamba_dims",
        attention_spec="unikv.hf_config:mha_zamba2",
    ),
    # pool specs only: unikv has no model for this yet
    Family("jamba", {"jamba": hf.kinds_jamba}, state_dims="unikv.hf_config:jamba_dims"),
)


# -- look-ups (read FAMILIES on every call) --------------------------------------------


def named(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(
        f"no model family {name!r} is registered; unikv has "
        f"{sorted(f.name for f in FAMILIES)} (models/family.py)"
    )


def of_architecture(architecture: str) -> Family | None:
    return next((f for f in FAMILIES if architecture in f.architectures), None)


def of_model_type(model_type: str | None) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def architectures() -> list[str]:
    """Every HF architecture unikv runs, sorted."""
    return sorted(a for f in FAMILIES for a in f.architectures)


def model_types() -> list[str]:
    """Every HF model_type whose pool specs unikv reads, sorted."""
    return sorted(t for f in FAMILIES for t in f.model_types)
