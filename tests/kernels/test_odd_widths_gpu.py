"""Odd cache widths on a CUDA GPU never crash (issue 38, item 6; ``pytest -m gpu``).

The models of ``tests/odd_width_cases.py``: DeepSeek-V3 latent rows of 26 and 30
elements (104 / 120 bytes in fp32, 52 / 60 in bf16: no 16-byte multiple) and Llama
head dims 6 and 40, each at page sizes 1, 4 and 16, fp32 and bf16, CUDA graphs on,
greedy against transformers (eager attention) on the same weights. Before the fix the
MLA rows crashed the CUDA context at page size >= 2 (``misaligned address`` in
``mla._mla_kernel``, compute-sanitizer: 16-byte loads at 8-byte-aligned rows).

Each case runs in its own subprocess (the four side by side: the tiny models leave the
GPU mostly idle), so a crash fails that case's rows with the process's last output.

- fp32: the engine's tokens are transformers'.
- bf16: the first token of at least 3 of the 4 prompts is transformers-bf16's (a bf16
  near-tie may flip one; a misread row gives garbage from the first token).
- head dim 6 runs its attention on the torch references (``kernels/runtime/widths.py``: the
  Triton tiles need next_pow2(head_dim) >= 16); every other case runs Triton throughout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from odd_width_cases import CASES, NEW_TOKENS, PROMPT_LENS

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parents[1]  # tests/
PAGE_SIZES = (1, 4, 16)
DTYPES = ("fp32", "bf16")
TIMEOUT_S = int(os.environ.get("UNIKV_ODD_WIDTHS_TIMEOUT", "420"))


@pytest.fixture(scope="module")
def runs():
    """(case, dtype, page size) -> RESULT row; case -> the process's last output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(HERE / "odd_width_cases.py")]
    args = ["--page-size", *map(str, PAGE_SIZES), "--dtype", *DTYPES]
    procs = {
        case: subprocess.Popen(
            [*cmd, case, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for case in CASES
    }
    rows, tails = {}, {}
    for case, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        tails[case] = f"rc {proc.returncode}:\n" + "\n".join(out.splitlines()[-25:])
        for line in out.splitlines():
            if line.startswith("RESULT "):
                row = json.loads(line[len("RESULT ") :])
                rows[row["case"], row["dtype"], row["page_size"]] = row
    return rows, tails


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_odd_widths_run_with_graphs_and_match_transformers(runs, case, dtype, page_size):
    rows, tails = runs
    row = rows.get((case, dtype, page_size))
    assert row is not None, f"{case} {dtype} page {page_size} never finished: {tails[case]}"
    assert row["graphs"], "CUDA graphs were not captured"
    engine, hf = row["engine"], row["hf"]
    assert [len(t) for t in engine] == [NEW_TOKENS] * len(PROMPT_LENS)
    want_torch = ["decode_attention", "extend_attention"] if case == "mha6" else []
    assert row["torch_ops"] == want_torch
    if dtype == "fp32":
        assert engine == hf
    else:
        assert sum(e[0] == h[0] for e, h in zip(engine, hf, strict=True)) >= 3, (engine, hf)
