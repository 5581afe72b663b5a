"""Translation of virtual token ids through ``v2p``, with the allocator's ``out=``
rules and the debug-mode tombstone checks.

    virtual id tv -> page tv // ps (0 for tv < 0) -> P = max(v2p[page], 0)
                  -> P * mult + tv mod ps        mult = ps * B: kernel ids
                                                 mult = ps:     physical token ids

The arithmetic is ``unikv.layout.IdMap`` (torch) and ``unikv.kernels.runtime.ids``
(Triton), run by the backend's ``translate_ids`` op (chosen once). A negative
(padding) id and a tombstone (v2p = -1) land in the sink, at every page size;
``v2p[-1]`` is never read (docs/lessons.md bug 1). ``out=`` receives the first ``n``
results so its ``data_ptr`` is stable for CUDA graphs, and it may alias the
input (bug 5). In debug mode a live lane (tv >= 0) that reads a tombstone
raises first (a host sync, debug only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class TombstoneReadError(RuntimeError):
    """Debug mode: a live lane translated through a tombstoned (freed) page."""


def check_tombstones(
    virtual_ids: torch.Tensor, v2p: torch.Tensor, page_size: int, name: str
) -> None:
    """Raise TombstoneReadError if a live lane (tv >= 0) of (n,) virtual ids reads a
    tombstoned page of ``v2p``. Host sync; debug only."""
    ids = virtual_ids.long()
    raw = v2p.index_select(0, torch.div(ids.clamp_min(0), page_size, rounding_mode="floor"))
    bad = (ids >= 0) & (raw < 0)
    if bool(bad.any()):
        lanes = torch.nonzero(bad).flatten()[:8].tolist()
        raise TombstoneReadError(
            f"sub-pool {name!r}: live lanes {lanes} (virtual ids {ids[bad][:8].tolist()}) "
            "read tombstoned pages; the page was freed (out of window, released or never "
            "bound) while still in use"
        )


def translate(
    op: Callable[..., torch.Tensor],
    virtual_ids: torch.Tensor,
    v2p: torch.Tensor,
    page_size: int,
    mult: int,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """``op`` (``KernelBackend.translate_ids``) over (n,) virtual ids with the
    allocator's ``out`` rules: None gives a new int32 tensor; otherwise a 1-D
    int32/int64 tensor of >= n entries receives ``out[:n]``. An ``out`` that is
    the input itself is written in place; any other overlap goes through a fresh
    tensor."""
    if virtual_ids.dim() != 1:
        raise ValueError(f"virtual ids must be 1-D, got shape {tuple(virtual_ids.shape)}")
    n = virtual_ids.shape[0]
    ids = virtual_ids if virtual_ids.is_contiguous() else virtual_ids.contiguous()
    if out is None:
        return op(ids, v2p, page_size, mult, torch.empty(n, dtype=torch.int32, device=ids.device))
    if out.dim() != 1 or out.shape[0] < n or out.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"out must be a 1-D int32/int64 tensor of at least {n} entries, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
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
