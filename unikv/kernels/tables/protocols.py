"""The signatures of the allocator's device-table ops and the page copy, stated once
(``KernelBackend``'s fields are typed by these; ``kernels/attention/protocols.py`` says
how a variant may extend one, and ``tests/kernels/test_kernel_protocols.py`` checks it).

Shapes: B requests, R request rows of ``req_to_token``, V virtual pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from unikv.kernels.tables.ref import StepTarget


class CopyPages(Protocol):
    def __call__(
        self,
        buffer: torch.Tensor,
        src_pages: torch.Tensor,
        dst_pages: torch.Tensor,
        page_bytes: int,
        *,
        disjoint: bool = False,
    ) -> None:
        """Whole page envelopes ``src -> dst`` inside the 1-D uint8 ``buffer``; every
        source is read before any destination is written. src/dst (n,) int32/int64
        physical pages. ``disjoint``: no page is both a source and a destination (the
        copy may run in one pass)."""
        ...


class BuildBlockTable(Protocol):
    def __call__(
        self,
        req_to_token: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        v2p: torch.Tensor,
        *,
        page_size: int,
        blocks_per_page: int,
        out: torch.Tensor,
        window: int = 0,
    ) -> torch.Tensor:
        """out (B, max_pages) int32 kernel page entries, fused with translation:
        entry j = ``v2p[req_to_token[slot, j*ps] // ps] * blocks_per_page`` for live
        pages, 0 (the sink) for tombstones, negative ids, padding and pages wholly
        before ``seq_len - window``. req_to_token (R, max_ctx) int32; req_slots,
        seq_lens (B,) int32; v2p (V,) int32. Never reads ``v2p[-1]``."""
        ...


class ExportFlashinfer(Protocol):
    def __call__(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        page_size: int,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
        kv_last_page_len: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer's paged-KV metadata of a block table (B, max_pages), no host
        sync: kv_indptr (B+1,), kv_indices (B * max_pages,), kv_last_page_len (B,),
        all int32."""
        ...


class UpdateTables(Protocol):
    def __call__(
        self,
        tables: Sequence[torch.Tensor],
        packed: torch.Tensor,
        num_segments: int,
        max_count: int,
    ) -> None:
        """Every table write of one allocator verb, from one packed int32 upload in
        ``kernels/tables/ref.py``'s wire format (``HEADER`` ints a segment, then the
        data); the indices one call writes into one table are distinct."""
        ...


class TranslateIds(Protocol):
    def __call__(
        self, ids: torch.Tensor, v2p: torch.Tensor, page_size: int, mult: int, out: torch.Tensor
    ) -> torch.Tensor:
        """``out[:n] = max(v2p[ids // ps], 0) * mult + ids % ps`` for ids (n,) virtual
        token ids (negative: padding, to the sink); v2p (V,) int32; out 1-D (may be
        ``ids``). Returns out[:n]."""
        ...


class PrepareStep(Protocol):
    def __call__(
        self, req_to_token: torch.Tensor, page_size: int, targets: Sequence[StepTarget]
    ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """A decode step's lookups bound once per set of target sub-pools: the
        returned ``run(slots, seq_lens)`` fills every target's block table and
        write ids in one launch (``kernels/tables/step_tables.py``)."""
        ...
