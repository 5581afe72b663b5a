"""Page checksums: equal to a numpy evaluation of the documented formula at any
chunking, and sensitive to a flipped byte, a swapped byte pair and a swapped
pair of pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unikv.io.checksum import MOD_A, MOD_B, mismatched_pages, page_checksums


def _numpy_checksums(pages: np.ndarray) -> np.ndarray:
    """The module docstring's formula, in numpy int64 (no chunking)."""
    pos = np.arange(pages.shape[1], dtype=np.int64)
    b = pages.astype(np.int64)
    return np.stack(
        [b.sum(1), (b * (pos % MOD_A + 1)).sum(1), (b * (pos % MOD_B + 1)).sum(1)], axis=1
    )


def _random_pages(n: int, page_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, page_bytes), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize(
    "n, page_bytes, chunk_elems",
    [
        (3, 140_000, 1 << 24),  # positions wrap both moduli; one chunk
        (3, 140_000, 50_000),  # columns chunked, one row at a time
        (5, 33, 7),  # odd page size, columns chunked
        (5, 33, 70),  # two rows per chunk
    ],
)
def test_matches_the_formula_at_any_chunking(n: int, page_bytes: int, chunk_elems: int) -> None:
    pages = _random_pages(n, page_bytes, seed=page_bytes + chunk_elems)
    got = page_checksums(pages, chunk_elems=chunk_elems)
    assert got.dtype == torch.int64
    assert np.array_equal(got.numpy(), _numpy_checksums(pages.numpy()))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 299), st.integers(1, 255))
def test_a_flipped_byte_changes_the_checksum(position: int, xor: int) -> None:
    page = _random_pages(1, 300, seed=3)
    corrupt = page.clone()
    corrupt[0, position] ^= xor
    assert mismatched_pages(page_checksums(page), page_checksums(corrupt)) == [0]


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 299), st.integers(0, 299))
def test_a_swapped_byte_pair_changes_the_checksum(i: int, j: int) -> None:
    page = _random_pages(1, 300, seed=4)
    swapped = page.clone()
    swapped[0, i], swapped[0, j] = page[0, j], page[0, i]
    changed = mismatched_pages(page_checksums(page), page_checksums(swapped)) == [0]
    assert changed == (page[0, i] != page[0, j]).item()


def test_a_swapped_pair_of_pages_is_caught_at_both_indices() -> None:
    pages = _random_pages(6, 64, seed=5)
    expected = page_checksums(pages)
    swapped = pages[[0, 4, 2, 3, 1, 5]]
    assert mismatched_pages(expected, page_checksums(swapped)) == [1, 4]


def test_rejects_a_non_byte_table() -> None:
    with pytest.raises(ValueError, match="uint8"):
        page_checksums(torch.zeros(2, 4, dtype=torch.int32))
