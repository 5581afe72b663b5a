"""``bench_allocator.py --vs BASE``: the same-run A/B of the allocator's host time
(this tree's bench and BASE's, in turn, one process each). The ratios are checked
against hand-derived medians of known rounds, and end to end against a stand-in base
checkout whose bench reports a fixed time per part, so each ratio is this side's
median over that constant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import bench_allocator

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("alloc_decode", "free_out_of_window", "block_table", "translate")
BASE_US = 1000.0

STAND_IN = f"""
import argparse, json
p = argparse.ArgumentParser()
p.add_argument("--batches"); p.add_argument("--page-sizes"); p.add_argument("--out")
args, _ = p.parse_known_args()
us = dict.fromkeys({PARTS!r}, {BASE_US})
rows = [
    {{"batch": int(b), "page_size": int(ps), "us": us, "us_per_step": 4 * {BASE_US},
      "decode_step": {{"us_per_step": {BASE_US}}}}}
    for ps in args.page_sizes.split(",") for b in args.batches.split(",")
]
open(args.out, "w").write(json.dumps({{"rows": rows}}))
"""


def _row(batch: int, scale: float) -> dict:
    us = {p: scale * (i + 1) for i, p in enumerate(PARTS)}  # 1, 2, 3, 4 x scale
    return {
        "batch": batch,
        "page_size": 16,
        "us": us,
        "us_per_step": sum(us.values()),
        "decode_step": {"us_per_step": 5 * scale},
    }


def test_ratios_are_the_median_of_the_per_round_ratios():
    # three rounds: this side at 2x, 1.5x and 1.2x the base's times
    this = [[_row(1, 2.0)], [_row(1, 1.5)], [_row(1, 1.2)]]
    base = [[_row(1, 1.0)], [_row(1, 1.0)], [_row(1, 1.0)]]
    (row,) = bench_allocator.ab_ratios(this, base)
    assert (row["batch"], row["page_size"]) == (1, 16)
    assert set(row["parts"]) == {*PARTS, "separate", "decode_step"}
    for part, p in row["parts"].items():
        assert p["ratio"] == 1.5 and p["ratio_range"] == [1.2, 2.0], part
    assert row["parts"]["translate"]["us"] == 6.0  # median of 8, 6, 4.8
    assert row["parts"]["separate"]["base_us"] == 10.0


def test_vs_runs_both_trees_in_turn_and_saves_the_ratios(tmp_path):
    base = tmp_path / "base"
    (base / "benchmarks").mkdir(parents=True)
    (base / "benchmarks" / "bench_allocator.py").write_text(STAND_IN)
    out = tmp_path / "ab.json"
    cmd = [sys.executable, "benchmarks/bench_allocator.py", "--device", "cpu", "--vs", str(base)]
    cmd += ["--rounds", "2", "--batches", "1,4", "--page-sizes", "16", "--steps", "3"]
    proc = subprocess.run(
        [*cmd, "--out", str(out)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["rounds"] == 2 and data["vs"] == str(base.resolve())
    assert [(r["batch"], r["page_size"]) for r in data["rows"]] == [(1, 16), (4, 16)]
    for row in data["rows"]:
        for part, p in row["parts"].items():
            assert p["base_us"] == BASE_US * (4 if part == "separate" else 1), part
            assert p["us"] > 0  # a constant base: the median ratio is the median time over it
            assert abs(p["ratio"] - p["us"] / p["base_us"]) < 1e-9 * p["ratio"], part


def test_vs_without_a_bench_is_refused(tmp_path):
    cmd = [
        sys.executable,
        "benchmarks/bench_allocator.py",
        "--device",
        "cpu",
        "--vs",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"--vs {tmp_path}" in proc.stderr and "benchmarks/bench_allocator.py" in proc.stderr
