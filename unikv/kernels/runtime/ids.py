"""The Triton home of the kernel-facing id arithmetic (docs/design.md sections 3, 5).

The twins of ``unikv.layout.IdMap`` (the torch home); every Triton kernel that
maps ids or addresses a row imports them from here:

    virtual_page(tv, PS)      = tv // ps for tv >= 0, else 0   (never v2p[-1])
    page_entry(phys, B)       = phys * B        (0, the sink, for tombstones < 0)
    kernel_row(entry, pos, PS) = entry * ps + pos % ps    (a row of a dense view)
    row_offset(entry, pos, PS, block_stride, row_stride)
                              = entry * block_stride + (pos % ps) * row_stride
    kernel_offset(kid, PS, block_stride, row_stride)
                              = row_offset(kid // ps, kid, ...)
    translate(tv, v2p, mask, PS, MULT)
                              = max(v2p[virtual_page(tv)], 0) * MULT + tv mod ps

``row_offset`` is how every attention and store kernel reaches a row of a
(layer, part) view: for dense views ``block_stride == ps * row_stride`` and it
equals ``kernel_row(...) * row_stride``; for page-strided views (asymmetric K/V,
id multiplier 1) the block stride is the page stride. All results are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def virtual_page(tv, PS: tl.constexpr):
    """Virtual page of virtual token ids; negative (padding) ids read page 0."""
    return tl.where(tv >= 0, tv, 0) // PS  # non-negative: floor == truncation


@triton.jit
def page_entry(phys, B: tl.constexpr):
    """Kernel page entry of physical pages; tombstones (< 0) give 0, the sink."""
    return tl.where(phys >= 0, phys.to(tl.int64) * B, 0)


@triton.jit
def kernel_row(entry, pos, PS: tl.constexpr):
    """Row of a dense view: page entry ``entry``, token position ``pos``. An id, not
    an address: address rows with ``row_offset`` (Triton 3.6 takes ``kernel_row(...) *
    stride`` to be ps-aligned for every row: misaligned vector loads at odd row widths)."""
    return entry.to(tl.int64) * PS + pos % PS


@triton.jit
def row_offset(entry, pos, PS: tl.constexpr, block_stride, row_stride):
    """Element offset of the row at (page entry, position) in a kernel view."""
    return entry.to(tl.int64) * block_stride + (pos % PS).to(tl.int64) * row_stride


@triton.jit
def kernel_offset(kid, PS: tl.constexpr, block_stride, row_stride):
    """Element offset of the row of kernel id ``kid`` in a kernel view."""
    kid = kid.to(tl.int64)
    return row_offset(kid // PS, kid, PS, block_stride, row_stride)


@triton.jit
def translate(tv, v2p, mask, PS: tl.constexpr, MULT: tl.constexpr):
    """Kernel (MULT = ps * B) or physical (MULT = ps) ids of virtual ids ``tv``
    (int64); tombstones and padding land in the sink page."""
    slot = ((tv % PS) + PS) % PS  # floor modulo under C or Python remainder rules
    phys = tl.load(v2p + virtual_page(tv, PS), mask=mask, other=0).to(tl.int64)
    return tl.maximum(phys, 0) * MULT + slot
