"""``benchmarks/bench_fp8_gemm.py``'s decode bookkeeping, on CPU (its timings need a GPU):
a candidate at the plan's own split rule and tile is the plan (so the candidates it
sets beside the plan differ from it only where they say), and the summary pairs each
shape's fused plan with its torch-summed twin.

Oracle: ``fp8_gemm.plan`` itself, for the decode rows of every benchmarked shape."""

from __future__ import annotations

from benchmarks import bench_fp8_gemm as bench
from unikv.kernels.linear import fp8_gemm


def test_a_candidate_at_the_plan_rule_is_the_plan():
    rule = (64, 4, 4, fp8_gemm.TARGET_PROGRAMS, fp8_gemm.MIN_K_PER_SPLIT)
    assert rule in bench.DECODE_CANDIDATES
    for n, k in bench.SHAPES.values():
        for m in bench.DECODE_M:
            want = fp8_gemm.plan(m, n, k, bench.BLOCK, False)
            assert bench.with_split(rule, m, n, k) == want, (m, n, k)
    # kv_a at one row: the plan's 126 programs; the candidates offer more and fewer
    splits = {bench.with_split(c, 1, 576, 7168).split_k for c in bench.DECODE_CANDIDATES}
    assert {7, 14, 28} <= splits


def test_summary_pairs_the_fused_plan_with_the_torch_sum():
    rows = [
        {"shape": "a", "M": 1, "impl": "fp8_plan", "us": 2.0, "of_bw": 0.5},
        {"shape": "a", "M": 1, "impl": "fp8_plan_torch_sum", "us": 3.0, "of_bw": 0.3},
        {"shape": "a", "M": 4, "impl": "fp8_plan", "us": 2.0, "of_bw": 0.5},
        {"shape": "a", "M": 4, "impl": "fp8_plan_torch_sum", "us": 5.0, "of_bw": 0.2},
        {"shape": "b", "M": 1, "impl": "fp8_plan", "error": "differs"},
        {"shape": "b", "M": 1, "impl": "fp8_plan_torch_sum", "us": 5.0, "of_bw": 0.2},
    ]
    got = bench.summary(rows, [], [])
    assert got["decode_torch_sum_over_fused"] == {"a@1": 1.5, "a@4": 2.5}
    assert got["decode_of_bw_plan"]["measured"] == 2  # the fused plan rows only
