"""The fused split merge on the GPU, where the split programs of one (request, KV
head) race for their tickets: at Llama-3.2-1B's heads (32 / 8, head dim 64, page 16)
with the split count the planner picks, the fused launch must write the bytes of the
merge kernel over the same splits, call after call over one counters buffer, in a
CUDA graph too, and match the fp32 oracle."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import PagedCase, paged_decode, paged_oracle

from unikv.kernels import decode, get_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("lens", [[644], [1, 300, 17, 4096, 64, 9, 700, 2000]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sinks", [False, True])
def test_fused_merge_on_the_gpu_writes_the_merge_kernels_bytes(lens, dtype, sinks):
    cuda = get_backend("cuda")
    case = PagedCase(lens, 8, 64, 16, dtype=dtype, device="cuda", seed=2)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(lens), 32, 64, generator=gen).to(dtype).cuda()
    kw = {"sm_scale": 0.125}
    if sinks:
        kw["sinks"] = torch.randn(32, generator=gen).cuda()
    splits = decode.choose_num_splits(len(lens), 8, case.block_table.shape[1] * 16, q.device)
    assert splits > 1, "the planner's split count at these batches"
    want = paged_decode(cuda, case, q, fused_merge=False, **kw)
    counters = torch.zeros(decode.counters_numel(len(lens), 8), dtype=torch.int32,
                           device="cuda")  # fmt: skip
    for _ in range(20):  # the tickets race differently every call
        got = paged_decode(cuda, case, q, fused_merge=True, counters=counters, **kw)
        assert torch.equal(got, want)
    assert not counters.any()
    out = torch.empty_like(want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(cuda, case, q, fused_merge=True, counters=counters, out=out, **kw)
    for _ in range(20):
        out.zero_()
        graph.replay()
        assert torch.equal(out, want)
    assert not counters.any()
    oracle = paged_oracle(case, q, sm_scale=0.125, sinks=kw["sinks"].cpu() if sinks else None)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(want.float().cpu(), oracle, rtol=tol, atol=tol)
