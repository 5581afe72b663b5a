"""The split merge inside decode attention's split launch (``decode_attention(counters=)``,
Triton under the CPU interpreter): the last split program of each (request, KV head)
to arrive merges that head group's splits.

The second description is the same launch without counters, whose merge kernel reads
every split in another order (the fused merge reads only the splits holding keys, a
pass of them at a time, online): the outputs must agree to fp32 rounding, and with the
dense oracle. The counters must be zero again after each launch, so a second launch
over the same counters (a graph replay) gives the same bytes. Under the interpreter the programs
run one after another, so the arrival order itself is checked on the GPU
(``test_kernels_gpu``); here the counting, the merge's choice of rows and its sums are.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import PagedCase, paged_decode, paged_oracle
from test_kernels_rope_decode import CASES, _call, _case, _kw

from unikv.kernels import decode, get_backend

TRITON = get_backend("cpu", "triton")


def _counters(case, group_heads=None):
    return torch.zeros(len(case.lens) * (group_heads or case.heads) + 3, dtype=torch.int32)


@pytest.mark.parametrize(
    "lens,group,ps,extra",
    [
        ([1, 37, 20], 4, 4, {"num_splits": 3}),
        ([40, 33, 1], 3, 4, {"num_splits": 20, "window": 9}),  # most splits empty
        ([29, 64, 0], 2, 8, {"num_splits": 5, "sinks": "rand"}),  # a padded lane
        ([70, 5], 2, 1, {"num_splits": 9, "soft_cap": 2.0}),
        ([200, 130], 4, 4, {"num_splits": 6}),  # even splits: later passes raise the max
    ],
)
@pytest.mark.parametrize("tile", [4096, 64])  # one pass; one or two splits a pass
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_merge_matches_the_merge_kernel(monkeypatch, lens, group, ps, extra, tile, dtype):
    monkeypatch.setattr(decode, "FUSED_TILE", tile)
    case = PagedCase(lens, 2, 16, ps, dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(lens), 2 * group, 16, generator=gen).to(dtype)
    kw = dict(extra)
    if kw.get("sinks") == "rand":
        kw["sinks"] = torch.randn(2 * group, generator=gen)
    counters = _counters(case)
    want = paged_decode(TRITON, case, q, sm_scale=0.25, **kw)
    got = paged_decode(TRITON, case, q, sm_scale=0.25, counters=counters, **kw)
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # fp16: one rounding of the output
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert not counters.any(), "every launch leaves its counters zero"
    again = paged_decode(TRITON, case, q, sm_scale=0.25, counters=counters, **kw)
    assert torch.equal(again, got)
    kw.pop("num_splits")
    oracle = paged_oracle(case, q, sm_scale=0.25, **kw)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(got.float(), oracle, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,heads,group,dim,half,ps,extra", CASES)
def test_fused_merge_with_rope_inside_writes_the_same_bytes(dtype, heads, group, dim, half, ps,
                                                            extra):  # fmt: skip
    """Rope + store inside the launch, with and without the counters: the same pool
    bytes, the outputs to one rounding (16-bit) or fp32's."""
    kw = _kw(extra, heads * group)
    outs, pools = [], []
    for counters in (None, torch.zeros(64, dtype=torch.int32)):
        case, qkv, cos, sin, pos, ids = _case(dtype, heads, group, dim, half, ps)
        outs.append(_call(TRITON, case, qkv, cos, sin, pos, ids, counters=counters, **kw))
        pools.append(case.pool.buffer)
    assert torch.equal(pools[0], pools[1])
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    assert not outs[0].isnan().any()


def test_plan_hands_counters_only_with_splits():
    """plan_decode passes the counters (sized B x H_kv) where the launch splits, and
    the planned launch equals the unplanned one."""
    case = PagedCase([50, 3], 2, 16, 4, dtype=torch.float16)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1)).half()
    counters = torch.zeros(16, dtype=torch.int32)
    geometry = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16, "v_head_dim": 16,
                "page_size": 4, "device": torch.device("cpu")}  # fmt: skip
    plan = TRITON.plan_decode(2, max_len=4096, counters=counters, **geometry)
    assert plan.num_splits > 1 and plan.launch["counters"].numel() == 4
    got = paged_decode(TRITON, case, q, sm_scale=0.25, **plan.launch)
    launch = {k: v for k, v in plan.launch.items() if k != "counters"}
    want = paged_decode(TRITON, case, q, sm_scale=0.25, **launch)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    one = TRITON.plan_decode(2, max_len=16, counters=counters, **geometry)
    assert one.num_splits == 1 and "counters" not in one.launch


@pytest.mark.parametrize(
    "counters,what",
    [
        (torch.zeros(8, dtype=torch.int64), "int64"),
        (torch.zeros(3, dtype=torch.int32), "x 3"),
    ],
)
def test_bad_counters_are_refused(counters, what):
    case = PagedCase([20, 9], 2, 16, 4, dtype=torch.float16)
    q = torch.zeros(2, 4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=what):
        paged_decode(TRITON, case, q, sm_scale=0.25, num_splits=2, counters=counters)


def test_counters_on_the_device_by_type_or_index():
    """Counters on the device (named as the planner names it) are accepted, on
    another device type refused (the index rule, ``cuda`` against ``cuda:0``, is
    exercised on the GPU by every engine test)."""
    counters = torch.zeros(4, dtype=torch.int32)
    decode.check_counters(counters, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="on meta"):
        decode.check_counters(counters, 4, torch.device("meta"))
