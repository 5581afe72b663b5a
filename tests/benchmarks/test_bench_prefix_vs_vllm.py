"""CI smoke test of bench_prefix_sim's policy comparison (issue 41, item 5) at tiny
sizes, with hand-derived expectations of the two policies' rules."""

from __future__ import annotations

import numpy as np

from benchmarks import bench_prefix_sim as sim

HYBRID = sim.Shape("hybrid", full=1000, swa=0, window=0, state=100_000)  # 100 tokens/state
SWA = sim.Shape("swa", full=1000, swa=1000, window=40, state=0)


def test_align_raises_the_block_to_one_state():
    names = {p.name: p for p in sim.policies(HYBRID)}
    assert names["vllm-align"].block == 112  # 100 tokens of attention, a multiple of 16
    assert names["vllm-align"].block * HYBRID.full >= HYBRID.state
    assert names["unikv"].block == sim.PAGE and [p.name for p in sim.policies(SWA)] == [
        "unikv", "vllm"
    ]  # fmt: skip


def test_a_repeat_hits_its_whole_pages_and_align_only_its_blocks():
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 1 << 20, 200).tolist()
    hits = {}
    for policy in sim.policies(HYBRID):
        cache = sim.PolicyCache(HYBRID, policy, 1 << 40)
        cache.serve(prompt, [1, 2, 3])
        cache.serve(prompt, [1, 2, 3])
        hits[policy.name] = cache.stats["hit"]
    # unikv: the prompt's last whole page before its last token, 192 of 199
    # align: one 112-token block; with the shared-prefix checkpoint the block is a
    # multiple of its 64-token unit, 128 (the junction needs a divergence: none here)
    assert hits == {"unikv": 192, "vllm-align": 112, "vllm-align+spc": 128}


def test_a_window_hit_needs_its_suffix_and_unikv_never_hits_less():
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 1 << 20, 161).tolist()
    other = rng.integers(1, 1 << 20, 161).tolist()
    per_page = sim.PAGE * (SWA.full + SWA.swa)
    for pages in range(12, 22):  # from a pool where the repeat misses to a roomy one
        hits = {}
        for policy in sim.policies(SWA):
            cache = sim.PolicyCache(SWA, policy, pages * per_page)
            for tokens in (prompt, other, prompt):
                cache.serve(tokens, [5])
            hits[policy.name] = cache.stats["hit"]
        assert hits["unikv"] >= hits["vllm"], (pages, hits)
        if pages >= 16:  # room for both: the repeat hits its 10 whole pages
            assert hits["unikv"] == 160, (pages, hits)
        if pages <= 13:  # the second request evicts a node of the first chain's end
            assert hits["unikv"] == 0, (pages, hits)


def test_compare_all_runs_at_tiny_sizes_and_reports_ratios():
    out = sim.compare_all(scale=0.05, demands=(1.0, 2.0))
    assert {r["model"] for r in out["runs"]} == set(sim.SIM_MODELS)
    assert {r["workload"] for r in out["runs"]} == {"chat", "system", "fewshot", "agentic"}
    for run in out["runs"]:
        for res in run["policies"].values():
            assert 0.0 <= res["hit_rate"] <= 1.0 and res["recomputed_tokens"] >= 0
        assert run["recomputed_ratio"] >= 0
