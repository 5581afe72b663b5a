"""Translation of virtual token ids to physical token ids and kernel ids.

    virtual id tv  ->  page tv // ps  ->  P = v2p[page]  ->  kernel id
                                          layout.kernel_page_entries(P) * ps + tv % ps
                                          (the block-table rule; equals
                                           layout.kernel_ids of P * ps + tv % ps)

A negative (padding) id reads page 0 and a tombstone (v2p = -1) becomes page 0:
both land in the sink, at every page size. The page index is clamped to 0
BEFORE the lookup, so ``v2p[-1]`` is never read (LESSONS.md bug 1). In debug
mode a live lane (tv >= 0) that reads a tombstone raises instead (a host sync,
debug only). ``out=`` receives the first ``n`` results with ``copy_`` so its
``data_ptr`` is stable for CUDA graphs, and it may alias the input (bug 5).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from unikv import layout


class TombstoneReadError(RuntimeError):
    """Debug mode: a live lane translated through a tombstoned (freed) page."""


def physical_pages(
    virtual_ids: torch.Tensor,
    v2p: torch.Tensor,
    page_size: int,
    *,
    debug: bool = False,
    name: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical page (sink for padding/tombstones) and in-page slot of each id.

    virtual_ids: (n,) int32/int64 virtual token ids; v2p: (V,) int32.
    Returns ``(pages, slots)``: (n,) int64 each (slots None when ps == 1)."""
    ids = virtual_ids.long()
    if page_size == 1:
        vpage, slots = ids, None
    else:
        vpage = torch.div(ids, page_size, rounding_mode="floor")
        slots = ids - vpage * page_size  # in [0, ps) even for negative ids
    raw = v2p.index_select(0, vpage.clamp_min(0))  # never index -1
    if debug:
        bad = (ids >= 0) & (raw < 0)
        if bool(bad.any()):
            lanes = torch.nonzero(bad).flatten()[:8].tolist()
            raise TombstoneReadError(
                f"sub-pool {name!r}: live lanes {lanes} (virtual ids "
                f"{ids[bad][:8].tolist()}) read tombstoned pages; the page was freed "
                "(out of window, released or never bound) while still in use"
            )
    return raw.clamp_min(0).long(), slots


def translate_kernel(
    virtual_ids: torch.Tensor,
    v2p: torch.Tensor,
    page_size: int,
    blocks_per_page: int,
    *,
    out: torch.Tensor | None = None,
    debug: bool = False,
    name: str = "",
) -> torch.Tensor:
    """Kernel ids ``P * ps * B + tv % ps`` of (n,) virtual token ids.

    out: None (returns a new int32 tensor) or an int32/int64 tensor of at least n
    entries; only ``out[:n]`` is written; it may alias ``virtual_ids``."""
    pages, slots = physical_pages(virtual_ids, v2p, page_size, debug=debug, name=name)
    entries = layout.kernel_page_entries(pages, blocks_per_page)  # P * B
    kernel = entries if slots is None else entries * page_size + slots  # block-table rule
    return _into(kernel, out, virtual_ids.shape[0])


def translate_physical(
    virtual_ids: torch.Tensor,
    v2p: torch.Tensor,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
    debug: bool = False,
    name: str = "",
) -> torch.Tensor:
    """Physical token ids ``P * ps + tv % ps`` of (n,) virtual token ids (same rules)."""
    pages, slots = physical_pages(virtual_ids, v2p, page_size, debug=debug, name=name)
    return _into(pages if slots is None else pages * page_size + slots, out, virtual_ids.shape[0])


def _check_out(out: torch.Tensor, n: int) -> None:
    if out.dim() != 1 or out.shape[0] < n or out.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"out must be a 1-D int32/int64 tensor of at least {n} entries, got "
            f"{out.dtype} {tuple(out.shape)}"
        )


def _into(result: torch.Tensor, out: torch.Tensor | None, n: int) -> torch.Tensor:
    if out is None:
        return result.to(torch.int32)
    _check_out(out, n)
    out[:n].copy_(result)  # result is a fresh tensor, so out may alias the input
    return out[:n]


def translate_fused(
    op: Callable[..., torch.Tensor],
    virtual_ids: torch.Tensor,
    v2p: torch.Tensor,
    page_size: int,
    mult: int,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """``translate_kernel`` (mult = ps * B) or ``translate_physical`` (mult = ps)
    without debug checks, through one fused ``op`` (``table_update.translate_ids``
    or its reference). Same ``out`` rules: an ``out`` that is the input itself
    is written in place; any other overlap goes through a fresh tensor."""
    if virtual_ids.dim() != 1:
        raise ValueError(f"virtual ids must be 1-D, got shape {tuple(virtual_ids.shape)}")
    n = virtual_ids.shape[0]
    ids = virtual_ids if virtual_ids.is_contiguous() else virtual_ids.contiguous()
    if out is None:
        return op(ids, v2p, page_size, mult, torch.empty(n, dtype=torch.int32, device=ids.device))
    _check_out(out, n)
    if out.is_contiguous() and _safe_alias(ids, out, n):
        return op(ids, v2p, page_size, mult, out)
    out[:n].copy_(op(ids, v2p, page_size, mult, torch.empty(n, dtype=out.dtype, device=out.device)))
    return out[:n]


def _safe_alias(ids: torch.Tensor, out: torch.Tensor, n: int) -> bool:
    """True when lane i may read ids[i] and write out[i] in place: no overlap, or
    the very same elements (same start, same dtype). Both contiguous."""
    a, b = ids.data_ptr(), out.data_ptr()
    if a == b and ids.dtype == out.dtype:
        return True
    return a + n * ids.element_size() <= b or b + n * out.element_size() <= a


def check_block_table(
    block_table: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    v2p: torch.Tensor,
    page_size: int,
    window: int,
    name: str,
) -> None:
    """Debug mode: raise if a live page of the block table (inside the prefix and
    the window) maps to a tombstone. Host sync; debug only."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    seq = seq_lens.long()[:, None]
    live = cols[None] * page_size < seq
    if window > 0:
        live &= (cols[None] + 1) * page_size > seq - window
    tok = req_to_token[req_slots.long()][:, (cols * page_size).clamp(max=req_to_token.shape[1] - 1)]
    raw = v2p.index_select(
        0, torch.div(tok.long().clamp_min(0), page_size, rounding_mode="floor").flatten()
    )
    bad = live & (tok >= 0) & (raw.view(tok.shape) < 0)
    if bool(bad.any()):
        rows, pages = torch.nonzero(bad)[:8].T.tolist()
        raise TombstoneReadError(
            f"sub-pool {name!r}: block-table rows {rows} pages {pages} are live but tombstoned"
        )
