"""Decode attention's loads before the PDL wait (``decode.PRELOAD``): seq_lens, the
block table and each split's first tile of K/V rows but the step's new one are loaded
before the wait, and the new row joins the tile after it (from registers when rope +
store run inside the launch, else reloaded).

The second description is the same launch without the preload: the output and the
pool must be the same bytes. The new rows are NaN before the call (never written), so
a tile that kept a pre-wait copy of one would poison its output. Under the interpreter
``wait`` is a no-op, so the ordering itself is checked on the GPU
(``test_kernels_decode_preload_gpu``); here the arithmetic of both paths is."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import PagedCase, paged_decode, paged_oracle
from test_kernels_rope_decode import CASES, _call, _case, _kw

from unikv.kernels import get_backend

TRITON = get_backend("cpu", "triton")


@pytest.mark.parametrize("dtype,heads,group,dim,half,ps,extra", CASES)
def test_preload_with_rope_inside_writes_the_same_bytes(dtype, heads, group, dim, half, ps,
                                                        extra):  # fmt: skip
    kw = _kw(extra, heads * group)
    outs, pools = [], []
    for preload in (True, False):
        case, qkv, cos, sin, pos, ids = _case(dtype, heads, group, dim, half, ps)
        outs.append(_call(TRITON, case, qkv, cos, sin, pos, ids, preload=preload, **kw))
        pools.append(case.pool.buffer)
    assert torch.equal(pools[0], pools[1])
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()


@pytest.mark.parametrize(
    "lens,group,ps,extra",
    [
        ([1, 37, 20], 4, 4, {"num_splits": 3}),
        ([100, 7], 2, 1, {"num_splits": 1}),  # several tiles a split: the loop after the tile
        ([40, 33, 1], 3, 4, {"num_splits": 20, "window": 9}),
        ([29, 64], 2, 8, {"num_splits": 5, "sinks": "rand"}),
    ],
)
def test_preload_without_rope_writes_the_same_bytes(lens, group, ps, extra):
    """The new row (the last cached one, stored before the launch) reloaded after the
    wait: the same bytes as the launch without the preload, and the oracle's values."""
    case = PagedCase(lens, 2, 16, ps, dtype=torch.float16)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(lens), 2 * group, 16, generator=gen).half()
    kw = dict(extra)
    if kw.get("sinks") == "rand":
        kw["sinks"] = torch.randn(2 * group, generator=gen)
    got = paged_decode(TRITON, case, q, sm_scale=0.25, preload=True, **kw)
    want = paged_decode(TRITON, case, q, sm_scale=0.25, preload=False, **kw)
    assert torch.equal(got, want)
    kw.pop("num_splits")
    oracle = paged_oracle(case, q, sm_scale=0.25, **kw)
    torch.testing.assert_close(got.float(), oracle, atol=3e-3, rtol=3e-3)
