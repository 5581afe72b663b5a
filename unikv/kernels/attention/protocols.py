"""The signatures of the K/V store and attention ops, stated once (``KernelBackend``'s
fields are typed by these; the Triton kernels and their torch references satisfy them).

A variant may add keyword-only parameters with defaults after these (a plan's launch
arguments: ``num_splits``, ``config``, ...); it never drops or reorders one.
``tests/kernels/test_kernel_protocols.py`` checks every variant against them.

Shapes: T new tokens, B requests, Hq query heads, H K/V heads, D / Dv the K / V head
widths, N rows of a dense per-layer view (or (E, ps, ...) page-strided).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from unikv.kernels.backend import DecodePlan, ExtendPlan


class StoreKV(Protocol):
    def __call__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kernel_ids: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """K and V rows of T tokens bit-copied at kernel ids. k_cache (N, H, D) /
        v_cache (N, H, Dv) storage-dtype views (or page-strided (E, ps, H, *));
        kernel_ids (T,) int32/int64; k (T, H, D), v (T, H, Dv)."""
        ...


class RopeStoreKV(Protocol):
    def __call__(
        self,
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
        """Rope of q (T, Hq, D) and k (T, H, D) by ``positions`` (T,) from the fp32
        cos / sin tables (max_pos, R / 2), then ``StoreKV`` of the rotated k and v.
        Returns the rotated (q, k)."""
        ...


class DecodeAttention(Protocol):
    def __call__(
        self,
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
        """One query token per request over its paged keys. q (B, Hq, D); k_cache
        (N, H, D), v_cache (N, H, Dv); block_table (B, max_pages) int32 kernel page
        entries; seq_lens (B,) int32 keys incl. the query's own. window 0 = all keys,
        W > 0 the last W; sinks None or (Hq,) fp32; soft_cap 0 = off; workspace: the
        plan's split-KV scratch. Returns out (B, Hq, Dv) in q's dtype."""
        ...


class RopeStoreDecodeAttention(Protocol):
    def __call__(
        self,
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
        """``RopeStoreKV`` at ``write_ids`` (B,), then ``DecodeAttention`` of the rotated
        q (``attention``: its keywords). q and k are left as they are. Returns
        (B, Hq, Dv)."""
        ...


class StoreDecodeAttention(Protocol):
    def __call__(
        self,
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
        """``StoreKV`` of k and v at ``write_ids`` (B,), then ``DecodeAttention`` of q
        (``attention``: its keywords): attention without rope. Returns (B, Hq, Dv)."""
        ...


class ExtendAttention(Protocol):
    def __call__(
        self,
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
        """Causal attention of ragged new tokens over their cached prefix and
        themselves. q (T, Hq, D), request b owning rows ``q_indptr[b]:q_indptr[b+1]``
        (q_indptr (B+1,) int32); seq_lens (B,) int32 keys incl. the new ones (already
        stored); max_q_len a host int >= every q length; the rest as in
        ``DecodeAttention``. fresh_kv: the step's own (k, v) rows when no request has
        a cached prefix (a faster path; the result is the same). Returns (T, Hq, Dv)."""
        ...


class PlanDecode(Protocol):
    def __call__(
        self,
        batch: int,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        page_size: int,
        max_len: int,
        device: torch.device,
        workspace: torch.Tensor | None = None,
    ) -> DecodePlan:
        """Decode attention's launch plan for ``batch`` requests whose visible keys
        number at most ``max_len``, from host ints only (no device access);
        ``DecodePlan.launch`` holds the keywords every layer passes to
        ``DecodeAttention``."""
        ...


class PlanExtend(Protocol):
    def __call__(self, num_requests: int, *, max_q_len: int, head_dim: int) -> ExtendPlan:
        """The fresh-prompt attention's launch plan for a step (or the fresh part of a
        split step) of ``num_requests`` prompts with no cached prefix, the longest
        ``max_q_len`` tokens, on a sub-pool of ``head_dim``-wide heads: the variant a
        prompt of that length takes (host ints only). ``ExtendPlan.launch`` holds the
        keywords the layers pass to ``ExtendAttention`` with ``fresh_kv``."""
        ...
