"""``benchmarks/bench_prefix.py --tiny`` on CPU in fp32: the benchmark's own check
(greedy tokens with the prefix cache equal those without it, or it exits) over the
system-prompt and chat workloads of the tiny Llama and Qwen3.5 hybrid, and its
spill row (cached pages through the host tier and back, byte counts of both)."""

from __future__ import annotations

import json

import pytest
from engine_fixtures import one_thread  # noqa: F401  (a fixture)


@pytest.mark.usefixtures("one_thread")
def test_tiny_bench_prefix_runs_exact_and_hits(tmp_path):
    from benchmarks import bench_prefix

    out = tmp_path / "prefix.json"
    argv = ["--tiny", "--device", "cpu", "--dtype", "float32", "--out", str(out)]
    assert bench_prefix.main(argv) == 0  # exits on an fp32 token mismatch
    res = json.loads(out.read_text())
    for model in ("llama", "hybrid"):
        for workload in ("system", "chat"):
            row = res[model][workload]
            assert row["no_cache"]["hit_rate"] == 0 and row["no_cache"]["prefill_tokens_saved"] == 0
            assert row["cache"]["hit_rate"] > 0.2, (model, workload, row["cache"])
            assert row["token_agreement"] == {"tokens": 1.0, "first_tokens": 1.0}
    spill = res["llama"]["spill"]
    counters, page_bytes = spill["counters"], spill["bytes"] // spill["pages"]
    moved = spill["pages"] + 2  # the timed pages and the 2-page warm-up cycle
    assert counters["host_spilled_pages"] == counters["host_reloaded_pages"] == moved, counters
    assert counters["host_spilled_bytes"] == counters["host_reloaded_bytes"] == moved * page_bytes
