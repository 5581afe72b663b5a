"""Helpers for the page I/O tests (no tests here): pools seeded with random
bytes and an independent oracle that reads pages through the layout's
(page, slot) views instead of the byte-row arithmetic of ``unikv.io``."""

from __future__ import annotations

import torch

from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, MHASpec, MLASpec, StatePart

CONFIGS = (
    SubPoolConfig("full", MHASpec(2, 2, 8, dtype=torch.bfloat16), page_size=4),
    SubPoolConfig("swa", MHASpec(1, 2, 4, dtype=torch.float16, sliding_window=8), page_size=2),
    SubPoolConfig("mamba", MambaSpec(2, (StatePart((3, 4)),), StatePart((2, 4)))),
)
MLA_CONFIGS = (SubPoolConfig("mla", MLASpec(3, 8, 4, dtype=torch.float32), page_size=2),)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def make_pool(configs=CONFIGS, pages: int = 12, seed: int = 0) -> UnifiedPool:
    """A CPU pool of about ``pages`` pages per sub-pool, every byte random."""
    configs = list(configs)
    pool = UnifiedPool(configs, pool_bytes_for(configs, {c.name: pages for c in configs}))
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=gen))
    return pool


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a typed view (NaN-safe for torch.equal)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def page_contents(pool: UnifiedPool, name: str, pages: list[int]) -> list[torch.Tensor]:
    """Every element of the given physical pages, read through the layout's
    (page, slot) views (MHA/MLA) or per-slot state views (Mamba)."""
    sub = pool[name]
    index = torch.tensor(pages, dtype=torch.int64)
    if sub.paged_views is None:  # Mamba: {part: (layers, slots, *shape)}
        return [bits(v).index_select(1, index).clone() for v in sub.views.values()]
    out = []
    for layer in sub.paged_views:
        for view in layer if isinstance(layer, tuple) else (layer,):
            out.append(bits(view).index_select(0, index).clone())  # (n, ps, ...)
    return out


def assert_same_contents(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def naive_expected(
    before: torch.Tensor, source: torch.Tensor, page_bytes: int, src: list[int], dst: list[int]
) -> torch.Tensor:
    """``before`` with page dst[i] replaced by page src[i] of ``source``, one
    slice assignment at a time (docs/design.md: page p is bytes [p*pb, (p+1)*pb))."""
    out = before.clone()
    for s, d in zip(src, dst):
        out[d * page_bytes : (d + 1) * page_bytes] = source[s * page_bytes : (s + 1) * page_bytes]
    return out
