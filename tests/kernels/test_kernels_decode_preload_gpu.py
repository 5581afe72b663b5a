"""The pre-wait loads of one request's decode attention on the GPU, in the chain they
run in: a PDL GEMV writes the step's q / k / v (its pre-norm inside, as the engine
runs it), then the attention (rope + store inside, or the store alone: attention
without rope) waits for it. With
and without the preload, call after call and in a CUDA graph, the output and the
pool are the same bytes; the new rows are NaN before the first call."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import PagedCase

from unikv.kernels import get_backend
from unikv.kernels.linear import gemv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("lens", [[644], [1, 300, 17, 4096], [5000]])
def test_preload_on_the_gpu_writes_the_same_bytes(lens, rope):
    cuda = get_backend("cuda")
    b = len(lens)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(b, 2048, generator=gen).bfloat16().cuda()
    nw = (1 + 0.1 * torch.randn(2048, generator=gen)).bfloat16().cuda()
    w = (0.02 * torch.randn(3072, 2048, generator=gen)).bfloat16().cuda()
    cos = torch.randn(8192, 32, generator=gen).cuda()
    sin = torch.randn(8192, 32, generator=gen).cuda()

    def step(case, ids, preload, out):
        qkv, _ = gemv.gemv(x, w, norm=(None, nw, 1e-5, 0.0))  # writes q / k / v under PDL
        q, k, v = qkv.split([2048, 512, 512], dim=-1)
        q, k, v = q.view(b, 32, 64), k.view(b, 8, 64), v.view(b, 8, 64)
        kw = {"page_size": 16, "sm_scale": 0.125, "preload": preload, "out": out}
        if not rope:
            return cuda.store_decode_attention(case.k_cache, case.v_cache, ids, q, k, v,
                                               case.block_table, case.seq_lens, **kw)  # fmt: skip
        return cuda.rope_store_decode_attention(
            case.k_cache, case.v_cache, ids, q, k, v, cos, sin, pos, case.block_table,
            case.seq_lens, **kw,
        )  # fmt: skip

    last = torch.tensor(lens) - 1
    pos = last.cuda()
    results = []
    for preload in (False, True):
        case = PagedCase(lens, 8, 64, 16, dtype=torch.bfloat16, device="cuda", seed=3)
        entries = case.block_table.cpu()[torch.arange(b), last // 16].long()
        ids = (entries * 16 + last % 16).cuda()
        sub = case.pool["full"]
        page = (entries // sub.blocks_per_page).cuda()
        for view in sub.paged_views[1]:
            view[page, (last % 16).cuda()] = float("nan")  # the new rows: never written yet
        out = torch.empty(b, 32, 64, dtype=torch.bfloat16, device="cuda")
        first = step(case, ids, preload, out).clone()
        for _ in range(10):
            assert torch.equal(step(case, ids, preload, out), first)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(case, ids, preload, out)
        for _ in range(10):
            out.zero_()
            graph.replay()
            assert torch.equal(out, first)
        results.append((first, case.pool.buffer.clone()))
    (want, want_pool), (got, got_pool) = results
    assert not want.isnan().any()
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)
