"""The first call of new prompt lengths through ``extend_sdpa``'s SDPA op against the
Triton fresh kernel: what a server pays when nearly every prompt has a length not seen
before. It decides whether ``UNIKV_EXTEND_SDPA`` can be on by default (the
``extend_sdpa`` docstring).

torch builds a cuDNN execution graph per sequence length unless
``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``, which torch reads in C++, so each setting runs
in its own subprocess (``--child``). For each of ``--lengths`` (all new to the process),
one prompt (Hq 32 / Hkv 8, bf16, D ``--dim``) is timed twice, host wall time around a
synchronised call: first call, then second call. Saves JSON with both settings' rows
and the Triton kernel's.

Not yet run on the H200 (written in the fifteenth session after the device budget was
spent). Run: ``python benchmarks/bench_extend_sdpa_lengths.py``.
"""

# ruff: noqa: B023  (the lambdas are called at once, inside their loop iteration)

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = [1000, 1013, 2047, 2100, 4001, 4096, 8191, 16000, 16384]


def child(lengths: list[int], dim: int) -> dict:
    """{"sdpa": [[T, first_ms, second_ms], ...], "triton": [...]} in this process."""
    import torch

    from unikv.kernels.attention import fresh as extend_fresh
    from unikv.kernels.attention import sdpa as extend_sdpa

    def wall(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    rows: dict[str, list] = {"sdpa": [], "triton": []}
    for n in lengths:
        q = torch.randn(n, 32, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, 8, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, 8, dim, device="cuda", dtype=torch.bfloat16)
        indptr = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        ops = {
            "sdpa": lambda: extend_sdpa.fresh_attention(q, k, v, sm_scale=dim**-0.5),
            "triton": lambda: extend_fresh.extend_attention_fresh(
                q, k, v, indptr, max_q_len=n, sm_scale=dim**-0.5
            ),
        }
        for name, fn in ops.items():
            rows[name].append([n, wall(fn), wall(fn)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/extend_sdpa_lengths_h200.json")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        print(json.dumps(child(lengths, args.dim)))
        return
    from benchmarks.common import environment, save_json

    payload = {"env": environment(), "dim": args.dim, "lengths": lengths, "runs": {}}
    for avoid in ("0", "1"):
        env = {**os.environ, "TORCH_CUDNN_SDPA_AVOID_RECOMPILE": avoid}
        cmd = [sys.executable, __file__, "--child", "--lengths", args.lengths, "--dim",
               str(args.dim)]  # fmt: skip
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if run.returncode:
            payload["runs"][avoid] = {"error": run.stderr[-2000:]}
        else:
            payload["runs"][avoid] = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"TORCH_CUDNN_SDPA_AVOID_RECOMPILE={avoid}: {payload['runs'][avoid]}", flush=True)
    save_json(args.out, payload)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
