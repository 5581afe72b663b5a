"""``benchmarks/bench_moe.py --fp8 --sweep``'s install step on CPU (no kernel runs): from
timed rows to the ``fp8.TABLE`` entries and the W8A8 threshold the lead pastes.

Oracle: rows whose winners are set by hand; the expected table and threshold are read
off them (the fastest checked row per (T, variant); the smallest swept T from which
W8A8 beat 16-bit activations at every larger swept T), and the printed lines must be
Python that rebuilds those entries."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_moe
from unikv.kernels.moe import fp8, fused

BATCHES = (1, 16, 64, 256, 2048)


def _row(t: int, variant: str, cfg: tuple, us: float) -> dict:
    return {"B": t, "variant": variant, "candidate": list(fused.Config(*cfg)), "us": us,
            "vs_bf16": 1.0, "of_roofline": 0.5}  # fmt: skip


def _rows(w8a8_wins: dict[int, bool]) -> list:
    rows = []
    for t in BATCHES:
        a16 = 100.0
        w8 = 80.0 if w8a8_wins[t] else 120.0
        failed = _row(t, "w8a8", (64, 64, 128, 1, 4, 3), 0.0)
        del failed["us"]  # a candidate that failed its check: no time, never picked
        rows += [_row(t, "a16", (16, 64, 128, 1, 4, 3), a16 + 5),  # a slower candidate
                 _row(t, "a16", (16, 32, 128, 1, 4, 4), a16),
                 _row(t, "w8a8", (128, 64, 128, 1, 8, 3), w8), failed]  # fmt: skip
    return rows


@pytest.mark.parametrize(
    "wins, threshold",
    [({1: False, 16: True, 64: False, 256: True, 2048: True}, 256),
     ({1: True, 16: True, 64: True, 256: True, 2048: True}, 1),
     ({1: True, 16: True, 64: True, 256: True, 2048: False}, None)],
)  # fmt: skip
def test_install_picks_the_fastest_per_variant_and_the_w8a8_threshold(wins, threshold, monkeypatch):
    lines, table, got = bench_moe.fp8_install(_rows(wins), BATCHES)
    assert got == threshold
    assert len(table) == 2 * len(BATCHES)
    for t in BATCHES:
        assert table[fused.bucket(t), False] == list(fused.Config(16, 32, 128, 1, 4, 4))
        assert table[fused.bucket(t), True] == list(fused.Config(128, 64, 128, 1, 8, 3))
    # the printed lines are Python that rebuilds the table and the threshold
    scope = {"fp8": type("M", (), {"TABLE": {}}), "Config": fused.Config}
    for line in lines:
        assert line.startswith("INSTALL ")
        exec(line.removeprefix("INSTALL ").split("  #")[0], scope)  # noqa: S102
    assert scope["fp8"].TABLE == {k: fused.Config(*v) for k, v in table.items()}
    want = (1 << 62) if threshold is None else threshold
    assert scope["fp8"].W8A8_MIN_TOKENS == want
    # installed, the rows' rule takes W8A8 at exactly the swept T from the threshold up
    monkeypatch.setattr(fp8, "W8A8_MIN_TOKENS", want)
    assert [fp8.w8a8_rows(t) for t in BATCHES] == [t >= want for t in BATCHES]


def test_the_summary_names_the_faster_variant_against_bf16():
    rows = [{"B": 2048, "variant": "bf16", "candidate": "plan", "us": 1200.0}]
    rows += [{**_row(2048, "a16", (128, 128, 64, 1, 8, 3), 1600.0), "vs_bf16": 0.75},
             {**_row(2048, "w8a8", (128, 64, 128, 1, 8, 3), 800.0), "vs_bf16": 1.5,
              "of_roofline": 0.093, "of_matmul_rate": 0.61, "rms_vs_bf16_kernel": 0.04}]  # fmt: skip
    line = bench_moe.fp8_summary(2048, rows)
    assert line.startswith(
        "T 2048: FP8 best w8a8 Config(128, 64, 128, 1, 8, 3, False, False) 800.0"
    )
    assert "1.50x bf16 (1200.0 us)" in line and "9.3 % of the FP8 roofline" in line
    assert "61 % of its matmul rate" in line and "16-bit act 1600.0 us" in line


def _exec_install(lines: list) -> dict:
    """The INSTALL lines run as Python -> {"TABLE": ..., "W8A8_MIN_TOKENS": ...}."""
    scope = {"fp8": type("M", (), {"TABLE": {}}), "Config": fused.Config}
    for line in lines:
        if line.startswith("INSTALL "):
            exec(line.removeprefix("INSTALL ").split("  #")[0], scope)  # noqa: S102
    return {"TABLE": scope["fp8"].TABLE, "W8A8_MIN_TOKENS": scope["fp8"].W8A8_MIN_TOKENS}


def test_an_untimed_t_keeps_its_entry_and_is_neither_a_win_nor_a_loss():
    """W8A8 wins at T 16-256 and loses at 1; at T 2048 every W8A8 candidate failed its
    check (no time). The threshold is 16 (2048 skipped, not a loss that would leave no
    threshold), the (2048, True) entry is the current table's, re-installed with a "kept"
    note, and an UNTIMED line names T 2048; with no current entry there is none to keep."""
    rows = [r for r in _rows({1: False, 16: True, 64: True, 256: True, 2048: True})
            if not (r["B"] == 2048 and r["variant"] == "w8a8")]  # fmt: skip
    rows.append({"B": 2048, "variant": "w8a8", "candidate": [128, 64, 128, 1, 8, 3],
                 "error": "output differs from its reference; not timed"})  # fmt: skip
    current = {
        (2048, True): fused.Config(64, 64, 128, 1, 4, 3),
        (1, False): fused.Config(*[16] * 2, 64, 1, 4, 3),
    }
    lines, table, threshold = bench_moe.fp8_install(rows, BATCHES, current)
    assert threshold == 16
    assert table[2048, True] == list(current[2048, True])
    assert table[2048, False] == list(fused.Config(16, 32, 128, 1, 4, 4))  # timed: its pick
    kept = [line for line in lines if "# kept" in line]
    assert len(kept) == 1 and "(2048, True)" in kept[0] and "T 2048" in kept[0]
    untimed = [line for line in lines if line.startswith("UNTIMED")]
    assert len(untimed) == 1 and "[2048]" in untimed[0]
    installed = _exec_install(lines)
    assert installed["TABLE"] == {k: fused.Config(*v) for k, v in table.items()}
    assert installed["W8A8_MIN_TOKENS"] == 16
    lines, table, threshold = bench_moe.fp8_install(rows, BATCHES, {})
    assert (2048, True) not in table and threshold == 16
    assert not [line for line in lines if "# kept" in line]


def test_the_sweep_checks_w8a8_against_the_exact_description():
    """``w8a8_check``: the exact result rounded to bf16 passes (recording its rms, worst
    row and the max error against the reference); one row off by 50 % fails on its row."""
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(64, 256, generator=g, dtype=torch.float64)
    row: dict = {}
    assert bench_moe.w8a8_check(exact.bfloat16(), exact, exact.bfloat16(), row)
    assert 0 < row["rms_vs_exact"] <= 2.0**-7 / 12**0.5 and row["rel_err_vs_reference"] == 0
    bad = exact.clone()
    bad[5] *= 1.5
    assert not bench_moe.w8a8_check(bad.bfloat16(), exact, exact.bfloat16(), row)
    assert row["worst_row_vs_exact"] > 0.4
