"""Per-page checksums computed on the pool's device with plain torch ops.

For a page of bytes ``b[0..n)`` the checksum is three int64 words

    s0 = sum b[i]
    s1 = sum b[i] * (i % 65521 + 1)
    s2 = sum b[i] * (i % 65519 + 1)

(a Fletcher-style sum with two coprime position moduli). Every term stays
below 2**24 and a page below 2**39 bytes cannot overflow int64, so the words
are exact: identical on CPU and GPU whatever the reduction order. Guarantees:

- any change of one byte changes ``s0``;
- swapping two unequal bytes at positions i != j changes ``s1`` or ``s2``
  unless ``|i - j|`` is a multiple of 65521 * 65519 (about 4.29e9): never
  inside a page under 4 GiB;
- a swapped pair of pages is caught because each page is checked against the
  checksum of the page that belongs at its index.
"""

from __future__ import annotations

import torch

MOD_A = 65521
MOD_B = 65519
CHECKSUM_WORDS = 3
CHUNK_ELEMS = 1 << 24  # bytes widened at once (int32 temporaries of 64 MiB)


def _weights(start: int, stop: int, device: torch.device) -> torch.Tensor:
    """(2, stop - start) int32 position weights of bytes [start, stop)."""
    pos = torch.arange(start, stop, dtype=torch.int64, device=device)
    return torch.stack((pos % MOD_A + 1, pos % MOD_B + 1)).to(torch.int32)


def page_checksums(pages: torch.Tensor, *, chunk_elems: int = CHUNK_ELEMS) -> torch.Tensor:
    """Checksums of page envelopes.

    Args:
        pages: (n, page_bytes) uint8 page envelopes (any device, rows contiguous).
        chunk_elems: how many bytes are widened to int32 at once (memory bound).

    Returns:
        (n, 3) int64 on ``pages.device``: ``s0, s1, s2`` of each page (module doc).
    """
    if pages.dtype != torch.uint8 or pages.dim() != 2:
        raise ValueError(
            f"page_checksums takes (n, page_bytes) uint8 envelopes, got dtype {pages.dtype} "
            f"with shape {tuple(pages.shape)}"
        )
    num, page_bytes = pages.shape
    out = torch.zeros((num, CHECKSUM_WORDS), dtype=torch.int64, device=pages.device)
    if num == 0 or page_bytes == 0:
        return out
    col_step = min(page_bytes, chunk_elems)
    row_step = max(1, chunk_elems // col_step)
    for c0 in range(0, page_bytes, col_step):
        c1 = min(page_bytes, c0 + col_step)
        weights = _weights(c0, c1, pages.device)
        for r0 in range(0, num, row_step):
            r1 = min(num, r0 + row_step)
            block = pages[r0:r1, c0:c1].to(torch.int32)  # (rows, cols), values 0..255
            out[r0:r1, 0] += block.sum(dim=1, dtype=torch.int64)
            out[r0:r1, 1] += (block * weights[0]).sum(dim=1, dtype=torch.int64)
            out[r0:r1, 2] += (block * weights[1]).sum(dim=1, dtype=torch.int64)
    return out


def mismatched_pages(expected: torch.Tensor, actual: torch.Tensor) -> list[int]:
    """Indices of pages whose checksums differ (host list; a host sync).

    Args:
        expected, actual: (n, 3) int64 checksums (same device).
    """
    if expected.shape != actual.shape:
        raise ValueError(
            f"checksum tables differ in shape: expected {tuple(expected.shape)}, "
            f"got {tuple(actual.shape)}"
        )
    bad = (expected != actual).any(dim=1)
    return torch.arange(bad.numel(), device=bad.device)[bad].tolist()
