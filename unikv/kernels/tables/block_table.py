"""Triton block-table build (fused with virtual -> physical translation) and the
export of a block table in FlashInfer's paged-KV format.

    entry j of request b = v2p[req_to_token[slot_b, j * ps] // ps] * B   (j < ceil(len/ps))
                         = 0 (the sink) for tombstones, negative ids and padding columns

Negative virtual ids are mapped to page 0 before any division, so ``v2p[-1]`` is
never read at any page size (docs/lessons.md bug 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.checks import check_ids, check_same_device
from unikv.kernels.runtime.ids import page_entry, virtual_page
from unikv.kernels.runtime.launch import launcher

BLOCK_COLS = 128


_BUILD_ARGS = [
    "req_to_token", "req_slots", "seq_lens", "v2p", "out",
    "num_cols", "rt_stride", "out_stride", "window",
]  # fmt: skip


@triton.jit(do_not_specialize=_BUILD_ARGS, do_not_specialize_on_alignment=_BUILD_ARGS)
def _build_block_table_kernel(
    req_to_token,
    req_slots,
    seq_lens,
    v2p,
    out,
    num_cols,
    rt_stride,
    out_stride,
    window,
    PAGE_SIZE: tl.constexpr,
    BLOCKS_PER_PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(req_slots + b).to(tl.int64)
    seq = tl.load(seq_lens + b)
    live = col * PAGE_SIZE < seq
    if HAS_WINDOW:
        live = live & ((col + 1) * PAGE_SIZE > seq - window)
    virt = tl.load(
        req_to_token + slot * rt_stride + col.to(tl.int64) * PAGE_SIZE, mask=live, other=-1
    )
    ok = live & (virt >= 0)
    phys = tl.load(v2p + virtual_page(virt, PAGE_SIZE), mask=ok, other=-1)
    entry = page_entry(phys, BLOCKS_PER_PAGE)
    tl.store(out + b * out_stride + col, entry.to(tl.int32), mask=col < num_cols)


_launch_build = launcher(_build_block_table_kernel)


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
    """Kernel page entries of each request's live prefix, fused with translation.

    req_to_token: (R, max_ctx) int32 virtual token ids; req_slots: (B,) int32 rows
    of it; seq_lens: (B,) int32; v2p: (V,) int32 virtual -> physical page (-1 =
    tombstone); out: (B, max_pages) int32, unit column stride. With ``window`` W > 0
    pages wholly before position ``seq_len - W`` are 0 (for extend pass
    W + max_q_len - 1). Returns out.
    """
    for name, t in (("req_slots", req_slots), ("seq_lens", seq_lens), ("v2p", v2p)):
        check_ids(name, t)
    check_ids("req_to_token", req_to_token, dim=2)
    if out.dtype != torch.int32 or out.dim() != 2 or out.shape[0] != req_slots.shape[0]:
        raise ValueError(
            f"out must be an int32 (B={req_slots.shape[0]}, max_pages) tensor, got {out.dtype} "
            f"{tuple(out.shape)}"
        )
    if out.stride(1) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("out and req_to_token need unit column stride")
    check_same_device(req_to_token, req_slots, seq_lens, v2p, out)
    bsz, num_cols = out.shape
    if bsz == 0 or num_cols == 0:
        return out
    grid = (bsz, triton.cdiv(num_cols, BLOCK_COLS))
    _launch_build(
        grid,
        req_to_token,
        req_slots,
        seq_lens,
        v2p,
        out,
        num_cols,
        req_to_token.stride(0),
        out.stride(0),
        window,
        PAGE_SIZE=page_size,
        BLOCKS_PER_PAGE=blocks_per_page,
        HAS_WINDOW=window > 0,
        BLOCK=BLOCK_COLS,
    )
    return out


@triton.jit
def _export_flashinfer_kernel(
    block_table,
    seq_lens,
    kv_indptr,
    kv_indices,
    last_page_len,
    B,
    num_cols,
    bt_stride,
    PAGE_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(seq_lens + offs_b, mask=offs_b < b, other=0)
    start = tl.sum((lens + PAGE_SIZE - 1) // PAGE_SIZE, axis=0)  # pages of requests < b
    seq = tl.load(seq_lens + b)
    pages = (seq + PAGE_SIZE - 1) // PAGE_SIZE
    if b == 0:
        tl.store(kv_indptr, 0)
    tl.store(kv_indptr + b + 1, start + pages)
    tl.store(last_page_len + b, seq - tl.maximum(pages - 1, 0) * PAGE_SIZE)
    for c0 in range(0, num_cols, BLOCK):
        col = c0 + tl.arange(0, BLOCK)
        mask = col < pages
        entry = tl.load(block_table + b.to(tl.int64) * bt_stride + col, mask=mask)
        tl.store(kv_indices + start + col, entry, mask=mask)


def export_flashinfer(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    kv_indptr: torch.Tensor | None = None,
    kv_indices: torch.Tensor | None = None,
    kv_last_page_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer paged-KV metadata of a block table, one launch, no host sync.

    block_table: (B, max_pages) int32 kernel page entries; seq_lens: (B,) int32.
    Returns kv_indptr (B+1,), kv_indices (B * max_pages,) (first kv_indptr[-1]
    meaningful), kv_last_page_len (B,), all int32. The indices address the NHD
    cache ``layout.as_paged(view, ps)`` (dense views: ``view.view(-1, ps, H, D)``;
    asymmetric K/V: the pool's page-strided 4-D views, whose page stride FlashInfer
    reads from the tensors).
    """
    check_ids("seq_lens", seq_lens)
    check_ids("block_table", block_table, dim=2)
    bsz, num_cols = block_table.shape
    dev = block_table.device
    if kv_indptr is None:
        kv_indptr = torch.empty(bsz + 1, dtype=torch.int32, device=dev)
    if kv_indices is None:
        kv_indices = torch.empty(max(bsz * num_cols, 1), dtype=torch.int32, device=dev)
    if kv_last_page_len is None:
        kv_last_page_len = torch.empty(bsz, dtype=torch.int32, device=dev)
    if bsz == 0:
        kv_indptr.zero_()
        return kv_indptr, kv_indices, kv_last_page_len
    _export_flashinfer_kernel[(bsz,)](
        block_table,
        seq_lens,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        bsz,
        num_cols,
        block_table.stride(0),
        PAGE_SIZE=page_size,
        BLOCK_B=triton.next_power_of_2(bsz),
        BLOCK=256,
    )
    return kv_indptr, kv_indices, kv_last_page_len
