"""CI smoke test of bench_prefix_sim's policy comparison (issue 41, item 5) at tiny
sizes, with hand-derived expectations of the two policies' rules."""

from __future__ import annotations

import numpy as np
import pytest

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


@pytest.mark.parametrize("carried", [True, False])
def test_unikv_keeps_the_turn_end_of_a_conversation_that_hit(carried):
    rng = np.random.default_rng(2)
    ids = lambda n: rng.integers(1, 1 << 20, n).tolist()
    x1, ox1, y, oy = ids(40), ids(8), ids(40), ids(8)
    x2, ox2 = x1 + ox1 + ids(20), ids(12)
    unikv = sim.policies(HYBRID)[0]
    cache = sim.PolicyCache(HYBRID, unikv, 1 << 40)
    cache.serve(x1, ox1)  # turn ends at 48 tokens (3 pages), its prompt end at 32
    cache.serve(x2, ox2)  # hits turn 1's end (48), ends its turn at 80 (5 pages)
    cache.serve(y, oy)  # another conversation: turn end 48, no hit
    assert cache.stats["hit"] == 48
    leaves = [k for kind, k in cache.queue if kind == "attn" and not cache.blocks[k].children]
    x_leaf, y_leaf = cache.keys(x2 + ox2)[4], cache.keys(y + oy)[2]
    assert leaves == [x_leaf, y_leaf], "by hand: turn 2 released before Y"
    assert cache.blocks[x_leaf].carried and not cache.blocks[y_leaf].carried
    cache.blocks[x_leaf].carried = carried  # control: the same tree, the mark cleared
    # the three demoted prompt-end states go first (32 of X and Y, 64 of turn 2); then
    # one leaf (16 tokens and a state) is enough
    cache.budget = cache.cached - 3 * HYBRID.state - 1
    cache.make_room(0)
    x3 = x2 + ox2 + ids(20)
    if carried:  # Y's leaf (and its turn end) goes, though turn 2's is older
        assert x_leaf in cache.blocks and y_leaf not in cache.blocks
        assert cache.lookup(x3)[0] == 80 and cache.lookup(y + oy + ids(9))[0] == 0
    else:  # plain LRU: turn 2's leaf goes; X falls back to turn 1's end
        assert x_leaf not in cache.blocks and y_leaf in cache.blocks
        assert cache.lookup(x3)[0] == 48 and cache.lookup(y + oy + ids(9))[0] == 48
