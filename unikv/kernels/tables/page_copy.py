"""Triton page copy: whole page envelopes ``src -> dst`` inside the pool buffer.

Each program copies one CHUNK of one page with wide vector loads: the buffer is
reinterpreted with the widest word (int64 .. uint8) dividing ``page_bytes`` and
the buffer's base address, so each thread moves 16-byte vectors. Offsets are
int64. Pages and chunks are spread over a 1-D grid, so thousands of CTAs run.

Ordering: the reference reads every source before writing any destination. With
``disjoint=True`` (the caller knows no page is both a source and a destination,
as for compaction into holes or offload staging) one pass copies directly. The
default stages the sources through a scratch buffer first (two passes), which
is exact for any overlap at twice the traffic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.checks import check_ids, check_same_device

CHUNK_BYTES = 32 * 1024  # bytes per program; tuned on the H200
BLOCK_BYTES = 32 * 1024  # bytes per loop step of a program
NUM_WARPS = 4
WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _copy_pages_kernel(
    src_buf,
    dst_buf,
    src_pages,
    dst_pages,
    src_page_words,
    dst_page_words,
    page_words,
    chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid // chunks
    c = pid % chunks
    src = tl.load(src_pages + i).to(tl.int64) * src_page_words
    dst = tl.load(dst_pages + i).to(tl.int64) * dst_page_words
    base = c.to(tl.int64) * CHUNK
    for off in tl.range(0, CHUNK, BLOCK):
        offs = base + off + tl.arange(0, BLOCK)
        mask = offs < page_words
        vals = tl.load(src_buf + src + offs, mask=mask)
        tl.store(dst_buf + dst + offs, vals, mask=mask)


def _word_view(buffer: torch.Tensor, page_bytes: int) -> tuple[torch.Tensor, int]:
    for size, dtype in WORD_DTYPES:
        if page_bytes % size == 0 and buffer.data_ptr() % size == 0:
            usable = buffer.numel() // size * size
            return buffer[:usable].view(dtype), size
    raise AssertionError("uint8 always divides")


def _launch(src_buf, dst_buf, src_pages, dst_pages, src_stride, dst_stride, page_words, size):
    chunk = max(CHUNK_BYTES // size, 1)
    chunk = min(chunk, triton.next_power_of_2(page_words))
    block = min(chunk, max(BLOCK_BYTES // size, 1))
    chunks = triton.cdiv(page_words, chunk)
    grid = (src_pages.shape[0] * chunks,)
    _copy_pages_kernel[grid](
        src_buf,
        dst_buf,
        src_pages,
        dst_pages,
        src_stride,
        dst_stride,
        page_words,
        chunks,
        CHUNK=chunk,
        BLOCK=block,
        num_warps=min(NUM_WARPS, max(1, block * size // 512)),
    )


def copy_pages(
    buffer: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    page_bytes: int,
    *,
    disjoint: bool = False,
) -> None:
    """Copy page envelopes ``src_pages[i] -> dst_pages[i]`` of ``page_bytes`` each.

    buffer: 1-D uint8 pool buffer; src_pages/dst_pages: (n,) int32/int64
    physical pages of one grid (page p starts at byte ``p * page_bytes``).
    Every source is read before any destination is written. ``disjoint=True``
    promises that no page is both a source and a destination and copies in one
    pass (half the traffic); otherwise the sources are staged first.
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"buffer must be 1-D uint8, got {buffer.dtype} {tuple(buffer.shape)}")
    check_ids("src_pages", src_pages)
    check_ids("dst_pages", dst_pages)
    if src_pages.shape != dst_pages.shape:
        raise ValueError(
            f"src_pages and dst_pages must have one length, got {tuple(src_pages.shape)} "
            f"and {tuple(dst_pages.shape)}"
        )
    if not isinstance(page_bytes, int) or page_bytes <= 0:
        raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
    check_same_device(buffer, src_pages, dst_pages)
    num = src_pages.shape[0]
    if num == 0:
        return
    words, size = _word_view(buffer, page_bytes)
    page_words = page_bytes // size
    if disjoint:
        _launch(words, words, src_pages, dst_pages, page_words, page_words, page_words, size)
        return
    staging = torch.empty(num * page_words, dtype=words.dtype, device=buffer.device)
    order = torch.arange(num, dtype=torch.int32, device=buffer.device)
    _launch(words, staging, src_pages, order, page_words, page_words, page_words, size)
    _launch(staging, words, order, dst_pages, page_words, page_words, page_words, size)
