"""``benchmarks/bench_elastic.py --device cpu``: the same script the GPU run uses
(issue 44's five targets in one run), on the emulated backing at small sizes.
The bench checks every moved page byte for byte itself (it raises otherwise);
here the figures are checked against the workload's own arithmetic: the pages
a 16 MiB request holds (1 MiB pages, bench_elastic's MHA spec), the hot/idle
experiment's tokens equal across the two splits, and the verdict of each
target against its figure."""

from __future__ import annotations

import json

import pytest
from engine_fixtures import one_thread  # noqa: F401  (a fixture)

MIB = 1 << 20


@pytest.mark.usefixtures("one_thread")
def test_bench_elastic_cpu_measures_every_target(tmp_path, capsys):
    from benchmarks import bench_elastic

    out = tmp_path / "elastic.json"
    assert bench_elastic.main(["--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    page_bytes = 16 * 8 * 128 * 2 * 2 * 16  # layers x kv heads x dim x (K, V) x bf16 x tokens
    assert page_bytes == MIB
    moves = res["moves"]
    assert moves["moved_pages"] == 16 * MIB // page_bytes and moves["moved_bytes"] == 16 * MIB
    assert moves["copy_calls"] >= 1 and 0 < moves["copy_ms"] <= moves["shrink_ms"]
    assert moves["ceiling"]["bytes"] == moves["moved_bytes"]
    gs = res["grow_shrink"]
    assert gs["step_bytes"] == 16 * MIB and len(gs["grow_ms_all"]) == len(gs["shrink_ms_all"]) == 3
    hot = res["hot_idle"]
    assert hot["tokens_equal"], "the hot model's tokens differ between the splits"
    assert hot["shared"]["steps"] < hot["fixed_half"]["steps"], "the same work in fewer steps"
    rows = res["targets"]
    assert set(rows) == {"grow", "shrink", "moves_bandwidth", "hot_idle_concurrency",
                         "handed_back", "after_capture"}  # fmt: skip
    assert rows["after_capture"] == rows["handed_back"] == {"skipped": "needs CUDA"}
    for name in ("grow", "shrink", "moves_bandwidth", "hot_idle_concurrency"):
        assert rows[name]["met"] == (rows[name]["ratio_to_target"] >= 1), name
    assert rows["grow"]["ratio_to_target"] == pytest.approx(10 / gs["grow_ms"])
    ratio = hot["shared"]["mean_concurrency"] / hot["fixed_half"]["mean_concurrency"]
    assert rows["hot_idle_concurrency"]["figure"] == pytest.approx(ratio)
    printed = capsys.readouterr().out
    assert all(line in printed for line in res["summary"]) and len(res["summary"]) == 6


def test_a_failed_row_is_recorded_and_the_others_still_judged():
    """One GPU run measures every target: a row that raises leaves an ``error`` in
    its place (and in the summary) instead of ending the run."""
    import torch

    from benchmarks import bench_elastic

    payload: dict = {}
    bench_elastic._row(payload, "moves", lambda: 1 // 0)
    bench_elastic._row(payload, "hot_idle", lambda: {"concurrency_ratio": 3.0})
    assert payload["moves"] == {"error": "ZeroDivisionError: integer division or modulo by zero"}
    rows = bench_elastic.targets(payload, torch.device("cpu"))
    assert rows["hot_idle_concurrency"]["met"] and rows["hot_idle_concurrency"]["figure"] == 3.0
    assert "error" in rows["moves_bandwidth"] and "error" in rows["grow"]
    lines = bench_elastic.summary(rows)
    assert any(line.startswith("moves_bandwidth: ERROR") for line in lines)


def test_the_cuda_rows_judge_their_figures():
    """The rows only a GPU run fills (handed back, after capture), judged from a
    payload of known figures: within a chunk is met, a chunk and a byte is not;
    more pool bytes than the estimate is met, two LLMs that started from
    different free memory are no comparison."""
    import torch

    from benchmarks import bench_elastic

    chunk = 2 * MIB
    after = {"estimate": {"pool_bytes": 70 << 30, "free_before_bytes": 79 << 30},
             "after_capture": {"pool_bytes": 77 << 30, "free_before_bytes": 79 << 30},
             "ratio": 77 / 70, "comparable": True}  # fmt: skip
    payload = {
        "grow_shrink": {"grow_ms": 5.0, "shrink_ms": 20.0, "chunk_bytes": chunk,
                        "driver_error_bytes": 4096},
        "moves": {"fraction_of_ceiling": 0.9, "handed_back_bytes": 1 << 30,
                  "released_bytes": (1 << 30) + chunk + 1},
        "hot_idle": {"concurrency_ratio": 1.4},
        "after_capture": after,
    }  # fmt: skip
    rows = bench_elastic.targets(payload, torch.device("cuda"))
    assert [rows[n]["met"] for n in ("grow", "shrink", "moves_bandwidth")] == [True, False, True]
    assert not rows["hot_idle_concurrency"]["met"]
    assert rows["handed_back"]["figure"] == chunk + 1 and not rows["handed_back"]["met"]
    payload["moves"]["released_bytes"] = (1 << 30) + chunk
    assert bench_elastic.targets(payload, torch.device("cuda"))["handed_back"]["met"]
    assert rows["after_capture"]["met"] and rows["after_capture"]["bytes"] == [70 << 30, 77 << 30]
    after["comparable"] = False
    row = bench_elastic.targets(payload, torch.device("cuda"))["after_capture"]
    assert "different free memory" in row["error"]
    assert len(bench_elastic.summary(rows)) == 6
