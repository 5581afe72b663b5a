"""Benchmark the MLA decode kernel (``unikv/kernels/mla_decode.py``) against the current
Triton MLA kernel (``mla.mla_attention``) and FlashInfer's
``BatchMLAPagedAttentionWrapper`` (fa2, fa3) in one process, all three reading the SAME
pool bytes (bench_mla.py's pool, export and checks, imported from it).

    python benchmarks/bench_mla_decode.py [--quick] [--sweep] [--backends fa2,fa3]
        [--out benchmarks/results/mla_decode_h200.json]

Shapes: bench_mla.py's decode section (B 1..128 x L 1k..32k, H 128 and 16, page 16;
pages 1 and 64 on two H 128 shapes); ``--quick`` runs 6 of them (< 60 s with warm
JIT caches). Per shape, BEFORE timing: the new kernel against the torch reference
(shapes small enough for it; a disagreement aborts the shape), against the current
kernel, and FlashInfer against the new kernel (a backend that disagrees is recorded
and not timed). The new kernel runs as the engine would: ``decode_plan`` once, caller
buffers. Times: eager (``unikv_us``) and CUDA-graph replay (``graph_us``); the same
for the current kernel (``old_*``) and FlashInfer (``flashinfer_*``, graph below 400
us). Ratios: ``vs_flashinfer_*`` = FlashInfer / new (> 1: the new kernel is faster),
``graph_vs_flashinfer_*_graph`` the same on graph replays, ``vs_old`` = old / new.
``--sweep`` also times other tile configs and split counts (to retune
``mla_decode.CONFIGS`` and the split model). JSON: ``--out`` and ``$OUT/<name>``,
rewritten after every shape.
"""

# ruff: noqa: B023, BLE001  (lambdas are timed at once; a failing shape is recorded, not fatal)

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_mla as peer
from benchmarks.common import bench_us, copy_ceilings, environment, graph_us, save_json
from unikv.kernels import mla, mla_decode, mla_ref
from unikv.kernels._checks import device_sms

QUICK = [(1, 32768, 128), (32, 4096, 128), (128, 8192, 128), (1, 32768, 16), (128, 1024, 16),
         (128, 8192, 16)]  # fmt: skip
SWEEP_SHAPES = [(1, 32768, 128), (32, 4096, 128), (128, 8192, 128), (1, 32768, 16), (128, 1024, 16)]
SWEEP_CONFIGS = {  # (block_h, num_v, block_n, num_warps, num_stages): candidates by head count
    128: [(128, 2, 32, 8, 2), (64, 2, 32, 4, 2), (64, 2, 64, 4, 2), (64, 1, 64, 8, 2),
          (64, 1, 32, 8, 2), (128, 2, 16, 8, 3), (16, 1, 32, 4, 2)],
    16: [(16, 1, 64, 8, 2), (16, 1, 32, 4, 2), (16, 1, 32, 8, 2), (16, 1, 64, 8, 3),
         (16, 2, 32, 4, 2)],
}  # fmt: skip


class Step:
    """One decode step of B requests of L cached tokens, H heads, over a LatentPool:
    the new kernel planned once with caller buffers, the current kernel as it is."""

    def __init__(self, bsz: int, length: int, heads: int, page_size: int):
        self.kv = kv = peer.LatentPool(bsz, length, page_size)
        self.q_lat = torch.randn(bsz, heads, peer.RANK, device="cuda", dtype=torch.bfloat16)
        self.q_rope = torch.randn(bsz, heads, peer.ROPE, device="cuda", dtype=torch.bfloat16)
        self.q_indptr = torch.arange(bsz + 1, dtype=torch.int32, device="cuda")
        max_len = kv.block_table.shape[1] * page_size
        self.config, self.splits, numel = mla_decode.decode_plan(
            bsz, heads, peer.RANK, max_len, torch.bfloat16, self.q_lat.device
        )
        self.out = torch.empty_like(self.q_lat)
        self.workspace = torch.empty(numel, dtype=torch.float32, device="cuda")

    def args(self):
        kv = self.kv
        return (self.q_lat, self.q_rope, kv.cache, kv.block_table, self.q_indptr, kv.seq_lens)

    def new(self, config=None, splits=None):
        """The new kernel: planned config / splits unless given (sweep: own buffers)."""
        kw = {"max_q_len": 1, "page_size": self.kv.page_size, "sm_scale": peer.SCALE}
        if config is None:
            kw.update(config=self.config, num_splits=self.splits, out=self.out,
                      workspace=self.workspace)  # fmt: skip
        else:
            kw.update(config=config, num_splits=splits)
        return mla_decode.mla_attention(*self.args(), **kw)

    def old(self):
        kv = self.kv
        return mla.mla_attention(*self.args(), max_q_len=1, page_size=kv.page_size,
                                 sm_scale=peer.SCALE)  # fmt: skip


def check(row: dict, step: Step, ours: torch.Tensor) -> None:
    """The new kernel against the torch reference (small shapes) and the current kernel."""
    kv = step.kv
    if kv.bsz * kv.length * step.q_lat.shape[1] <= 1 << 22:  # the reference fits in memory
        ref = mla_ref.mla_attention(*step.args(), max_q_len=1, page_size=kv.page_size,
                                    sm_scale=peer.SCALE)  # fmt: skip
        got = peer.agreement(ours, ref)
        row["err_vs_reference"], row["max_abs_err_vs_reference"] = (
            got["rel_err"],
            got["max_abs_err"],
        )
        assert got["ok"], f"the new kernel disagrees with the torch reference: {got}"
    got = peer.agreement(ours, step.old())
    row["err_vs_old"], row["max_abs_err_vs_old"] = got["rel_err"], got["max_abs_err"]
    assert got["ok"], f"the new kernel disagrees with the current kernel: {got}"


def decode_row(fi, ceil, bsz, length, heads, ps) -> dict:
    step = Step(bsz, length, heads, ps)
    row = {"B": bsz, "L": length, "H": heads, "page_size": ps, "pool_layers": step.kv.layers}
    row.update(config=list(step.config), splits=step.splits)
    ours = step.new().clone()
    check(row, step, ours)
    runners = peer.check_peers(fi, row, step.q_lat, step.q_rope, step.kv, step.q_indptr, ours,
                               causal=False)  # fmt: skip
    us = bench_us(step.new)
    row.update(unikv_us=us, graph_us=graph_us(step.new))
    row.update(old_us=bench_us(step.old), old_graph_us=graph_us(step.old))
    row.update(vs_old=row["old_us"] / us, graph_vs_old=row["old_graph_us"] / row["graph_us"])
    nbytes = bsz * length * (peer.RANK + peer.ROPE) * 2
    flops = 2 * bsz * heads * length * (2 * peer.RANK + peer.ROPE)
    row.update(TBps=nbytes / us / 1e6, pct_copy=nbytes / us / 1e3 / ceil["d2d_GBps"] * 100,
               TFLOPs=flops / us / 1e6)  # fmt: skip
    peer.time_peers(runners, row, us)
    return row


def sweep_rows(shape) -> list:
    """Every candidate config at the model's split count, half and double it."""
    bsz, length, heads = shape
    step, rows = Step(bsz, length, heads, 16), []
    want = step.new().clone()
    for config in SWEEP_CONFIGS[heads]:
        cfg = mla_decode.Config(*config)
        max_len = step.kv.block_table.shape[1] * 16
        sms = device_sms(step.q_lat.device)
        model = mla_decode.choose_num_splits(bsz, heads, peer.RANK, max_len, cfg, sms)
        for splits in sorted({max(1, model // 2), model, min(mla_decode.MAX_SPLITS, model * 2)}):
            row = {"B": bsz, "L": length, "H": heads, "config": config, "splits": splits,
                   "model_splits": model}  # fmt: skip
            try:
                got = step.new(config, splits)
                assert peer.rel_err(got, want) < 1e-2, "disagrees with the planned config"
                row["us"] = bench_us(lambda: step.new(config, splits))
                row["graph_us"] = graph_us(lambda: step.new(config, splits))
            except Exception as exc:  # e.g. out of shared memory
                row["error"] = repr(exc)[:300]
            print(row, flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--backends", default="fa2,fa3", help="FlashInfer backends ('' for none)")
    parser.add_argument("--out", default="benchmarks/results/mla_decode_h200.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    try:
        fi = importlib.import_module("flashinfer.mla")
        version = getattr(importlib.import_module("flashinfer"), "__version__", None)
    except Exception as exc:  # recorded, not hidden
        print(f"flashinfer unavailable: {exc!r}")
        fi, version = None, f"unavailable: {exc!r}"[:300]
    peer.BACKENDS = tuple(b for b in args.backends.split(",") if b)  # what check_peers runs
    result = {"env": environment(), "quick": args.quick, "flashinfer": version,
              "flashinfer_cache": peer.CACHE_NOTE,
              "checks": {"rel_tol": peer.REL_TOL, "abs_tol_of_max": peer.ABS_TOL,
                         "before_timing": True},
              "configs": {k: list(v) for k, v in mla_decode.CONFIGS.items()}}  # fmt: skip
    outs = [args.out]
    if os.environ.get("OUT"):  # the device runs collect $OUT
        outs.append(str(Path(os.environ["OUT"]) / Path(args.out).name))
    result["ceilings"] = ceil = copy_ceilings()
    t0 = time.time()
    if args.quick:
        jobs = [(b, n, h, 16) for b, n, h in QUICK]
    else:
        jobs = [(b, n, h, 16) for h in (128, 16) for b, n in peer.DECODE]
        jobs += [(b, n, 128, ps) for ps in (1, 64) for b, n in peer.QUICK[:2]]
    for shape in jobs:
        try:
            row = decode_row(fi, ceil, *shape)
        except Exception as exc:  # keep the other shapes' numbers
            row = {"shape": shape, "error": repr(exc)[:2000]}
        print("decode", row, flush=True)
        result.setdefault("decode", []).append(row)
        torch.cuda.empty_cache()
        for out in outs:
            save_json(out, result)
    if args.sweep:
        for shape in SWEEP_SHAPES:
            result.setdefault("sweep", []).extend(sweep_rows(shape))
            torch.cuda.empty_cache()
            for out in outs:
                save_json(out, result)
    result["wall_s"] = time.time() - t0
    print(f"[done at {result['wall_s']:.0f}s]", flush=True)
    for out in outs:
        save_json(out, result)


if __name__ == "__main__":
    main()
