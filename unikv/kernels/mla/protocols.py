"""The signatures of the MLA ops, stated once (``KernelBackend``'s fields are typed by
these; ``kernels/attention/protocols.py`` says how a variant may extend one, and
``tests/kernels/test_kernel_protocols.py`` checks it).

An MLA layer caches one latent row a token, ``[c (rank) | k_rope (rope)]`` (N rows of a
dense per-layer view); every query head reads it in the absorbed form.
"""

from __future__ import annotations

from typing import Protocol

import torch


class StoreMLA(Protocol):
    def __call__(
        self,
        latent_cache: torch.Tensor,
        kernel_ids: torch.Tensor,
        latent: torch.Tensor,
        rope: torch.Tensor,
    ) -> None:
        """Latent rows of T tokens bit-copied at kernel ids. latent_cache
        (N, rank + rope) storage dtype; kernel_ids (T,) int32/int64; latent (T, rank);
        rope (T, rope)."""
        ...


class MLAAttention(Protocol):
    def __call__(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        latent_cache: torch.Tensor,
        block_table: torch.Tensor,
        q_indptr: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        max_q_len: int,
        page_size: int,
        sm_scale: float,
        out: torch.Tensor | None = None,
        workspace: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal absorbed attention of ragged new tokens over their cached latent rows.
        q_latent (T, H, rank), q_rope (T, H, rope), request b owning rows
        ``q_indptr[b]:q_indptr[b+1]``; block_table (B, max_pages) int32; seq_lens (B,)
        int32 rows cached incl. the new ones. Returns (T, H, rank) in q_latent's dtype."""
        ...


class StoreMLAAttention(Protocol):
    def __call__(
        self,
        latent_cache: torch.Tensor,
        write_ids: torch.Tensor,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        rope: torch.Tensor,
        block_table: torch.Tensor,
        q_indptr: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        max_q_len: int,
        page_size: int,
        sm_scale: float,
        out: torch.Tensor | None = None,
        workspace: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``StoreMLA`` of latent (T, rank) and rope (T, rope) at ``write_ids`` (T,), then
        ``MLAAttention`` over the rows (seq_lens count them). A decode step (max_q_len 1)
        may do both in one launch: the same bytes. Returns (T, H, rank)."""
        ...
