"""Pure view builders over a raw uint8 buffer, and the one torch home of the id
arithmetic (docs/design.md sections 2, 3 and 5).

Every sub-pool indexes the same buffer on its own page grid: page ``p`` starts
at byte ``p * page_bytes``. Inside a page, rows are grouped layer by layer, so a
page is one row-block of ``ps`` rows per (layer, part):

    page p:  [ block 0 | block 1 | ... | block 2L-1 ]     block b = (layer, part)
              ps rows   ps rows         ps rows

Every kernel reads a row of a (layer, part) view from a kernel page entry ``e``
and an in-page slot ``s``: ``e * block_stride + s * row_stride`` (``IdMap``):

- uniform rows (D == Dv, and MLA): the blocks of consecutive pages are
  ``B * ps`` rows apart, so each (layer, part) is ONE dense 3-D view of
  ``num_pages * B * ps`` rows starting at its block in page 0, and
  ``block_stride == ps * row_stride``. Kernel id ``(t // ps) * ps * B + t % ps``
  is a row of it; the last block's view runs ``(B - 1) * ps`` rows past the
  last page, so the buffer carries ``spec.view_tail_pad_bytes(ps)``.
- asymmetric K/V (D != Dv): K and V blocks differ in size, so the multiplier B
  is 1 (kernel id = physical token id) and each (layer, part) is a 4-D view
  ``(num_pages, ps, H, D)`` whose first stride is the page stride.

The strided 4-D view ``(num_pages, ps, H, D)`` by (page, slot) (``*_paged_views``)
describes the same bytes and is the oracle the tests cross-read against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from unikv.specs import MambaSpec, MHASpec, MLASpec, Spec, storage_dtype

INT32_LIMIT = 2**31  # kernel ids and block-table entries are int32
Ids = TypeVar("Ids", torch.Tensor, np.ndarray)  # device tensors or host arrays, one arithmetic


@dataclass(frozen=True)
class IdMap:
    """The kernel-facing id arithmetic of one sub-pool (docs/design.md sections 3, 5).

    page_size ps and blocks_per_page B (the spec's id multiplier; ``IdMap(ps, 1)``
    maps to physical token ids). The Triton twins are ``unikv/kernels/runtime/ids.py``.

        page entry  e = P * B                       (block tables)
        kernel id   k = e * ps + t % ps = (t // ps) * ps * B + t % ps
    """

    page_size: int
    blocks_per_page: int

    @classmethod
    def of(cls, spec: Spec, page_size: int) -> IdMap:
        """The map of a sub-pool (Mamba: page size 1, one id per slot)."""
        return cls(page_size, spec.blocks_per_page or 1)

    @property
    def multiplier(self) -> int:
        """Kernel ids per physical page: ``ps * B``."""
        return self.page_size * self.blocks_per_page

    def page_entries(self, physical_pages: Ids) -> Ids:
        """Block-table entries of physical pages: ``P * B``."""
        return physical_pages * self.blocks_per_page

    def kernel_ids(self, physical_token_ids: torch.Tensor) -> torch.Tensor:
        """Kernel ids of physical token ids ``t``: ``(t // ps) * ps * B + t % ps``."""
        pages = torch.div(physical_token_ids, self.page_size, rounding_mode="floor")
        slots = physical_token_ids - pages * self.page_size
        return entry_kernel_ids(self.page_entries(pages), slots, self.page_size)

    def kernel_ids_from_virtual(self, virtual_ids: Ids, v2p: Ids) -> Ids:
        """Translate virtual token ids through ``v2p`` (V,) int32 to int64 kernel ids:
        ``max(v2p[page], 0) * ps * B + tv mod ps`` with page ``tv // ps`` for tv >= 0
        and 0 otherwise (never ``v2p[-1]``); tombstones (-1) land in the sink page.
        Torch tensors, or host numpy arrays (a verify step's rows: the host mirror of
        ``v2p``, no torch op per call); only the gather differs."""
        ps = self.page_size
        if isinstance(virtual_ids, np.ndarray):
            tv = virtual_ids.astype(np.int64, copy=False)
            phys = np.maximum(v2p[np.maximum(tv, 0) // ps], 0).astype(np.int64)
        else:
            tv = virtual_ids.long()
            page = torch.div(tv.clamp_min(0), ps, rounding_mode="floor")
            phys = v2p.index_select(0, page).clamp_min(0).long()
        return entry_kernel_ids(self.page_entries(phys), tv % ps, ps)  # (floor mod: both)

    def limit(self, num_pages: int) -> int:
        """One past the largest kernel id of ``num_pages`` pages: ``num_pages * ps * B``."""
        return num_pages * self.multiplier


def entry_kernel_ids(entries: Ids, slots: Ids, page_size: int) -> Ids:
    """Kernel ids of (block-table entry, slot in page) pairs, broadcast: ``e * ps + slot``."""
    return entries * page_size + slots


def kernel_page_entries(physical_pages: torch.Tensor, blocks_per_page: int) -> torch.Tensor:
    """Block-table entries for physical pages: ``P * B`` (``IdMap.page_entries``)."""
    return IdMap(1, blocks_per_page).page_entries(physical_pages)


def kernel_ids(
    physical_token_ids: torch.Tensor, page_size: int, blocks_per_page: int
) -> torch.Tensor:
    """Kernel-facing ids of physical token ids (``IdMap.kernel_ids``)."""
    return IdMap(page_size, blocks_per_page).kernel_ids(physical_token_ids)


def as_paged(view: torch.Tensor, page_size: int) -> torch.Tensor:
    """A kernel view as 4-D ``(entries, ps, *row)``: page entry ``e`` and slot ``s``
    reach row ``[e, s]``, so kernel id ``k`` is ``[k // ps, k % ps]``, the torch
    twin of ``kernels/runtime/ids.row_offset``. A dense 3-D view ``(N, *row)`` is split
    into blocks of ``ps`` rows (block stride ``ps * row stride``; N a multiple of
    ps); a 4-D view must have ``ps`` slots and is returned as it is."""
    if view.dim() == 4:
        if view.shape[1] != page_size:
            raise ValueError(
                f"a 4-D kernel view has page_size slots in dim 1: got {tuple(view.shape)} "
                f"for page_size {page_size}"
            )
        return view
    rows, *row = view.shape
    stride, *inner = view.stride()
    return view.as_strided(
        (rows // page_size, page_size, *row),
        (page_size * stride, stride, *inner),
        view.storage_offset(),
    )


def num_pages_in(num_bytes: int, spec: Spec, page_size: int) -> int:
    """How many whole pages of this sub-pool's grid lie in ``num_bytes``."""
    return num_bytes // spec.page_bytes(page_size)


def _check_buffer(buffer: torch.Tensor, spec: Spec, page_size: int, num_pages: int) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(
            f"views need a 1-D uint8 buffer, got dtype {buffer.dtype} with shape {tuple(buffer.shape)}"
        )
    need = num_pages * spec.page_bytes(page_size) + spec.view_tail_pad_bytes(page_size)
    if buffer.numel() < need:
        raise ValueError(
            f"buffer of {buffer.numel()} bytes is too small for {num_pages} pages of "
            f"{spec.page_bytes(page_size)} bytes plus the view tail pad of "
            f"{spec.view_tail_pad_bytes(page_size)} bytes ({need} bytes); allocate the "
            "buffer with the pad derived from the spec (spec.view_tail_pad_bytes)"
        )


def _typed(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    usable = buffer.numel() // itemsize * itemsize
    return buffer[:usable].view(dtype)


def _dense(
    buffer: torch.Tensor,
    spec: MHASpec | MLASpec,
    page_size: int,
    num_pages: int,
    layer: int,
    part: str,
    row_shape: tuple[int, ...],
    row_strides: tuple[int, ...],
) -> torch.Tensor:
    """The kernel view of (layer, part): 3-D dense rows (uniform rows) or the 4-D
    page-strided view (asymmetric rows; its entries are the kernel page entries)."""
    if not spec.uniform_rows:
        return _strided(buffer, spec, page_size, num_pages, layer, part, row_shape, row_strides)
    _check_buffer(buffer, spec, page_size, num_pages)
    typed = _typed(buffer, spec.storage_dtype)
    offset = spec.part_offset(layer, part, page_size) // spec.itemsize
    rows = IdMap.of(spec, page_size).limit(num_pages)
    base = typed.storage_offset()  # a buffer inside a larger range (a SliceBacking)
    return typed.as_strided((rows, *row_shape), (spec.row_elems, *row_strides), base + offset)


def _strided(
    buffer: torch.Tensor,
    spec: MHASpec | MLASpec,
    page_size: int,
    num_pages: int,
    layer: int,
    part: str,
    row_shape: tuple[int, ...],
    row_strides: tuple[int, ...],
) -> torch.Tensor:
    _check_buffer(buffer, spec, page_size, num_pages)
    typed = _typed(buffer, spec.storage_dtype)
    offset = spec.part_offset(layer, part, page_size) // spec.itemsize
    page_elems = spec.page_bytes(page_size) // spec.itemsize
    row_elems = spec.part_row_elems(part)
    return typed.as_strided(
        (num_pages, page_size, *row_shape),
        (page_elems, row_elems, *row_strides),
        typed.storage_offset() + offset,
    )


def _mha_row(spec: MHASpec, part: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = spec.head_dim if part == "k" or spec.v_head_dim is None else spec.v_head_dim
    return (spec.num_kv_heads, width), (width, 1)


def _kv_pairs(
    num_layers: int, view: Callable[[int, str], torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(view(layer, "k"), view(layer, "v")) for each layer]``."""
    return [(view(layer, "k"), view(layer, "v")) for layer in range(num_layers)]


def mha_dense_views(
    buffer: torch.Tensor, spec: MHASpec, page_size: int, num_pages: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` kernel views, in the spec's storage dtype (uint8 for fp8).

    D == Dv: dense rows indexed by kernel id, K ``(num_pages * 2L * ps, H, D)``
    with strides ``(H * D, D, 1)``. D != Dv: K ``(num_pages, ps, H, D)``, V
    ``(num_pages, ps, H, Dv)``, indexed by (kernel page entry, slot), strides
    ``(page_elems, H * D, D, 1)`` (docs/design.md section 3)."""
    return _kv_pairs(
        spec.num_layers,
        lambda layer, part: _dense(
            buffer, spec, page_size, num_pages, layer, part, *_mha_row(spec, part)
        ),
    )


def mha_paged_views(
    buffer: torch.Tensor, spec: MHASpec, page_size: int, num_pages: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` strided views ``(num_pages, ps, H, D)`` indexed by
    (physical page, slot): the oracle for the kernel views."""
    return _kv_pairs(
        spec.num_layers,
        lambda layer, part: _strided(
            buffer, spec, page_size, num_pages, layer, part, *_mha_row(spec, part)
        ),
    )


def mla_dense_views(
    buffer: torch.Tensor, spec: MLASpec, page_size: int, num_pages: int
) -> list[torch.Tensor]:
    """Per-layer latent views ``(num_pages * L * ps, rank + rope)`` indexed by kernel id."""
    return [
        _dense(buffer, spec, page_size, num_pages, layer, "latent", (spec.row_elems,), (1,))
        for layer in range(spec.num_layers)
    ]


def mla_paged_views(
    buffer: torch.Tensor, spec: MLASpec, page_size: int, num_pages: int
) -> list[torch.Tensor]:
    """Per-layer latent views ``(num_pages, ps, rank + rope)`` by (page, slot)."""
    return [
        _strided(buffer, spec, page_size, num_pages, layer, "latent", (spec.row_elems,), (1,))
        for layer in range(spec.num_layers)
    ]


def mamba_state_views(
    buffer: torch.Tensor, spec: MambaSpec, num_slots: int
) -> dict[str, torch.Tensor]:
    """Per-part state views ``(num_layers, num_slots, *shape)`` keyed by part name
    (``conv0``, ``conv1``, ..., ``temporal``), indexed by physical slot."""
    _check_buffer(buffer, spec, 1, num_slots)
    views = {}
    for name, part in zip(spec.parts, spec.state_parts):
        typed = _typed(buffer, storage_dtype(part.dtype))
        inner = [1]
        for size in reversed(part.shape[1:]):
            inner.insert(0, inner[0] * size)
        layer_elems = part.layer_bytes // part.itemsize
        views[name] = typed.as_strided(
            (spec.num_layers, num_slots, *part.shape),
            (layer_elems, spec.entry_bytes // part.itemsize, *inner),
            typed.storage_offset() + spec.part_offset(0, name) // part.itemsize,
        )
    return views
