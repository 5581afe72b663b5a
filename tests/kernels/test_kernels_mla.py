"""MLA kernels (``store_mla``, ``mla_attention``): Triton under TRITON_INTERPRET=1 on
CPU and the torch reference, against an fp32 oracle written from the definition
of absorbed latent attention over dense, un-paged latent rows.

The latent rows live in a real, NaN-poisoned UnifiedPool with an MLA sub-pool of
3 layers (rank 24, rope 8: odd widths), on randomly permuted pages, written by a
naive indexed write through the (page, slot) oracle view ``mla_paged_views`` and
read by the kernels through layer 1's dense view (a strided, offset view).
"""

from __future__ import annotations

import math

import pytest
import torch

from unikv import layout
from unikv.kernels import get_backend
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MLASpec

BACKENDS = ["torch", "triton"]
RANK, ROPE, LAYERS, LAYER = 24, 8, 3, 1
SCALE = 0.3


def _ops(name):
    return get_backend("cpu", backend=name)


class LatentCase:
    """Requests of ``lens`` cached tokens on randomly permuted MLA pages.

    rows[b]: (L_b, rank + rope) fp32, exactly the stored values; block_table:
    (B, max_pages + 1) int32 kernel page entries (a zero padding column = sink)."""

    def __init__(self, lens, page_size, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        spec = MLASpec(LAYERS, RANK, ROPE, dtype=dtype)
        pages = [math.ceil(n / page_size) for n in lens]
        cfg = [SubPoolConfig("mla", spec, page_size=page_size)]
        self.pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"mla": sum(pages) + 3}), poison=True)
        sub = self.pool["mla"]
        perm = torch.randperm(sub.usable_pages, generator=gen)[: sum(pages)] + sub.first_page
        table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
        paged = sub.paged_views[LAYER]  # (num_pages, ps, rank + rope): the oracle view
        self.rows, cursor = [], 0
        for b, (n, np_) in enumerate(zip(lens, pages)):
            phys = perm[cursor : cursor + np_]
            cursor += np_
            table[b, :np_] = (phys * sub.blocks_per_page).int()
            rows = torch.randn(n, RANK + ROPE, generator=gen).to(dtype)
            pos = torch.arange(n)
            paged[phys[pos // page_size], pos % page_size] = rows
            self.rows.append(rows.float())
        self.cache = sub.views[LAYER]
        self.block_table = table
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.page_size, self.sub = page_size, sub


def oracle(q_lat, q_rope, rows, positions):
    """fp32 absorbed attention of queries at ``positions`` over rows[:pos + 1].

    q_lat: (M, H, rank), q_rope: (M, H, rope), rows: (L, rank + rope); one query
    row and one head at a time, from the definition."""
    out = torch.zeros(q_lat.shape[0], q_lat.shape[1], RANK)
    for m, pos in enumerate(positions):
        keys = rows[: pos + 1]
        for h in range(q_lat.shape[1]):
            logits = keys[:, :RANK] @ q_lat[m, h].float() + keys[:, RANK:] @ q_rope[m, h].float()
            out[m, h] = torch.softmax(logits * SCALE, dim=0) @ keys[:, :RANK]
    return out


def _queries(num, heads, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(num, heads, RANK, generator=gen).to(dtype)
    q_rope = torch.randn(num, heads, ROPE, generator=gen).to(dtype)
    return q_lat, q_rope


def _run(backend, case, q_lat, q_rope, q_lens, **kw):
    q_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    q_indptr[1:] = torch.tensor(q_lens).cumsum(0)
    return _ops(backend).mla_attention(
        q_lat,
        q_rope,
        case.cache,
        case.block_table,
        q_indptr,
        case.seq_lens,
        max_q_len=max(q_lens),
        page_size=case.page_size,
        sm_scale=SCALE,
        **kw,
    )


def _want(case, q_lat, q_rope, lens, q_lens):
    outs, start = [], 0
    for n, q in zip(lens, q_lens):
        positions = list(range(n - q, n))
        outs.append(
            oracle(
                q_lat[start : start + q], q_rope[start : start + q], case.rows[len(outs)], positions
            )
        )
        start += q
    return torch.cat(outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ps,heads,splits", [(1, 4, None), (3, 5, 3), (16, 16, 2), (4, 3, 7)])
def test_decode_matches_oracle(backend, ps, heads, splits):
    """One token per request; forced split counts (the merge kernel) on Triton."""
    lens = [1, 37, 20]
    case = LatentCase(lens, ps, seed=ps)
    q_lat, q_rope = _queries(len(lens), heads, torch.float32, seed=heads)
    kw = {"num_splits": splits} if backend == "triton" and splits else {}
    got = _run(backend, case, q_lat, q_rope, [1] * len(lens), **kw)
    want = _want(case, q_lat, q_rope, lens, [1] * len(lens))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_extend_matches_oracle(backend, ps):
    """Ragged new tokens over cached prefixes (a fresh prompt, a chunk, a decode
    lane, a lane with no new token), causal within the chunk."""
    lens, q_lens = [9, 30, 5, 12], [9, 11, 1, 0]
    case = LatentCase(lens, ps, seed=11)
    q_lat, q_rope = _queries(sum(q_lens), 3, torch.float32, seed=2)
    got = _run(backend, case, q_lat, q_rope, q_lens)
    want = _want(case, q_lat, q_rope, lens, q_lens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_decode_and_extend(backend):
    lens, q_lens = [17, 40], [1, 6]
    case = LatentCase(lens, 4, dtype=torch.float16, seed=5)
    q_lat, q_rope = _queries(sum(q_lens), 4, torch.float16, seed=3)
    got = _run(backend, case, q_lat, q_rope, q_lens)
    assert got.dtype == torch.float16
    want = _want(case, q_lat, q_rope, lens, q_lens)
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


def test_triton_equals_reference_on_random_permutations():
    """Both backends on the same poisoned pool, several seeds of page permutations."""
    for seed in range(3):
        lens, q_lens = [3, 21, 8], [3, 4, 1]
        case = LatentCase(lens, 2, seed=20 + seed)
        q_lat, q_rope = _queries(sum(q_lens), 6, torch.float32, seed=seed)
        ref = _run("torch", case, q_lat, q_rope, q_lens)
        tri = _run("triton", case, q_lat, q_rope, q_lens)
        assert torch.isfinite(tri).all()
        torch.testing.assert_close(tri, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ps", [1, 3, 16])
def test_store_is_a_naive_indexed_write(backend, ps):
    """store_mla writes exactly [latent | rope] at the kernel ids of random tokens
    and no other byte: the whole buffer equals a copy written by indexed writes
    through the (page, slot) view."""
    spec = MLASpec(LAYERS, RANK, ROPE, dtype=torch.float32)
    cfg = [SubPoolConfig("mla", spec, page_size=ps)]
    pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"mla": 9}), poison=True)
    sub = pool["mla"]
    gen = torch.Generator().manual_seed(ps)
    tokens = torch.randperm(sub.usable_pages * ps, generator=gen)[:7] + sub.first_page * ps
    ids = layout.kernel_ids(tokens, ps, sub.blocks_per_page).int()
    latent = torch.randn(7, RANK, generator=gen)
    rope = torch.randn(7, ROPE, generator=gen)
    expect = pool.buffer.clone()
    paged = layout.mla_paged_views(expect, spec, ps, sub.num_pages)[LAYER]
    paged[tokens // ps, tokens % ps] = torch.cat([latent, rope], dim=1)
    _ops(backend).store_mla(sub.views[LAYER], ids, latent, rope)
    assert torch.equal(pool.buffer, expect)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_shapes_raise(backend):
    case = LatentCase([4], 4)
    q_lat, q_rope = _queries(1, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="rank \\+ rope"):
        _run(backend, case, q_lat[..., :-1], q_rope, [1])
    with pytest.raises(ValueError, match="T = 3 rows"):  # 3 ids for 2 rows
        _ops(backend).store_mla(case.cache, torch.zeros(3, dtype=torch.int32), q_lat[0], q_rope[0])
