"""The model class of a unikv family, imported lazily from ``models/family.FAMILIES``.

Every class takes ``(config, max_positions, tp)`` and has ``forward(input_ids,
positions, attn, logits_indices=None)``; a family's module loads only when its
checkpoint does.
"""

from __future__ import annotations

from unikv.models import family

# family -> "module:ClassName": a view of models/family.FAMILIES taken at import
MODEL_CLASSES: dict[str, str] = {
    f.name: f.model for f in family.FAMILIES if isinstance(f.model, str)
}


def model_class(name: str) -> type:
    """The model class of the family ``name`` (``ModelConfig.family``)."""
    return family.named(name).model_class()
