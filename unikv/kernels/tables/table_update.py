"""Fused writes of the allocator's device tables and fused translation (Triton).

``update_tables`` applies every table write of one allocator verb in ONE launch
(per group of 8 tables), from one packed int32 device array in the wire format
of ``kernels/tables/ref.py`` (``HEADER`` ints per segment row, then the data).
The indices written into one table by one call must be distinct (the writes of
a call are unordered). ``translate_ids`` maps virtual token ids to kernel (or
physical) ids in one launch with ``_ids.translate``:

    out = max(v2p[tv // ps if tv >= 0 else 0], 0) * mult + tv mod ps    (mult = ps * B, or ps)

The torch references (same signatures) are ``kernels/tables/ref.update_tables_ref`` and
``kernels/tables/ref.translate_ids_ref``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.ids import translate
from unikv.kernels.runtime.launch import launcher
from unikv.kernels.tables.ref import HEADER

MAX_TABLES = 8
BLOCK = 256


_UPDATE_ARGS = ["packed", "base", "t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7"]


@triton.jit(do_not_specialize=_UPDATE_ARGS, do_not_specialize_on_alignment=_UPDATE_ARGS)
def _update_tables_kernel(
    packed,
    base,
    t0, t1, t2, t3, t4, t5, t6, t7,
    NUM: tl.constexpr,
    BLOCK: tl.constexpr,
    HEADER: tl.constexpr,
):  # fmt: skip
    row = packed + tl.program_id(0) * HEADER
    table = tl.load(row) - base
    index_off = tl.load(row + 1)
    value_off = tl.load(row + 2)
    count = tl.load(row + 3)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (j < count) & (table >= 0) & (table < NUM)
    index = tl.load(packed + index_off + j, mask=mask, other=0).to(tl.int64)
    value = tl.load(packed + value_off + j, mask=mask & (value_off >= 0), other=-1)
    tl.store(t0 + index, value, mask=mask & (table == 0))
    if NUM > 1:
        tl.store(t1 + index, value, mask=mask & (table == 1))
    if NUM > 2:
        tl.store(t2 + index, value, mask=mask & (table == 2))
    if NUM > 3:
        tl.store(t3 + index, value, mask=mask & (table == 3))
    if NUM > 4:
        tl.store(t4 + index, value, mask=mask & (table == 4))
    if NUM > 5:
        tl.store(t5 + index, value, mask=mask & (table == 5))
    if NUM > 6:
        tl.store(t6 + index, value, mask=mask & (table == 6))
    if NUM > 7:
        tl.store(t7 + index, value, mask=mask & (table == 7))


_launch_update = launcher(_update_tables_kernel)


def update_tables(
    tables: Sequence[torch.Tensor], packed: torch.Tensor, num_segments: int, max_count: int
) -> None:
    """Apply the ``num_segments`` packed segments (module docstring) to ``tables``.

    tables: 1-D contiguous int32 device tensors (table ids index this list);
    packed: (HEADER * num_segments + data,) int32 on the same device; max_count: a
    host int >= every segment's count (sizes the grid). No host sync."""
    if num_segments == 0 or max_count == 0:
        return
    grid = (num_segments, triton.cdiv(max_count, BLOCK))
    for base in range(0, len(tables), MAX_TABLES):
        group = list(tables[base : base + MAX_TABLES])
        num = len(group)
        group += [None] * (MAX_TABLES - num)  # constexpr None: never touched
        _launch_update(grid, packed, base, *group, NUM=num, BLOCK=BLOCK, HEADER=HEADER)


_TRANSLATE_ARGS = ["ids", "v2p", "out", "n"]


@triton.jit(do_not_specialize=_TRANSLATE_ARGS, do_not_specialize_on_alignment=_TRANSLATE_ARGS)
def _translate_kernel(ids, v2p, out, n, MULT: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tv = tl.load(ids + i, mask=mask, other=-1).to(tl.int64)
    result = translate(tv, v2p, mask, PS, MULT)
    tl.store(out + i, result.to(out.dtype.element_ty), mask=mask)


_launch_translate = launcher(_translate_kernel)


def translate_ids(
    ids: torch.Tensor, v2p: torch.Tensor, page_size: int, mult: int, out: torch.Tensor
) -> torch.Tensor:
    """``out[:n] = max(v2p[page(ids)], 0) * mult + ids mod page_size`` in one launch.

    ids: (n,) int32/int64 virtual token ids (negative = padding); v2p: (V,) int32;
    out: 1-D contiguous int32/int64 with >= n entries; it may be ``ids`` itself
    (each lane reads its id before writing it), not a shifted overlap. Returns out[:n]."""
    n = ids.shape[0]
    if n:
        grid = (triton.cdiv(n, BLOCK),)
        _launch_translate(grid, ids, v2p, out, n, MULT=mult, PS=page_size, BLOCK=BLOCK)
    return out[:n]
