"""Where sub-pools go and how much they need: the build-time description of a
unified pool (docs/design.md section 4), kept apart from the pool itself.

- ``SubPoolConfig``: a spec, its page size, its grow direction, its model layers;
- ``default_grow``: docs/design.md's default placement (section 4);
- ``worst_case_pages``: the pages one request holds at its peak;
- ``pool_bytes_for``: a budget holding given page counts side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from unikv.specs import MambaSpec, MHASpec, MLASpec, Spec


class Grow(str, Enum):
    UP = "up"  # from the sink floor upward
    DOWN = "down"  # from the top of the buffer downward
    FLOAT = "float"  # a band between the other two


@dataclass(frozen=True)
class SubPoolConfig:
    """What to build: a spec, its page size, where it grows, which model layers
    it serves (model layer ``layers[i]`` is the sub-pool's layer ``i``)."""

    name: str
    spec: Spec
    page_size: int = 1
    grow: Grow | None = None  # None: docs/design.md's default placement (section 4)
    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"SubPoolConfig.name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.spec, (MHASpec, MLASpec, MambaSpec)):  # bad input: ValueError
            raise ValueError(  # noqa: TRY004
                f"SubPoolConfig.spec must be an MHASpec, MLASpec or MambaSpec, got {self.spec!r}"
            )
        self.spec.page_bytes(self.page_size)  # validates the page size for the spec
        if self.grow is not None:
            if self.grow not in {g.value for g in Grow}:  # Grow members are str too
                raise ValueError(
                    f"SubPoolConfig.grow must be one of {[g.value for g in Grow]} or None, "
                    f"got {self.grow!r}"
                )
            object.__setattr__(self, "grow", Grow(self.grow))
        layers = tuple(self.layers)
        if layers and len(layers) != self.spec.num_layers:
            raise ValueError(
                f"sub-pool {self.name!r}: layers names {len(layers)} model layers but the spec "
                f"has num_layers={self.spec.num_layers}; give one model layer per spec layer"
            )
        object.__setattr__(self, "layers", layers)


def default_grow(configs: Sequence[SubPoolConfig]) -> list[Grow]:
    """docs/design.md section 4: full attention (and MLA) grows down; SWA or Mamba grows
    up; with three kinds, SWA floats in the middle."""
    kinds = [c.spec.kind for c in configs]
    grows = []
    for config, kind in zip(configs, kinds):
        if config.grow is not None:
            grows.append(config.grow)
        elif kind in ("full", "mla"):
            grows.append(Grow.DOWN)
        elif kind == "swa" and "mamba" in kinds:
            grows.append(Grow.FLOAT)
        else:
            grows.append(Grow.UP)
    return grows


def worst_case_pages(
    spec: Spec, page_size: int, max_tokens: int, chunk_tokens: int = 1, state_slots: int = 1
) -> int:
    """Pages one request of ``max_tokens`` tokens holds at its peak. A sliding
    window keeps only the window plus the chunk being written, plus one page
    for misalignment. A Mamba sub-pool: ``state_slots`` (its live slot, plus k
    per-draft-position slots under speculative decoding)."""
    if isinstance(spec, MambaSpec):
        return state_slots
    full = -(-max_tokens // page_size)
    if spec.sliding_window is None:
        return full
    return min(full, -(-(spec.sliding_window + chunk_tokens) // page_size) + 1)


def pool_bytes_for(configs: Sequence[SubPoolConfig], pages: Mapping[str, int]) -> int:
    """A byte budget that holds ``pages[name]`` pages of each sub-pool side by
    side, plus the sink: handy for tests and presets."""
    page_bytes = {c.name: c.spec.page_bytes(c.page_size) for c in configs}
    sink = max(page_bytes.values())
    return sink + sum(page_bytes[n] * (p + 1) for n, p in pages.items())
