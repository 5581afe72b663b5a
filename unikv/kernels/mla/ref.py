"""Pure-torch references of the MLA (multi-head latent attention) ops: the CPU
path and the test oracle of ``unikv/kernels/mla/prefill.py`` (same signatures).

An MLA layer caches ONE latent row per token (docs/design.md section 1, MLASpec):

    row = [ c (kv_lora_rank) | k_rope (rope_dim) ]      V = c (the first rank columns)

and attention runs in the absorbed form: every query head h brings
``q_latent[h] = W_UK[h]^T q_nope[h]`` (rank wide) and its rope part, and all heads
share the one latent "KV head":

    logit(h, key) = (q_latent[h] . c_key + q_rope[h] . k_rope_key) * sm_scale
    out[h]        = softmax_keys(logit(h, .)) @ c                    (rank wide)

The model maps ``out`` back with W_UV. Ids are kernel ids / kernel page entries
of the MLA sub-pool's dense per-layer latent views (``layout.mla_dense_views``).
"""

from __future__ import annotations

import torch

from unikv.kernels.attention import ref as reference


def check_mla_args(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Shapes, dtypes and strides of ``mla_attention``'s arguments (host only, no sync)."""
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(
            f"q_latent (T, H, rank) and q_rope (T, H, rope) must agree on (T, H), got "
            f"{tuple(q_latent.shape)} and {tuple(q_rope.shape)}"
        )
    if q_latent.stride(2) != 1 or q_rope.stride(2) != 1:
        raise ValueError(
            f"q_latent / q_rope need unit last stride, got {q_latent.stride()} / {q_rope.stride()}"
        )
    rank, rope = q_latent.shape[2], q_rope.shape[2]
    if latent_cache.dim() != 2 or latent_cache.shape[1] != rank + rope:
        raise ValueError(
            f"latent_cache must be the (N, rank + rope) = (N, {rank + rope}) dense latent view "
            f"(unikv.layout.mla_dense_views), got shape {tuple(latent_cache.shape)}"
        )
    if latent_cache.stride(1) != 1 or not latent_cache.is_floating_point():
        raise ValueError(
            f"latent_cache must be a float view with unit last stride, got {latent_cache.dtype} "
            f"strides {latent_cache.stride()}; view fp8 bytes with their fp8 dtype"
        )
    bsz = block_table.shape[0] if block_table.dim() == 2 else -1
    if block_table.dtype != torch.int32 or bsz < 0 or block_table.stride(1) != 1:
        raise ValueError(
            f"block_table must be 2-D int32 with unit column stride, got {block_table.dtype} "
            f"{tuple(block_table.shape)}"
        )
    if q_indptr.dtype != torch.int32 or q_indptr.shape != (bsz + 1,):
        raise ValueError(
            f"q_indptr must be ({bsz + 1},) int32, got {q_indptr.dtype} {tuple(q_indptr.shape)}"
        )
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (bsz,):
        raise ValueError(
            f"seq_lens must be ({bsz},) int32, got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    devices = {t.device for t in (q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens)}
    if len(devices) > 1:
        raise ValueError(f"all tensors must live on one device, got {sorted(map(str, devices))}")


def check_store_args(
    latent_cache: torch.Tensor, kernel_ids: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor
) -> None:
    """Shapes of ``store_mla``'s arguments (host only)."""
    num = kernel_ids.shape[0] if kernel_ids.dim() == 1 else -1
    if latent.dim() != 2 or rope.dim() != 2 or latent.shape[0] != num or rope.shape[0] != num:
        raise ValueError(
            f"latent (T, rank) and rope (T, rope) must have T = {num} rows (one per kernel id), "
            f"got {tuple(latent.shape)} and {tuple(rope.shape)}"
        )
    if latent_cache.dim() != 2 or latent_cache.shape[1] != latent.shape[1] + rope.shape[1]:
        raise ValueError(
            f"latent_cache must be (N, rank + rope) = (N, {latent.shape[1] + rope.shape[1]}), "
            f"got {tuple(latent_cache.shape)}"
        )


def latent_parts(latent_cache: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent view as two (N, 1, *) single-head views: c (rank) and k_rope (rest)."""
    rows = latent_cache[:, None, :]  # (N, 1, rank + rope)
    return rows[..., :rank], rows[..., rank:]


def store_mla(
    latent_cache: torch.Tensor, kernel_ids: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor
) -> None:
    """Write the latent rows of T tokens at kernel ids (a bit copy).

    latent_cache: (N, rank + rope) dense per-layer latent view, storage dtype
    (uint8 for fp8); kernel_ids: (T,) int32/int64; latent: (T, rank) (the
    normalised c); rope: (T, rope) (the rotated shared rope key).
    """
    check_store_args(latent_cache, kernel_ids, latent, rope)
    c_view, rope_view = latent_parts(latent_cache, latent.shape[1])
    reference.store_kv(c_view, rope_view, kernel_ids, latent[:, None], rope[:, None])


def mla_attention(
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
    """Absorbed MLA attention of ragged new tokens over their cached latent rows.

    q_latent: (T, H, rank), q_rope: (T, H, rope) new tokens of B requests, request
    b owning rows ``q_indptr[b]:q_indptr[b+1]`` (decode: q_indptr = arange(B+1),
    max_q_len 1); latent_cache: (N, rank + rope) dense latent view (float dtype);
    block_table: (B, max_pages) int32 kernel page entries; q_indptr: (B+1,) int32;
    seq_lens: (B,) int32 tokens cached incl. the new ones (whose rows are already
    stored); new token j of request b sits at ``seq_lens[b] - q_len_b + j`` and
    sees keys 0..its position. max_q_len: host int >= every q length.
    ``workspace`` is accepted for signature parity and unused.
    Returns out (T, H, rank) in q_latent's dtype.
    """
    check_mla_args(q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens)
    rank = q_latent.shape[2]
    c_view, _ = latent_parts(latent_cache, rank)
    q = torch.cat([q_latent, q_rope.to(q_latent.dtype)], dim=-1)  # (T, H, rank + rope)
    return reference.extend_attention(
        q,
        latent_cache[:, None, :],  # K: the whole row, one shared head
        c_view,  # V: its first rank columns
        block_table,
        q_indptr,
        seq_lens,
        max_q_len=max_q_len,
        page_size=page_size,
        sm_scale=sm_scale,
        out=out,
    )


def store_mla_attention(
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
    """``store_mla`` of the step's rows at ``write_ids``, then ``mla_attention`` over
    them (the Triton backend's decode steps do both in one launch)."""
    store_mla(latent_cache, write_ids, latent, rope)
    return mla_attention(
        q_latent, q_rope, latent_cache, block_table, q_indptr, seq_lens, max_q_len=max_q_len,
        page_size=page_size, sm_scale=sm_scale, out=out, workspace=workspace,
    )  # fmt: skip
