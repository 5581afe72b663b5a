"""Pure-torch references of every kernel: the CPU path and the test oracle.

Each function has exactly the signature of its Triton twin (docs/design.md
section 7). They are written for clarity, not speed, but
contain no host synchronisation, so they also run (slowly) on a GPU.

Ids used here (docs/design.md sections 3, 5), read through ``layout.as_paged``:
    kernel id          ``P * ps * B + slot``: row ``[kid // ps, kid % ps]`` of a view
    kernel page entry  block-table entry ``P * B``; token i of a request lives at
                       ``[block_table[b, i // ps], i % ps]``
A view is dense 3-D ``(N, H, D)`` (B row-blocks per page) or page-strided 4-D
``(E, ps, H, D)`` (asymmetric K/V, B = 1); both are read by the same rule.
"""

from __future__ import annotations

import torch

from unikv.kernels.linear.ref import rope_qk
from unikv.kernels.runtime.checks import as_storage
from unikv.layout import IdMap, as_paged


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kernel_ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write K and V rows of T tokens at kernel ids (a bit copy).

    k_cache: (N, H, D) dense per-layer K view, storage dtype (uint8 for fp8), strided
    rows, or (E, ps, H, D) page-strided; v_cache: (N, H, Dv) or (E, ps, H, Dv).
    kernel_ids: (T,) int32/int64 kernel ids (``KernelIds.data``).
    k: (T, H, D), v: (T, H, Dv) in the logical dtype (fp8 tensors are bit-copied).
    """
    ids = kernel_ids.long()
    page_size = k_cache.shape[1] if k_cache.dim() == 4 else 1  # a dense view: one row per id
    entries, slots = torch.div(ids, page_size, rounding_mode="floor"), ids % page_size
    as_paged(k_cache, page_size)[entries, slots] = as_storage("k", k, k_cache)
    as_paged(v_cache, page_size)[entries, slots] = as_storage("v", v, v_cache)


def rope_store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kernel_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope of q and k (``elementwise_ref.rope_qk``), then the rotated K and V rows
    written at kernel ids (``store_kv``). Returns the new rotated (q, k)."""
    q, k = rope_qk(q, k, cos, sin, positions)
    store_kv(k_cache, v_cache, kernel_ids, k, v)
    return q, k


def rope_store_decode_attention(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    **attention: object,
) -> torch.Tensor:
    """``rope_store_kv`` then ``decode_attention`` of the rotated q (keywords:
    ``decode_attention``'s). q and k are left as they are."""
    q, _ = rope_store_kv(k_cache, v_cache, write_ids, q, k, v, cos, sin, positions)
    return decode_attention(q, k_cache, v_cache, block_table, seq_lens, **attention)


def store_decode_attention(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_ids: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    **attention: object,
) -> torch.Tensor:
    """``store_kv`` at ``write_ids`` then ``decode_attention`` (keywords: its)."""
    store_kv(k_cache, v_cache, write_ids, k, v)
    return decode_attention(q, k_cache, v_cache, block_table, seq_lens, **attention)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) float logits -> (B,) int64 first index of each row's maximum."""
    return logits.argmax(dim=-1)


def _gather_rows(
    cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> torch.Tensor:
    """(B, max_pages * ps, H, D) fp32 rows of each request's pages, in position order.
    Rows at positions >= seq_len are zeros: they are never read as data (they may be
    unwritten, e.g. NaN-poisoned, bytes)."""
    paged = as_paged(cache, page_size)  # (entries, ps, H, D)
    entries = block_table.long().clamp(0, paged.shape[0] - 1)
    rows = paged[entries].flatten(1, 2)  # (B, max_pages * ps, H, D)
    live = torch.arange(rows.shape[1], device=rows.device)[None] < seq_lens.long()[:, None]
    return torch.where(live[:, :, None, None], rows.float(), 0.0)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    sm_scale: float,
    sinks: torch.Tensor | None,
    soft_cap: float,
) -> torch.Tensor:
    """q (B, M, Hq, D), k (B, L, H, D), v (B, L, H, Dv), visible (B, M, L) bool
    -> (B, M, Hq, Dv) fp32. A row that sees no key gives zeros."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    logits = torch.einsum("bmhd,blhd->bhml", q.float(), k) * sm_scale  # (B, Hq, M, L)
    if soft_cap > 0:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*logits.shape[:3], 1)
        logits = torch.cat([logits, sink], dim=-1)
    peak = logits.amax(dim=-1, keepdim=True).clamp(min=-1e30)  # all -inf rows stay finite
    weights = torch.exp(logits - peak)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    if sinks is not None:
        weights = weights[..., :-1]
    return torch.einsum("bhml,blhd->bmhd", weights, v)


def _check_group(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if q.shape[-2] % k_cache.shape[-2] != 0:
        raise ValueError(
            f"query heads ({q.shape[-2]}) must be a multiple of KV heads ({k_cache.shape[-2]}) for GQA"
        )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    sm_scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    soft_cap: float = 0.0,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention of one query token per request.

    q: (B, Hq, D); k_cache (N, H, D) / v_cache (N, H, Dv) dense per-layer views
    (a float dtype; view fp8 bytes with their fp8 dtype first).
    block_table: (B, max_pages) int32 kernel page entries; seq_lens: (B,) int32
    tokens in the cache, the query being the last one. window: 0 = full, W > 0 =
    the last W keys. sinks: None or (Hq,) fp32 sink logits. soft_cap: 0 = off.
    ``workspace`` is accepted for signature parity and unused.
    Returns out: (B, Hq, Dv) in q's dtype.
    """
    _check_group(q, k_cache)
    k = _gather_rows(k_cache, block_table, seq_lens, page_size)  # (B, Lmax, H, D)
    v = _gather_rows(v_cache, block_table, seq_lens, page_size)
    pos = torch.arange(k.shape[1], device=q.device)
    last = seq_lens.long()[:, None] - 1
    visible = pos[None] <= last
    if window > 0:
        visible &= pos[None] > last - window
    res = _attend(q[:, None], k, v, visible[:, None], sm_scale, sinks, soft_cap)[:, 0]
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_q_len: int,
    page_size: int,
    sm_scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    soft_cap: float = 0.0,
    out: torch.Tensor | None = None,
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of ragged new tokens over their cached prefix and themselves.

    q: (T, Hq, D) new tokens of B requests, request b owning rows
    ``q_indptr[b]:q_indptr[b+1]``; q_indptr: (B+1,) int32; seq_lens: (B,) int32 total
    tokens incl. the new ones (whose K/V are already stored). New token j of
    request b sits at position ``seq_lens[b] - q_len[b] + j``. block_table,
    window, sinks, soft_cap as in ``decode_attention``. fresh_kv: the Triton op's
    fast path for a step without cached prefixes; ignored here (the cache holds
    the same rows). Returns (T, Hq, Dv).
    """
    _check_group(q, k_cache)
    num_tokens = q.shape[0]
    k = _gather_rows(k_cache, block_table, seq_lens, page_size)  # (B, Lmax, H, D)
    v = _gather_rows(v_cache, block_table, seq_lens, page_size)
    indptr = q_indptr.long()
    token = torch.arange(num_tokens, device=q.device)
    req = torch.searchsorted(indptr[1:], token, right=True)  # request of each new token
    j = token - indptr[req]
    q_lens = indptr[1:] - indptr[:-1]
    q_pos = seq_lens.long()[req] - q_lens[req] + j  # (T,) absolute positions
    padded = q.new_zeros(k.shape[0], max(max_q_len, 1), *q.shape[1:])
    padded[req, j] = q  # (B, max_q_len, Hq, D)
    pos_pad = torch.full(padded.shape[:2], -1, dtype=torch.long, device=q.device)
    pos_pad[req, j] = q_pos
    key = torch.arange(k.shape[1], device=q.device)
    visible = key[None, None] <= pos_pad[:, :, None]  # (B, M, Lmax)
    if window > 0:
        visible &= key[None, None] > pos_pad[:, :, None] - window
    res = _attend(padded, k, v, visible, sm_scale, sinks, soft_cap)[req, j]
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out


def copy_pages(
    buffer: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    page_bytes: int,
    *,
    disjoint: bool = False,
) -> None:
    """Copy page envelopes ``src -> dst`` inside a 1-D uint8 buffer; every source
    is read before any destination is written. src/dst: (n,) int32/int64 physical pages.
    ``disjoint`` (the Triton copy's one-pass promise) changes nothing here."""
    num_pages = buffer.numel() // page_bytes
    rows = buffer[: num_pages * page_bytes].view(num_pages, page_bytes)  # (pages, envelope)
    rows.index_copy_(0, dst_pages.long(), rows.index_select(0, src_pages.long()))


def build_block_table(
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
    """Block table of kernel page entries, fused with translation.

    req_to_token: (R, max_ctx) int32 virtual token ids; req_slots: (B,) int32 rows;
    seq_lens: (B,) int32; v2p: (V,) int32 virtual page -> physical page (-1 = tombstone).
    out: (B, max_pages) int32. Entry j = ``v2p[req_to_token[slot, j*ps] // ps] * B``
    for j < ceil(seq_len / ps); 0 (the sink) for tombstones, negative virtual ids
    and columns past the live prefix. With ``window`` W > 0, pages wholly before
    position ``seq_len - W`` are also 0 (decode reads only the window; for extend
    pass W + max_q_len - 1). Never reads ``v2p[-1]``.
    """
    num_cols = out.shape[1]
    col = torch.arange(num_cols, device=out.device)
    seq = seq_lens.long()[:, None]
    live = col[None] * page_size < seq  # (B, max_pages)
    if window > 0:
        live &= (col[None] + 1) * page_size > seq - window
    tok_col = (col * page_size).clamp(max=req_to_token.shape[1] - 1)
    # gather only the (B, max_pages) entries needed, never whole rows or tables
    virt = req_to_token[req_slots.long()[:, None], tok_col[None, :]].long()  # virtual ids
    vpage = torch.div(virt.clamp(min=0), page_size, rounding_mode="floor")
    phys = v2p[vpage.clamp(max=v2p.shape[0] - 1)].long()
    ok = live & (virt >= 0) & (phys >= 0)
    out.copy_(torch.where(ok, IdMap(page_size, blocks_per_page).page_entries(phys), 0))
    return out


def export_flashinfer(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    kv_indptr: torch.Tensor | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_last_page_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged-KV metadata for a block table, no host sync.

    block_table: (B, max_pages) int32 kernel page entries; seq_lens: (B,) int32.
    Returns kv_indptr (B+1,) int32, kv_indices (B * max_pages,) int32 (the first
    kv_indptr[-1] entries are meaningful) and kv_last_page_len (B,) int32. The
    indices address FlashInfer's NHD cache ``layout.as_paged(view, ps)``:
    kernel page entry ``P * B`` is page ``P * B`` of that view (dense views:
    ``view.view(-1, ps, H, D)``; asymmetric K/V: the pool's page-strided 4-D views
    as they are, read by FlashInfer through their strides).
    """
    bsz, num_cols = block_table.shape
    dev = block_table.device
    pages = torch.div(seq_lens.long() + page_size - 1, page_size, rounding_mode="floor")
    if kv_indptr is None:
        kv_indptr = torch.empty(bsz + 1, dtype=torch.int32, device=dev)
    if kv_indices is None:
        kv_indices = torch.empty(bsz * num_cols, dtype=torch.int32, device=dev)
    if kv_last_page_len is None:
        kv_last_page_len = torch.empty(bsz, dtype=torch.int32, device=dev)
    kv_indptr[:1].zero_()
    kv_indptr[1:] = torch.cumsum(pages, 0)
    col = torch.arange(num_cols, device=dev)
    dest = kv_indptr[:-1, None].long() + col[None]  # (B, max_pages)
    dump = kv_indices.shape[0]  # padding lanes go to a scratch slot past the end
    dest = torch.where(col[None] < pages[:, None], dest, dump)
    scratch = torch.cat([kv_indices, kv_indices.new_zeros(1)])
    scratch.scatter_(0, dest.flatten(), block_table.flatten().to(torch.int32))
    kv_indices.copy_(scratch[:-1])
    kv_last_page_len.copy_(seq_lens.long() - (pages - 1).clamp(min=0) * page_size)
    return kv_indptr, kv_indices, kv_last_page_len
