"""The fused split merge of decode attention (``decode.FUSED_MERGE``): the last split
program of each (request, KV head) merges the splits itself, after taking a ticket.

The second description is the merge kernel of the same splits (``fused_merge=False``):
the two must write the same bytes, and both must match an fp32 oracle over dense,
un-paged K/V. Under TRITON_INTERPRET=1 programs run one after another, so the ticket
order is fixed there; the GPU test (``test_kernels_decode_merge_gpu``) races them.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import PagedCase, paged_decode, paged_oracle

from unikv.kernels import decode, get_backend

DIM = 16


def _both(lens, heads, group, ps, *, dtype=torch.float16, seed=0, counters=None, **kw):
    case = PagedCase(lens, heads, DIM, ps, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 11)
    q = torch.randn(len(lens), heads * group, DIM, generator=gen).to(dtype)
    if kw.get("sinks") == "rand":
        kw["sinks"] = torch.randn(heads * group, generator=gen)
    ops = get_backend("cpu", backend="triton")
    fused = paged_decode(ops, case, q, sm_scale=DIM**-0.5, fused_merge=True, counters=counters,
                         **kw)  # fmt: skip
    kernel = paged_decode(ops, case, q, sm_scale=DIM**-0.5, fused_merge=False, **kw)
    kw.pop("num_splits")
    return fused, kernel, paged_oracle(case, q, sm_scale=DIM**-0.5, **kw)


@pytest.mark.parametrize(
    "lens,group,ps,extra",
    [
        ([1, 37, 20], 4, 4, {"num_splits": 3}),
        ([70, 5], 1, 2, {"num_splits": 7}),  # splits past the keys: skipped chunks
        ([40, 33, 1], 3, 4, {"num_splits": 20, "window": 9}),
        ([29, 64], 8, 8, {"num_splits": 5, "sinks": "rand"}),
        ([100], 2, 1, {"num_splits": 40, "soft_cap": 3.0}),  # > one merge chunk of splits
    ],
)
def test_fused_merge_writes_the_merge_kernels_bytes(lens, group, ps, extra):
    fused, kernel, want = _both(lens, 2, group, ps, **extra)
    assert torch.equal(fused, kernel)
    torch.testing.assert_close(fused.float(), want, atol=3e-3, rtol=3e-3)


def test_fused_merge_leaves_its_tickets_zero_for_reuse():
    """One counters buffer over several calls (as CUDA graph replays reuse it): every
    call finds it zeroed and leaves it so; a request of no keys merges to zeros."""
    counters = torch.zeros(decode.counters_numel(3, 2) + 5, dtype=torch.int32)
    for seed in range(3):
        fused, kernel, _ = _both([9, 31, 17], 2, 2, 4, seed=seed, counters=counters,
                                 num_splits=4)  # fmt: skip
        assert torch.equal(fused, kernel)
        assert not counters.any()
    case = PagedCase([5, 3], 1, DIM, 4)
    q = torch.randn(2, 2, DIM)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    out = get_backend("cpu", backend="triton").decode_attention(
        q, case.k_cache, case.v_cache, case.block_table, lens, page_size=4, sm_scale=0.25,
        num_splits=3, counters=counters, fused_merge=True,
    )  # fmt: skip
    assert torch.equal(out[1], torch.zeros_like(out[1])) and not counters.any()


def test_fused_merge_rejects_bad_counters():
    case = PagedCase([9, 4], 2, DIM, 4)
    q = torch.randn(2, 4, DIM)
    ops = get_backend("cpu", backend="triton")
    for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)):
        with pytest.raises(ValueError, match="counters must be int32"):
            paged_decode(ops, case, q, sm_scale=0.25, num_splits=2, fused_merge=True,
                         counters=bad)  # fmt: skip
