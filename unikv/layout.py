"""Pure view builders over a raw uint8 buffer (docs/design.md sections 2-3).

Every sub-pool indexes the same buffer on its own page grid: page ``p`` starts
at byte ``p * page_bytes``. Inside a page, rows are grouped layer by layer, so a
page is ``B = blocks_per_page`` row-blocks of ``ps`` rows each:

    page p:  [ block 0 | block 1 | ... | block B-1 ]     block b = (layer, part)
              ps rows   ps rows         ps rows

Seen from one (layer, part), the blocks of consecutive pages are ``B * ps`` rows
apart, so each (layer, part) is ONE dense tensor of ``num_pages * B * ps`` rows
starting at its block in page 0. All these views share the kernel-facing id

    kernel_id(t) = (t // ps) * (ps * B) + t % ps        t = physical token id

which is the only place that arithmetic lives (``kernel_ids`` and
``kernel_page_entries`` below). The last block's view runs ``(B - 1) * ps`` rows
past the last page: the buffer must carry ``spec.view_tail_pad_bytes(ps)``.

The strided 4-D view ``(num_pages, ps, H, D)`` describes the same bytes by
(page, slot) and is the independent oracle the tests cross-read against.
"""

from __future__ import annotations

import torch

from unikv.specs import MambaSpec, MHASpec, MLASpec, Spec, storage_dtype


def kernel_page_entries(physical_pages: torch.Tensor, blocks_per_page: int) -> torch.Tensor:
    """Block-table entries for physical pages: ``P * B`` (units of ``ps`` rows)."""
    return physical_pages * blocks_per_page


def kernel_ids(
    physical_token_ids: torch.Tensor, page_size: int, blocks_per_page: int
) -> torch.Tensor:
    """Kernel-facing ids of physical token ids: ``(t // ps) * ps * B + t % ps``."""
    pages = torch.div(physical_token_ids, page_size, rounding_mode="floor")
    slots = physical_token_ids - pages * page_size
    return kernel_page_entries(pages, blocks_per_page) * page_size + slots


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
    _check_buffer(buffer, spec, page_size, num_pages)
    typed = _typed(buffer, spec.storage_dtype)
    offset = spec.part_offset(layer, part, page_size) // spec.itemsize
    rows = num_pages * spec.blocks_per_page * page_size
    return typed.as_strided((rows, *row_shape), (spec.row_elems, *row_strides), offset)


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
    return typed.as_strided(
        (num_pages, page_size, *row_shape), (page_elems, spec.row_elems, *row_strides), offset
    )


def _mha_row(spec: MHASpec, part: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = spec.head_dim if part == "k" else spec.v_head_dim
    return (spec.num_kv_heads, width), (spec.row_head_dim, 1)


def mha_dense_views(
    buffer: torch.Tensor, spec: MHASpec, page_size: int, num_pages: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` dense views indexed by kernel id.

    K: ``(num_pages * 2L * ps, H, D)``, V: ``(num_pages * 2L * ps, H, Dv)``, in the
    spec's storage dtype (uint8 for fp8), strides ``(H * max(D, Dv), max(D, Dv), 1)``.
    """
    return [
        tuple(
            _dense(buffer, spec, page_size, num_pages, layer, part, *_mha_row(spec, part))
            for part in ("k", "v")
        )
        for layer in range(spec.num_layers)
    ]


def mha_paged_views(
    buffer: torch.Tensor, spec: MHASpec, page_size: int, num_pages: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` strided views ``(num_pages, ps, H, D)`` indexed by
    (physical page, slot): the oracle for the dense views."""
    return [
        tuple(
            _strided(buffer, spec, page_size, num_pages, layer, part, *_mha_row(spec, part))
            for part in ("k", "v")
        )
        for layer in range(spec.num_layers)
    ]


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
            spec.part_offset(0, name) // part.itemsize,
        )
    return views
