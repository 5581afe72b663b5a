"""Pure-torch references of the allocator's table kernels: ``update_tables``,
``translate_ids`` and ``step_tables`` / ``prepare`` (same signatures as
``kernels/tables/table_update.py`` and ``kernels/tables/step_tables.py``).

The packed upload of ``update_tables`` (the wire format, defined here once):

    packed = [ header: S rows of HEADER ints (table, index_offset, value_offset, count)
             | data ... ]
    segment s:  tables[table][packed[index_offset + j]] = packed[value_offset + j]
                (or = -1, a tombstone, when value_offset < 0), for j < count

Translation is ``layout.IdMap.kernel_ids_from_virtual``: ``mult`` is
``ps * B`` for kernel ids, or ``ps`` for physical token ids.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from unikv.kernels.attention import ref as reference
from unikv.layout import IdMap

HEADER = 4  # ints per segment row of the packed upload


class StepTarget(NamedTuple):
    """One sub-pool's inputs and outputs: v2p (V,) int32; table (>= B, C) int32
    with unit column stride; loc (>= B,) int32/int64; window 0 or W."""

    v2p: torch.Tensor
    blocks_per_page: int
    window: int
    table: torch.Tensor
    loc: torch.Tensor


def update_tables_ref(
    tables: Sequence[torch.Tensor], packed: torch.Tensor, num_segments: int, max_count: int
) -> None:
    """Torch reference of ``update_tables`` (reads the header on the host: CPU use)."""
    header = packed[: HEADER * num_segments].view(num_segments, HEADER).tolist()
    for table, index_off, value_off, count in header:
        assert count <= max_count, "update_tables: max_count bounds every segment's count"
        index = packed[index_off : index_off + count]  # int32 indices
        if value_off < 0:
            value = _minus_one(tables[table].dtype, packed.device)
        else:
            value = packed[value_off : value_off + count]
        tables[table].index_put_((index,), value)


@functools.cache
def _minus_one(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((), -1, dtype=dtype, device=device)


def translate_ids_ref(
    ids: torch.Tensor, v2p: torch.Tensor, page_size: int, mult: int, out: torch.Tensor
) -> torch.Tensor:
    """Torch reference of ``translate_ids``: ``out[:n] = max(v2p[page(ids)], 0) * mult
    + ids mod page_size``. ids: (n,) int32/int64 virtual token ids (negative =
    padding); v2p: (V,) int32; out: 1-D int32/int64 (may be ``ids``). Returns out[:n]."""
    assert mult % page_size == 0, "translate_ids: mult is page_size * blocks_per_page"
    n = ids.shape[0]
    result = IdMap(page_size, mult // page_size).kernel_ids_from_virtual(ids, v2p)
    out[:n].copy_(result)  # result is fresh: out may alias ids
    return out[:n]


def prepare_ref(
    req_to_token: torch.Tensor, page_size: int, targets: Sequence[StepTarget]
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``step_tables.prepare`` of the torch reference."""
    return lambda req_slots, seq_lens: step_tables_ref(
        req_to_token, req_slots, seq_lens, page_size, targets
    )


def step_tables_ref(
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    targets: Sequence[StepTarget],
) -> None:
    """Torch reference of ``step_tables`` : the
    block-table reference, then the new tokens' virtual ids translated."""
    bsz = req_slots.shape[0]
    if bsz == 0:
        return
    slots = req_slots.long()
    virtual = req_to_token[slots, seq_lens.long() - 1]  # the new tokens' virtual ids
    for t in targets:
        reference.build_block_table(
            req_to_token,
            req_slots,
            seq_lens,
            t.v2p,
            page_size=page_size,
            blocks_per_page=t.blocks_per_page,
            out=t.table[:bsz],
            window=t.window,
        )
        translate_ids_ref(virtual, t.v2p, page_size, page_size * t.blocks_per_page, t.loc)
