"""The fused MoE's FP8 launches fit sm_90's shared memory: every 16-bit table entry,
with the release checkpoints' 128 x 128 scale blocks (scale mode 1) and an odd block
(16 x 24: mode 2), both kernels compiled for sm_90 by Triton's own compiler on this
machine (``moe_smem_probe.py``; no GPU needed). An H100 allows 227 KB (232,448 bytes)
of opt-in shared memory a block, the hardware limit its driver reported when mode 2's
three-stage launch failed in the GPU suite (``OutOfResources``: 339,968 bytes).

The probe is shown to see that failure: the 8-token entry's launch as the table gives
it (``--raw``: three stages) needs more than the limit in mode 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SM90_SHARED = 232448
PROBE = Path(__file__).with_name("moe_smem_probe.py")
ROOT = Path(__file__).resolve().parents[2]


def probe(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(PROBE), *args], env=env, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip(f"Triton's ptxas is missing here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_every_fp8_launch_fits_sm90_shared_memory():
    rows = probe()
    assert len(rows) == 28, rows  # 7 table entries x 2 scale blocks x 2 kernels
    assert {r["mode"] for r in rows} == {1, 2}
    over = [r for r in rows if r["shared"] > SM90_SHARED]
    assert not over, over


def test_the_probe_sees_the_table_launch_that_failed_on_the_gpu():
    rows = probe("--raw", "--bucket=8", "--blocks=16x24")
    assert [r["mode"] for r in rows] == [2, 2] and rows[0]["stages"] == 3
    assert max(r["shared"] for r in rows) > SM90_SHARED, rows
