"""unikv model families and the classes that implement them.

``MODEL_CLASSES`` maps a family (``ModelConfig.family``, from
``config.SUPPORTED_ARCHITECTURES``) to ``"module:ClassName"``, imported lazily so
that a family's module loads only when its checkpoint does. Every class takes
``(config, max_positions, tp)`` and has ``forward(input_ids, positions, attn,
logits_indices=None)``.
"""

from __future__ import annotations

import importlib

MODEL_CLASSES: dict[str, str] = {
    "llama": "unikv.models.llama:CausalLM",
    "gpt_oss": "unikv.models.llama:CausalLM",
    "qwen3_5": "unikv.models.qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_next": "unikv.models.qwen3_next:Qwen3NextForCausalLM",
    "nemotron_h": "unikv.models.nemotron_h:NemotronHForCausalLM",
    "falcon_h1": "unikv.models.falcon_h1:FalconH1ForCausalLM",
    "deepseek": "unikv.models.deepseek:DeepseekForCausalLM",
    "gemma": "unikv.models.gemma:GemmaForCausalLM",
    "mimo_v2": "unikv.models.mimo_v2:MiMoV2FlashForCausalLM",
    "mixtral": "unikv.models.mixtral:MixtralForCausalLM",
    "qwen3_moe": "unikv.models.qwen3_moe:Qwen3MoeForCausalLM",
}


def model_class(family: str) -> type:
    """The model class of ``family``."""
    if family not in MODEL_CLASSES:
        raise ValueError(
            f"no model class is registered for family {family!r}; unikv has "
            f"{sorted(MODEL_CLASSES)} (models/registry.py)"
        )
    module, name = MODEL_CLASSES[family].split(":")
    return getattr(importlib.import_module(module), name)
