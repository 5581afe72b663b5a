"""Whether unikv's engine runs a model config, and why not when it does not, read
from the family table (``models/family.py``): ``unikv inspect`` says it for every
preset and config.

A config is refused when
- no family of the table names its architecture (nor its ``model_type``): unikv
  knows nothing of it (no pool plan either);
- its family has no model class (Jamba: the table gives its pool specs only);
- its family runs other architectures of the same ``model_type``;
- the family's own reading of the config refuses a feature (``config_extras``, the
  model config, the FP8 format): only where transformers is installed to read the
  config as the engine does; without it the verdict is the table's alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unikv.models import family
from unikv.models.hf import Fields


@dataclass(frozen=True)
class Support:
    """``runs``: whether ``LLM`` runs the config; ``family``: the table's family of it
    (None: none knows it); ``why_not``: the reason when it does not run;
    ``checked``: whether the family's own config checks ran (transformers present)."""

    runs: bool
    family: str | None
    why_not: str | None = None
    checked: bool = False

    def line(self) -> str:
        if not self.runs:
            return f"engine: does not run it: {self.why_not}"
        fam = family.named(self.family)
        note = "" if self.checked else " (the family table's verdict; transformers absent)"
        return f"engine: runs it (family {self.family!r}, {fam.model}){note}"

    def as_dict(self) -> dict:
        return {"runs": self.runs, "family": self.family, "why_not": self.why_not}


def _model_types(cfg: Fields) -> list[str]:
    """The config's model_type and, for a multimodal wrapper, its text decoder's."""
    types = [cfg.get("model_type")]
    text = cfg.get("text_config")
    if text is not None:
        types.append(Fields(text).get("model_type"))
    return [t for t in types if t is not None]


def engine_support(config: Any) -> Support:
    """The verdict for a config (a transformers config object or config.json's dict)."""
    cfg = Fields(config)
    archs = list(cfg.get("architectures") or [])
    arch = archs[0] if archs else None
    fam = family.of_architecture(arch) if arch else None
    if fam is None:
        known = next((f for t in _model_types(cfg) if (f := family.of_model_type(t))), None)
        types = _model_types(cfg) or ["(none)"]
        if arch is None:
            why = "config.json names no architecture (its 'architectures' field is empty)"
        elif known is not None and known.model is None:
            why = (
                f"family {known.name!r} has no unikv model: models/family.py gives its pool "
                f"specs only (architecture {arch!r})"
            )
        elif known is not None:
            why = (
                f"architecture {arch!r} is not one family {known.name!r} runs "
                f"({', '.join(known.architectures)})"
            )
        else:
            why = (
                f"no family in models/family.py knows architecture {arch!r} or model_type "
                f"{' / '.join(map(repr, types))}"
            )
        return Support(False, known.name if known else None, why)
    if fam.model is None:  # a table whose entry names architectures but no model
        return Support(False, fam.name, f"family {fam.name!r} has no unikv model class")
    return _feature_checks(config, fam)


def _feature_checks(config: Any, fam: family.Family) -> Support:
    """The family's own reading of the config, as ``LLM`` reads it (transformers'
    config class, the model config and its extras, the FP8 format)."""
    try:
        import transformers
    except ImportError:
        return Support(True, fam.name)
    from unikv.models.config import model_config_from_hf
    from unikv.models.fp8 import fp8_format

    try:
        if isinstance(config, dict):
            fields = {k: v for k, v in config.items() if not k.startswith("_")}
            config = transformers.AutoConfig.for_model(**fields)
        model_config_from_hf(config)
        fp8_format(config)
    except (ValueError, KeyError, TypeError) as err:
        return Support(False, fam.name, f"family {fam.name!r} refuses this config: {err}")
    return Support(True, fam.name, checked=True)
