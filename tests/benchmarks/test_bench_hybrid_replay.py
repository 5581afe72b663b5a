"""``benchmarks/bench_hybrid.py --replay``: the schedule without forwards.

Checked against independent descriptions: the engine's own run of the tiny model
(the per-step running counts, step for step); the pages and slots the allocator
holds after every step against a count from the requests' lengths; every admission
answer of the capacity oracle against byte arithmetic on the live counts (no
reserve, watermark or growth headroom held back); the state slot's bytes against
the HF config's Mamba-2 shapes and the H200 run's recorded slot size.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import bench_hybrid as bh
from unikv.engine.scheduler import Scheduler
from unikv.placement import Grow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny NemotronH model saved to a folder, its workload and its budget."""
    path = tmp_path_factory.mktemp("nemotron_h")
    args = bh.parse_args(["--quick", "--device", "cpu", "--models", "nemotron_h"])
    bh.build_model("nemotron_h", path, "cpu", args.dtype, True)
    prompts, max_tokens = bh.make_workload(args, bh.hf_config("nemotron_h", True).vocab_size)
    max_len = max(len(p) + o for p, o in zip(prompts, max_tokens)) + 1
    budget, _ = bh.pool_budget(path, prompts, max_tokens, max_len, bh.SGLANG_SPLIT, args)
    return path, args, prompts, max_tokens, max_len, budget


def test_replay_matches_the_engine_step_for_step(tiny):
    from unikv.engine import SamplingParams

    path, args, prompts, max_tokens, max_len, budget = tiny
    llm = bh.make_llm(path, None, budget, max_len, args)
    running: list[int] = []
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in max_tokens]
    llm.generate(prompts, params, on_step=lambda e, b, lg: running.append(len(e.scheduler.running)))
    replay = bh.replay_scheme(path, budget, None, prompts, max_tokens, max_len, args)
    assert replay["running"] == running
    assert replay["max_concurrent"] > 1  # requests share the pool at some step


def _naive_room(alloc) -> int:
    """KV pages a newly admitted request could take beside its one state slot, by
    byte arithmetic on the live counts (-1: no slot left). With a static split, the
    full range less its live pages; else the state slots stack up from the sink and
    the KV pages down from the top, and the two must not cross."""
    pool = alloc.pool
    subs = pool.subpools
    live = {n: alloc.view.live_pages(n) for n in subs}
    if pool.band_limits is not None:
        (lo, hi), (mlo, mhi) = pool.band_limits["full"], pool.band_limits["mamba"]
        return max(hi - lo - live["full"], -1) if live["mamba"] + 1 <= mhi - mlo else -1
    (up,) = [s for s in subs.values() if s.grow == Grow.UP]
    (down,) = [s for s in subs.values() if s.grow == Grow.DOWN]
    if up.first_page + live[up.name] + 1 > up.num_pages:
        return -1
    floor = (up.first_page + live[up.name] + 1) * up.page_bytes
    return max((down.num_pages * down.page_bytes - floor) // down.page_bytes - live[down.name], -1)


@pytest.mark.parametrize("split", [None, bh.SGLANG_SPLIT], ids=["unified", "static"])
def test_replay_holds_what_its_requests_need(tiny, split, monkeypatch):
    path, args, prompts, max_tokens, max_len, budget = tiny
    answers = []
    real = Scheduler.fits
    ps = args.page_size

    def spy(self, num_tokens, chunk, r=None):
        """Its answer, and the most tokens it would admit now (a bisection) against
        the naive room in pages."""
        lo, hi = 0, 1 << 20  # real(lo) holds unless no slot is left
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if real(self, mid, chunk, r) else (lo, mid)
        most = lo // ps if real(self, lo, chunk, r) else -1
        answers.append((most, _naive_room(self.alloc)))
        return real(self, num_tokens, chunk, r)

    monkeypatch.setattr(Scheduler, "fits", spy)

    def check(sched, alloc):
        pages = sum(-(-r.num_cached // ps) for r in sched.running)
        assert alloc.view.live_pages("full") == pages
        assert alloc.view.live_pages("mamba") == len(sched.running)

    replay = bh.replay_scheme(path, budget, split, prompts, max_tokens, max_len, args, check)
    assert len(answers) > len(prompts)  # some admission was refused, and asked again
    assert [a for a, _ in answers] == [n for _, n in answers]  # no reserve held back
    assert replay["steps"] == len(replay["running"])


def test_slot_accounting_sums_the_config_shapes(tmp_path):
    """The real NemotronH shapes (bf16): per Mamba layer a conv window of
    (heads x head_dim + 2 x groups x state) channels x conv_kernel columns and an
    fp32 SSM state of heads x head_dim x state."""
    args = bh.parse_args(["--replay", "--device", "cpu", "--models", "nemotron_h"])
    assert args.dtype == torch.bfloat16 and not args.tiny
    cfg = bh.hf_config("nemotron_h", False)
    layers = cfg.hybrid_override_pattern.count("M")
    channels = cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.n_groups * cfg.ssm_state_size
    conv = layers * channels * cfg.conv_kernel * 2
    ssm = layers * cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size * 4
    cfg.save_pretrained(tmp_path)
    acc = bh.slot_accounting(tmp_path, [[1] * 17, [1] * 32], [3, 16], args)
    assert acc["state_slot_parts"] == {"conv0": conv, "temporal": ssm, "alignment": 0}
    h200 = json.loads((ROOT / "benchmarks/results/hybrid_h200.json").read_text())
    (nemo,) = [m for m in h200["models"] if m["model"] == "nemotron_h"]
    assert acc["state_slot_bytes"] == nemo["workload"]["state_slot_bytes"] == conv + ssm
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # one attention layer, K and V
    assert acc["kv_bytes_per_token"] == kv
    assert acc["mean_page_rounding_bytes"] == ((32 - 20) + (48 - 48)) / 2 * kv


def test_replay_cli_summary(tmp_path):
    """``--replay --quick``: the summary's means and ratios against the per-step
    running counts it saved, the sink against the state slot's bytes."""
    out = tmp_path / "replay.json"
    bh.main(["--replay", "--quick", "--models", "nemotron_h", "--out", str(out)])
    (entry,) = json.loads(out.read_text())["models"]
    runs = entry["schemes"]
    assert set(runs) == {"unified", "static", "unified_sink_reclaimed"}
    means = {k: sum(r["running"]) / len(r["running"]) for k, r in runs.items()}
    assert entry["mean_concurrent_ratio"] == pytest.approx(means["unified"] / means["static"])
    slot = entry["accounting"]["state_slot_bytes"]
    assert runs["unified"]["sink_bytes"] == slot == entry["workload"]["state_slot_bytes"]
    grown = runs["unified_sink_reclaimed"]["usable_bytes"] - runs["unified"]["usable_bytes"]
    page = entry["workload"]["full_entry_bytes"] * 16
    assert slot - page < grown <= slot + page  # the sink's bytes, to a page of the top


def test_step_split_separates_the_prefill_steps_both_schemes_share():
    """The throughput ratio's breakdown: written-out step logs (unified: decode steps of
    2 s and 1 s, one prefill step of 4 s; static: three decode steps of 2 s, the same
    4 s prefill) give a decode-only ratio of 6 / 3, a prefill share of 4 / 7 of
    unified's time, and a summary line that says so."""

    def scheme(kinds, seconds, running):
        log = {"is_decode": kinds, "seconds": seconds, "batch": running, "running": running}
        return {
            "steps_log": log, "seconds": sum(seconds), "mean_concurrent": sum(running) / 3,
            "max_concurrent": max(running), "output_tokens_per_s": 1.0 / sum(seconds),
            "preemptions": 0,
        }  # fmt: skip

    entry = {
        "model": "m",
        "schemes": {
            "unified": scheme([True, False, True], [2.0, 4.0, 1.0], [4, 4, 4]),
            "static": scheme([True, True, False, True], [2.0, 2.0, 4.0, 2.0], [2, 2, 2, 2]),
        },
    }
    tokens = {"unified": [[1, 2]], "static": [[1, 2]]}
    c = bh.compare_schemes(entry, tokens, {"unified": {(0, 0): 1.0}, "static": {}})
    assert c["step_split"]["unified"] == {
        "decode_s": 3.0, "prefill_step_s": 4.0, "decode_steps": 2, "prefill_steps": 1,
    }  # fmt: skip
    assert c["step_split"]["static"]["decode_s"] == 6.0
    assert c["decode_seconds_ratio"] == pytest.approx(2.0)
    assert c["prefill_share_unified"] == pytest.approx(4 / 7)
    entry["comparison"] = c
    text = bh.summary({"models": [entry]})
    assert "| m | decode steps alone | | | 2.00x | prefill steps 57 % of unified's time" in text
