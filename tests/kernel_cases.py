"""Shared fixtures for the kernel tests: paged K/V inside a real UnifiedPool and an
independent fp32 oracle computed from a dense, un-paged copy of the same K/V, and
the decode / extend calls over such a case (``paged_decode``, ``paged_extend``) with
the oracle of the same request positions (``paged_oracle``).

The pool is poisoned (every never-written byte is NaN), its pages are handed to
requests in a random permutation, and the rows are written with a naive indexed
write through the (page, slot) oracle view, never through the kernels under test.
"""

from __future__ import annotations

import itertools
import math

import torch

from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec


class PagedCase:
    """Requests of ``lens`` tokens on randomly permuted pages of a real pool.

    dense_k[b]: (L_b, H, D) fp32, dense_v[b]: (L_b, H, Dv) fp32 (exactly the
    stored values); block_table: (B, max_pages + 1) int32 kernel page entries
    (one padding column of zeros = the sink); seq_lens: (B,) int32.
    """

    def __init__(
        self,
        lens,
        heads,
        dim,
        page_size,
        *,
        dim_v=None,
        dtype=torch.float32,
        device="cpu",
        num_layers=2,
        layer=1,
        seed=0,
    ):
        gen = torch.Generator().manual_seed(seed)  # K/V data: the same for every page size
        perm_gen = torch.Generator().manual_seed(seed + 1)
        dim_v = dim_v or dim
        spec = MHASpec(num_layers, heads, dim, v_head_dim=dim_v, dtype=dtype)
        pages = [math.ceil(n / page_size) for n in lens]
        cfg = [SubPoolConfig("full", spec, page_size=page_size)]
        total = pool_bytes_for(cfg, {"full": sum(pages) + 2})
        self.pool = UnifiedPool(cfg, total, device, poison=True)
        sub = self.pool["full"]
        perm = torch.randperm(sub.usable_pages, generator=perm_gen)[: sum(pages)] + sub.first_page
        table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
        paged_k, paged_v = sub.paged_views[layer]  # (num_pages, ps, H, D) oracle views
        self.dense_k, self.dense_v, cursor = [], [], 0
        for b, (n, np_) in enumerate(zip(lens, pages)):
            phys = perm[cursor : cursor + np_]
            cursor += np_
            table[b, :np_] = (phys * sub.blocks_per_page).int()
            k = torch.randn(n, heads, dim, generator=gen).to(dtype)
            v = torch.randn(n, heads, dim_v, generator=gen).to(dtype)
            pos = torch.arange(n)
            where = (phys[pos // page_size].to(device), (pos % page_size).to(device))
            paged_k[where] = k.to(device).view(paged_k.dtype)  # fp8 rows as raw bytes
            paged_v[where] = v.to(device).view(paged_v.dtype)
            self.dense_k.append(k.float())
            self.dense_v.append(v.float())
        self.k_cache, self.v_cache = sub.views[layer]
        self.block_table = table.to(device)
        self.lens = list(lens)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.page_size, self.heads, self.dtype = page_size, heads, dtype


def oracle_attention(q, keys, values, positions, *, sm_scale, window=0, sinks=None, soft_cap=0.0):
    """fp32 attention of queries at ``positions`` over dense keys 0..L-1 of one request.

    q: (M, Hq, D); keys: (L, H, D); values: (L, H, Dv); positions: list of M ints.
    Written from the definitions, one query row at a time.
    """
    group = q.shape[1] // keys.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], values.shape[2], device=q.device)
    for m, pos in enumerate(positions):
        first = max(0, pos - window + 1) if window > 0 else 0
        k = keys[first : pos + 1].repeat_interleave(group, dim=1)  # (n, Hq, D)
        v = values[first : pos + 1].repeat_interleave(group, dim=1)
        logits = torch.einsum("nhd,hd->hn", k, q[m].float()) * sm_scale  # (Hq, n)
        if soft_cap > 0:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        if sinks is not None:
            logits = torch.cat([logits, sinks.float()[:, None]], dim=1)
        w = torch.softmax(logits, dim=1)[:, : k.shape[0]]
        out[m] = torch.einsum("hn,nhd->hd", w, v)
    return out


def indptr_of(new: list[int], device="cpu") -> torch.Tensor:
    """(B + 1,) int32 row offsets of ragged chunks of ``new[b]`` query rows."""
    return torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32, device=device)


def paged_oracle(case: PagedCase, q, new=None, *, sm_scale, **kw) -> torch.Tensor:
    """(sum(new), Hq, Dv) fp32 on the host: ``oracle_attention`` of request b's last
    ``new[b]`` positions (default 1: a decode step) over its dense K/V. q: (sum(new),
    Hq, D) on any device, rows of request b after those of the requests before it."""
    new = new or [1] * len(case.lens)
    rows, start = [], 0
    for b, (n, m) in enumerate(zip(case.lens, new, strict=True)):
        qb = q[start : start + m].cpu()
        rows.append(
            oracle_attention(
                qb, case.dense_k[b], case.dense_v[b], list(range(n - m, n)), sm_scale=sm_scale, **kw
            )
        )
        start += m
    return torch.cat(rows)


def paged_decode(ops, case: PagedCase, q, *, sm_scale, **kw) -> torch.Tensor:
    """``ops.decode_attention`` of q (B, Hq, D) over the case's pages: (B, Hq, Dv)."""
    return ops.decode_attention(
        q, case.k_cache, case.v_cache, case.block_table, case.seq_lens,
        page_size=case.page_size, sm_scale=sm_scale, **kw,
    )  # fmt: skip


def paged_extend(ops, case: PagedCase, q, new: list[int], *, sm_scale, **kw) -> torch.Tensor:
    """``ops.extend_attention`` of request b's last ``new[b]`` positions over the
    case's pages (its prefix cached before them). q: (sum(new), Hq, D)."""
    return ops.extend_attention(
        q, case.k_cache, case.v_cache, case.block_table, indptr_of(new, q.device),
        case.seq_lens, max_q_len=max(new), page_size=case.page_size, sm_scale=sm_scale, **kw,
    )  # fmt: skip
