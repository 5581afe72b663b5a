"""``benchmarks/bench_prefix.py --tiny`` on CPU in fp32: the benchmark's own check
(greedy tokens with the prefix cache equal those without it, or it exits) over the
system-prompt and chat workloads of the tiny Llama, Qwen3.5 hybrid and gpt-oss-shaped
sliding-window model, and its
spill row (cached pages through the host tier and back, byte counts of both).
The cost breakdown is checked against the workload's own arithmetic: prompt tokens
of the --tiny sizes, new prefixes, and the checkpoint copies the counters saw."""

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
            _check_breakdown(model, workload, row)
    spill = res["llama"]["spill"]
    counters, page_bytes = spill["counters"], spill["bytes"] // spill["pages"]
    moved = spill["pages"] + 2  # the timed pages and the 2-page warm-up cycle
    assert counters["host_spilled_pages"] == counters["host_reloaded_pages"] == moved, counters
    assert counters["host_spilled_bytes"] == counters["host_reloaded_bytes"] == moved * page_bytes
    for way in ("spill", "reload"):  # its split: parts of its own wall time
        split = spill["split"][way]
        assert split["copy_launches"] == 1, split  # one run of pages: one launch
        assert 0 < split["host_before_copy_s"] + split["copy_s"] <= split["seconds"] * 1.001, split


@pytest.mark.usefixtures("one_thread")
def test_tiny_bench_prefix_swa_model_runs_exact_and_hits(tmp_path):
    """``--models swa`` (the gpt-oss-shaped sliding-window + full attention model):
    tokens exact in fp32 with and without the cache, hits on both workloads, the same
    figures as the other models (no checkpoints: no state)."""
    from benchmarks import bench_prefix

    out = tmp_path / "swa.json"
    argv = ["--tiny", "--device", "cpu", "--dtype", "float32", "--models", "swa"]
    assert bench_prefix.main([*argv, "--workloads", "system,chat", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"args", "phase_seconds", "swa"} and set(res["swa"]) == {"system", "chat"}
    config = bench_prefix.swa_config(tiny=True, narrow=False)
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    for workload in ("system", "chat"):
        row = res["swa"][workload]
        assert row["cache"]["hit_rate"] > 0.2, (workload, row["cache"])
        assert row["token_agreement"] == {"tokens": 1.0, "first_tokens": 1.0}
        assert row["cache"]["checkpoint_takes"] == row["cache"]["checkpoints_held_at_end"] == 0
        _check_breakdown("swa", workload, row)


# --tiny: 6 requests of a 64-token system prompt + 8; 3 conversations x 3 turns of
# 8-token messages and 8-token answers (bench_prefix.main)
TINY_PROMPTS = {"system": [6 * (64 + 8)], "chat": [3 * (8 + 16 * t) for t in range(3)]}
# new prefixes: the system prompt once and each suffix; each chat turn's message,
# and after the first turn the previous answer's last token (sampled, never fed)
TINY_FRESH = {"system": 64 + 6 * 8, "chat": 3 * 8 + 2 * 3 * (8 + 1)}


def _check_breakdown(model: str, workload: str, row: dict) -> None:
    off, on = row["no_cache"], row["cache"]
    for run in (off, on):
        assert run["preemptions"] == 0, run  # (recompute would add prefill tokens)
        assert run["fresh_prefill_tokens"] == TINY_FRESH[workload]
        assert run["recomputed_tokens"] == run["prefill_tokens"] - TINY_FRESH[workload]
        assert run["decode_steps"] + run["prefill_steps"] > 0 and run["mean_decode_batch"] >= 1
    assert off["prefill_tokens"] == sum(TINY_PROMPTS[workload])
    assert on["prefill_tokens"] == off["prefill_tokens"] - on["prefill_tokens_saved"]
    assert off["checkpoint_copies"] == 0 and off["checkpoint_copy_seconds"] == 0
    copies = on["checkpoint_takes"] + on["checkpoint_restores"]  # device only: no host tier
    # copy launches: a step's takes share one (``alloc.prefix.batched``), a restore's
    # requests one; so at most one per take or restore, at least one when any happened
    assert (copies > 0) == (on["checkpoint_copies"] > 0) and on["checkpoint_copies"] <= copies
    assert (copies > 0) == (model == "hybrid") and on["checkpoint_copy_seconds"] >= 0
    assert (on["checkpoint_pool_fraction_at_end"] > 0) == (on["checkpoints_held_at_end"] > 0)
    # a take is a slot copy or (issue 41) written by the prefill chunk that ended there
    taken = on["checkpoint_takes_copied"] + on["checkpoint_takes_written"]
    assert taken == on["checkpoint_takes"], on
    assert (on["checkpoint_takes_written"] > 0) == (model == "hybrid"), on
    for run in (off, on):  # the host split of a decode step: parts of the step's wall time
        ms, steps = run["decode_step_host_ms"], max(run["decode_steps"], 1)
        whole = ms["schedule"] + ms["launch"] + ms["settle"] + ms["complete"]
        assert 0 < whole <= 1e3 * run["decode_seconds"] / steps * 1.001, run
        assert ms["after_step"] <= ms["complete"] and run["page_moves"] >= 0
        assert run["forward_waits"] >= 0
        assert run["upload_ring_slots"] == run["upload_ring_waits"] == 0  # CPU: no ring
        assert run["decode_step_table_writes"] >= 1  # a decode step writes its tables
