"""GPU tests of the MLA kernels at DeepSeek's real shapes (``pytest -m gpu``).

kv_lora_rank 512, rope 64, H 16 (V2-Lite) and 128 (V3), bf16 and fp32, pages 1, 16
and 64 on randomly permuted pages of a NaN-poisoned MLA sub-pool (3 layers, layer
1 read). Oracle: the torch reference (``mla_ref``) on the same pool. Decode runs
with the split-KV heuristic and forced splits, under ``set_sync_debug_mode("error")``
and replayed from a CUDA graph; extend runs ragged chunks over cached prefixes.
"""

from __future__ import annotations

import math

import pytest
import torch

from unikv import layout
from unikv.kernels.mla import prefill as mla
from unikv.kernels.mla import ref as mla_ref
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MLASpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

RANK, ROPE, LAYER = 512, 64, 1
SCALE = 192**-0.5
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # relative L2 error vs the fp32 reference


def _rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


class Case:
    """Requests of ``lens`` cached tokens on permuted pages of a poisoned MLA pool."""

    def __init__(self, lens, page_size, dtype, seed=0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        spec = MLASpec(3, RANK, ROPE, dtype=dtype)
        pages = [math.ceil(n / page_size) for n in lens]
        cfg = [SubPoolConfig("mla", spec, page_size=page_size)]
        pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"mla": sum(pages) + 2}), "cuda", poison=True)
        sub = pool["mla"]
        perm = torch.randperm(sub.usable_pages, device="cuda", generator=gen)[: sum(pages)]
        perm = perm + sub.first_page
        table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32, device="cuda")
        paged, cursor = sub.paged_views[LAYER], 0
        for b, (n, np_) in enumerate(zip(lens, pages)):
            phys = perm[cursor : cursor + np_]
            cursor += np_
            table[b, :np_] = (phys * sub.blocks_per_page).int()
            pos = torch.arange(n, device="cuda")
            rows = torch.randn(n, RANK + ROPE, device="cuda", generator=gen).to(dtype)
            paged[phys[pos // page_size], pos % page_size] = rows
        self.pool, self.sub, self.cache, self.block_table = pool, sub, sub.views[LAYER], table
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self.page_size, self.dtype = page_size, dtype


def _queries(num, heads, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q_lat = torch.randn(num, heads, RANK, device="cuda", generator=gen).to(dtype)
    q_rope = torch.randn(num, heads, ROPE, device="cuda", generator=gen).to(dtype)
    return q_lat, q_rope


def _indptr(q_lens):
    out = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(q_lens).cumsum(0)
    return out.cuda()


def _both(case, q_lat, q_rope, q_lens, **kw):
    args = (q_lat, q_rope, case.cache, case.block_table, _indptr(q_lens), case.seq_lens)
    opts = {"max_q_len": max(q_lens), "page_size": case.page_size, "sm_scale": SCALE}
    ref = mla_ref.mla_attention(
        q_lat.float(), q_rope.float(), case.cache.float(), *args[3:], **opts
    )
    return mla.mla_attention(*args, **opts, **kw), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("heads,lens", [(16, [1, 700, 4097, 33]), (128, [1, 300, 1500])])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_decode_matches_reference(dtype, ps, heads, lens, splits):
    case = Case(lens, ps, dtype, seed=ps + heads)
    q_lat, q_rope = _queries(len(lens), heads, dtype, seed=heads)
    got, want = _both(case, q_lat, q_rope, [1] * len(lens), num_splits=splits)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert _rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ps", [1, 16])
def test_extend_matches_reference(dtype, ps):
    """A fresh prompt, a chunk over a cached prefix, a decode lane, an empty lane."""
    lens, q_lens = [257, 900, 40, 64], [257, 129, 1, 0]
    case = Case(lens, ps, dtype, seed=3)
    q_lat, q_rope = _queries(sum(q_lens), 16, dtype, seed=5)
    got, want = _both(case, q_lat, q_rope, q_lens)
    assert _rel_err(got, want) < TOL[dtype]


def test_store_is_a_naive_indexed_write():
    spec = MLASpec(3, RANK, ROPE, dtype=torch.bfloat16)
    cfg = [SubPoolConfig("mla", spec, page_size=16)]
    pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"mla": 64}), "cuda", poison=True)
    sub = pool["mla"]
    tokens = torch.randperm(sub.usable_pages * 16, device="cuda")[:300] + sub.first_page * 16
    ids = layout.kernel_ids(tokens, 16, sub.blocks_per_page)
    latent = torch.randn(300, RANK, device="cuda", dtype=torch.bfloat16)
    rope = torch.randn(300, ROPE, device="cuda", dtype=torch.bfloat16)
    expect = pool.buffer.clone()
    paged = layout.mla_paged_views(expect, spec, 16, sub.num_pages)[LAYER]
    paged[tokens // 16, tokens % 16] = torch.cat([latent, rope], dim=1)
    mla.store_mla(sub.views[LAYER], ids, latent, rope)
    assert torch.equal(pool.buffer, expect)


def test_decode_graph_replay_without_host_sync():
    """Decode with splits into caller-owned out/workspace: no host sync while
    launched, and a CUDA graph replay after new lengths equals a fresh launch."""
    lens = [2000, 37, 900, 4000]
    case = Case(lens, 16, torch.bfloat16, seed=9)
    q_lat, q_rope = _queries(len(lens), 128, torch.bfloat16, seed=1)
    indptr = _indptr([1] * len(lens))
    out = torch.empty(len(lens), 128, RANK, device="cuda", dtype=torch.bfloat16)
    workspace = torch.empty(mla.workspace_numel(len(lens), 128, RANK, 16), device="cuda")
    args = (q_lat, q_rope, case.cache, case.block_table, indptr, case.seq_lens)
    opts = {"max_q_len": 1, "page_size": 16, "sm_scale": SCALE, "out": out, "workspace": workspace}
    mla.mla_attention(*args, **opts, num_splits=16)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla.mla_attention(*args, **opts, num_splits=16)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.mla_attention(*args, **opts, num_splits=16)
    case.seq_lens.copy_(torch.tensor([1999, 30, 899, 4000], dtype=torch.int32))
    graph.replay()
    want = mla.mla_attention(
        *args[:5], case.seq_lens, max_q_len=1, page_size=16, sm_scale=SCALE, num_splits=16
    )
    assert torch.equal(out, want)
