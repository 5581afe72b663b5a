"""``benchmarks/bench_moe.py --fp8 --diagnose T`` on CPU (the interpreter) at a small
shape, so the GPU run the lead makes at T 2048 does not fail on its own code.

Oracle: on CPU both the kernel (fp32 dots) and the fp32 reference sit at the output's
bf16 rounding from the exact description (``test_kernels_moe_w8a8_exact.py``): every
distance reported is within the bounds, the launcher's x codes are the torch
quantiser's, and the kernel's activation (read from its second pass) has the exact one's
codes but for a rare rounding-boundary case."""

from __future__ import annotations

import json

from benchmarks import bench_moe
from unikv.kernels.linear import fp8_gemm_ref
from unikv.kernels.moe import fused


def test_the_diagnostic_reports_both_sides_against_the_exact_description(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(bench_moe, "FP8_DEVICE", "cpu")
    monkeypatch.setattr(
        bench_moe, "FP8_SHAPE", {"experts": 4, "top_k": 2, "hidden": 256, "intermediate": 256}
    )
    monkeypatch.setenv("OUT", str(tmp_path))
    real = fused.quantize_act
    bench_moe.run_fp8_diagnose(24)
    assert fused.quantize_act is real  # the spy is gone
    report = json.loads((tmp_path / "moe_fp8_diagnose.json").read_text())
    printed = capsys.readouterr().out
    for side in ("reference", "kernel_plan", "kernel_second_pass"):
        assert f"{side}: " in printed
        assert report[side]["rms_vs_exact"] <= 2.0**-7 / 12**0.5
        assert report[side]["worst_row_vs_exact"] <= fp8_gemm_ref.W8A8_ROW_BOUND
    assert report["x_codes_vs_torch"] == {"codes": 0.0, "scales": 0.0}
    for side in ("reference", "kernel_second_pass"):
        assert report[side]["act_vs_exact"]["codes"] <= 1e-2
