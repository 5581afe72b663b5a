"""Fused writes of the allocator's device tables and fused translation (Triton).

``update_tables`` applies every table write of one allocator verb in ONE launch
(per group of 8 tables). Its input is one packed int32 device array:

    packed = [ header: S rows (table, index_offset, value_offset, count) | data ... ]
    segment s:  tables[table][packed[index_offset + j]] = packed[value_offset + j]
                (or = -1, a tombstone, when value_offset < 0), for j < count

The indices written into one table by one call must be distinct (the writes of
a call are unordered). ``translate_ids`` maps virtual token ids to kernel (or
physical) ids in one launch:

    page = tv // ps if tv >= 0 else 0      (clamped BEFORE the lookup: never v2p[-1])
    out  = max(v2p[page], 0) * mult + tv mod ps      (mult = ps * B, or ps)

which equals ``unikv.allocator.translate`` (floor modulo keeps padding ids in
the sink page). Torch references of the same signatures: ``update_tables_ref``
and ``translate_ids_ref`` (for CPU and for tests).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from unikv.kernels.launch import launcher

MAX_TABLES = 8
BLOCK = 256
HEADER = 4  # ints per segment row


_UPDATE_ARGS = ["packed", "base", "t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7"]


@triton.jit(do_not_specialize=_UPDATE_ARGS, do_not_specialize_on_alignment=_UPDATE_ARGS)
def _update_tables_kernel(
    packed, base, t0, t1, t2, t3, t4, t5, t6, t7, NUM: tl.constexpr, BLOCK: tl.constexpr
):
    row = packed + tl.program_id(0) * 4
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
    packed: (4 * num_segments + data,) int32 on the same device; max_count: a
    host int >= every segment's count (sizes the grid). No host sync."""
    if num_segments == 0 or max_count == 0:
        return
    grid = (num_segments, triton.cdiv(max_count, BLOCK))
    for base in range(0, len(tables), MAX_TABLES):
        group = list(tables[base : base + MAX_TABLES])
        num = len(group)
        group += [None] * (MAX_TABLES - num)  # constexpr None: never touched
        _launch_update(grid, packed, base, *group, NUM=num, BLOCK=BLOCK)


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


_TRANSLATE_ARGS = ["ids", "v2p", "out", "n"]


@triton.jit(do_not_specialize=_TRANSLATE_ARGS, do_not_specialize_on_alignment=_TRANSLATE_ARGS)
def _translate_kernel(ids, v2p, out, n, MULT: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tv = tl.load(ids + i, mask=mask, other=-1).to(tl.int64)
    page = tl.where(tv >= 0, tv, 0) // PS
    slot = ((tv % PS) + PS) % PS  # floor modulo under C or Python remainder rules
    phys = tl.load(v2p + page, mask=mask, other=0).to(tl.int64)
    result = tl.maximum(phys, 0) * MULT + slot
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


def translate_ids_ref(
    ids: torch.Tensor, v2p: torch.Tensor, page_size: int, mult: int, out: torch.Tensor
) -> torch.Tensor:
    """Torch reference of ``translate_ids`` (same signature and result)."""
    n = ids.shape[0]
    if page_size == 1:  # every id is its page; padding reads page 0
        result = v2p.index_select(0, ids.clamp_min(0)).clamp_min_(0).long().mul_(mult)
    else:
        tv = ids.long()
        page = torch.div(tv.clamp_min(0), page_size, rounding_mode="floor")
        phys = v2p.index_select(0, page).clamp_min_(0).long()
        result = phys.mul_(mult).add_(torch.remainder(tv, page_size))
    out[:n].copy_(result)  # result is fresh: out may alias ids
    return out[:n]
