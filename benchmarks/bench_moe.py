"""Benchmark the fused MoE (``unikv/kernels/moe/fused.py``) on gpt-oss's expert shape:
32 experts, top-4, hidden 2880, intermediate 2880, MXFP4 experts kept packed,
bf16 activations, at B = 1, 64, 256 tokens (the protocol of README.md, Results).

    python benchmarks/bench_moe.py [--quick] [--out benchmarks/results/moe_h200.json]
    python benchmarks/bench_moe.py --sweep [--budget 85]   (alone; < 100 s on an H200)

For each B, measured in the same process:
- ``fused_us``: the Triton fused MoE (CUDA-graph replay, and eager ``do_bench``);
- ``loop_us``: the loop it replaces (every expert on every token, dequantised bf16
  weights: gpt-oss's decode path before the kernel; the torch reference's dense loop);
- ``roofline_us``: the bytes of the experts the routing actually touches (packed
  blocks + scales + biases of each distinct expert, plus x and the output) over the
  device-to-device copy bandwidth measured in this run; ``compute_us``: the
  routed FLOPs over a bf16 GEMM rate measured in this run (for reference);
- ratios ``of_roofline`` = roofline_us / fused_us (the issue's target: >= 0.6 at
  B = 256) and ``vs_loop`` = loop_us / fused_us.
Every fused output is checked against the torch reference first (max abs error
over max |reference| recorded; a failed check is recorded, and the B is not timed).
The JSON goes to ``--out`` and, when set, to ``$OUT/bench_moe.json``.

``--sweep``: at each ``moe.BUCKETS`` B (1 ... 2048; ``--batches`` picks some), for
MXFP4-packed and bf16 experts, every ``moe.CANDIDATES`` config (small-T list for
B <= 64, large-T list for 16 <= B <= 256, prefill list above) and
the dense loop on bf16 weights, each fused output checked against the torch
reference first (compile errors and wrong outputs recorded, not fatal; a candidate
past ``--budget`` seconds is recorded as skipped). Writes
benchmarks/results/moe_sweep_h200.json (and ``$OUT/moe_sweep.json``; ``MOE_SWEEP_TAG``
is appended to both names) and prints
``INSTALL`` lines: the fastest config per (bucket, format) for ``moe.TABLE``, ``LOOP``
for bf16 where the loop beat it.
"""

# ruff: noqa: BLE001  (a failing section is recorded, not fatal)

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import GIB, bench_us, copy_ceilings, environment, graph_us, save_json
from unikv.kernels.moe import fused as moe
from unikv.kernels.moe import ref as moe_ref
from unikv.kernels.moe.mxfp4_ref import dequantize_mxfp4

SHAPE = {"experts": 32, "top_k": 4, "hidden": 2880, "intermediate": 2880}
BATCHES = (1, 64, 256)
SWEEP_BATCHES = moe.BUCKETS  # one B per table bucket
KW = {"activation": "gpt_oss", "gate_up": "interleaved"}
N_MAJOR = os.environ.get("MOE_SWEEP_N_MAJOR") == "1"  # also time the old dense layout
FORMATS = tuple(f for f in os.environ.get("MOE_SWEEP_FORMATS", "").split(",") if f)


def make_experts(e: int, d: int, i: int, g: torch.Generator) -> dict:
    """Random packed MXFP4 experts on the GPU (codes uniform, exponents 2^-7..2^0)."""

    def pair(rows, cols):
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(120, 128, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
        return blocks.cuda(), scales.cuda()

    (w1, s1), (w2, s2) = pair(2 * i, d), pair(d, i)
    b1 = (torch.randn(e, 2 * i, generator=g) * 0.1).bfloat16().cuda()
    b2 = (torch.randn(e, d, generator=g) * 0.1).bfloat16().cuda()
    return {"w1": w1, "w2": w2, "w1_scales": s1, "w2_scales": s2, "b1": b1, "b2": b2}


def dequantised(packed: dict, k_contiguous: bool = True) -> dict:
    """The same experts as dense bf16 (E, N, K): contiguous along K, as a loaded
    gpt-oss model holds them, or (``k_contiguous=False``) transformers' (E, K, N)
    storage seen transposed, as the model held them before (the sweep's
    ``bf16_n_major`` rows)."""
    out = {"b1": packed["b1"], "b2": packed["b2"]}
    for w, s in (("w1", "w1_scales"), ("w2", "w2_scales")):
        dense = [
            dequantize_mxfp4(packed[w][e : e + 1], packed[s][e : e + 1]).bfloat16()
            for e in range(packed[w].shape[0])
        ]  # one expert at a time in fp32, on the GPU: (1, K, N) each
        view = torch.cat(dense).transpose(1, 2)  # (E, N, K), N-contiguous
        out[w] = view.contiguous() if k_contiguous else view
    return out


def touched_bytes(packed: dict, ids: torch.Tensor, t: int, d: int) -> int:
    """Bytes a perfect kernel reads and writes: each distinct routed expert's
    weights once, x once, the output once (bf16)."""
    per_expert = sum(packed[n][0].numel() * packed[n].element_size() for n in packed)
    return int(ids.unique().numel()) * per_expert + 2 * t * d * 2


def bf16_tflops() -> float:
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / bench_us(lambda: a @ b, 5, 30) / 1e6


def run_batch(t: int, packed: dict, dense: dict, ceilings: dict, g: torch.Generator) -> dict:
    e, k, d, i = (SHAPE[n] for n in ("experts", "top_k", "hidden", "intermediate"))
    x = torch.randn(t, d, generator=g).bfloat16().cuda()
    logits = torch.randn(t, e, generator=g).cuda()
    top, ids = torch.topk(logits, k, dim=-1)
    weights = torch.softmax(top, dim=-1).bfloat16()
    kw = {"activation": "gpt_oss", "gate_up": "interleaved"}
    row = {"B": t, "distinct_experts": int(ids.unique().numel())}
    fused = lambda: moe.fused_moe(x, weights, ids, **packed, **kw)
    loop = lambda: moe_ref.fused_moe(x, weights, ids, **dense, **kw)
    ref = moe_ref.fused_moe(x, weights, ids, **packed, **kw).float()
    err = (fused().float() - ref).abs().max().item() / max(1.0, ref.abs().max().item())
    row["rel_err_vs_reference"] = err
    if not err < 3e-2:
        row["error"] = "fused output differs from the reference; not timed"
        return row
    row["fused_us"] = graph_us(fused)
    row["fused_eager_us"] = bench_us(fused)
    row["loop_us"] = graph_us(loop)
    nbytes = touched_bytes(packed, ids, t, d)
    row["touched_MB"] = nbytes / 1e6
    row["roofline_us"] = nbytes / (ceilings["d2d_GBps"] * 1e3)
    row["compute_us"] = 2 * t * k * (d * 2 * i + i * d) / (ceilings["bf16_TFLOPs"] * 1e6)
    row["of_roofline"] = row["roofline_us"] / row["fused_us"]
    row["vs_loop"] = row["loop_us"] / row["fused_us"]
    return row


def timed(fn) -> tuple[float, str]:
    """(us, how): CUDA-graph replay, or eager when capture fails."""
    try:
        return graph_us(fn, warmup=3, rep=20), "graph"
    except Exception:
        return bench_us(fn, warmup=3, rep=20), "eager"


def sweep_batch(t: int, experts: dict, ceilings: dict, g, t_end: float) -> list:
    """Rows for one B: the dense loop, then every candidate on both formats."""
    e, k, d = SHAPE["experts"], SHAPE["top_k"], SHAPE["hidden"]
    x = torch.randn(t, d, generator=g).bfloat16().cuda()
    top, ids = torch.topk(torch.randn(t, e, generator=g).cuda(), k, dim=-1)
    weights = torch.softmax(top, dim=-1).bfloat16()
    ref_w = experts.get("mxfp4") or experts["bf16"]  # the same values (MXFP4 is exact in bf16)
    ref = moe_ref.fused_moe(x, weights, ids, **ref_w, **KW).float()
    scale = max(1.0, ref.abs().max().item())
    base = {"B": t, "distinct_experts": int(ids.unique().numel())}
    rows, loop_us = [], None
    if "bf16" in experts:  # the dense loop runs on bf16 experts (MOE_SWEEP_FORMATS may drop them)
        loop_us, how = timed(lambda: moe_ref.fused_moe(x, weights, ids, **experts["bf16"], **KW))
        rows.append({**base, "format": "bf16", "candidate": "loop", "us": loop_us, "timing": how})
    lists = [
        n for n, on in (("small", t <= 64), ("large", 16 <= t <= 256), ("prefill", t > 256)) if on
    ]
    for fmt, w in experts.items():
        nbytes = touched_bytes(w, ids, t, d)
        roof = nbytes / (ceilings["d2d_GBps"] * 1e3)
        for cfg in dict.fromkeys(c for n in lists for c in moe.CANDIDATES[n]):
            if fmt == "mxfp4":  # the decode a forced UNIKV_MXFP4_DECODE runs, as a Config says it
                cfg = cfg._replace(interleave=moe.MXFP4_DECODE == 2)
            row = {**base, "format": fmt, "candidate": list(cfg), "roofline_us": roof}
            rows.append(row)
            if time.time() > t_end:
                row["error"] = "skipped: time budget"
                continue
            fn = lambda: moe.fused_moe(x, weights, ids, **w, **KW, config=cfg)  # noqa: B023
            try:
                err = (fn().float() - ref).abs().max().item() / scale
                row["rel_err_vs_reference"] = err
                if not err < 3e-2:
                    row["error"] = "output differs from the reference; not timed"
                    continue
                row["us"], row["timing"] = timed(fn)
                row["of_roofline"] = roof / row["us"]
                if loop_us is not None:
                    row["vs_loop"] = loop_us / row["us"]
            except Exception:
                row["error"] = traceback.format_exc(limit=2)[-1500:]
            torch.cuda.synchronize()
    return rows


def install_lines(rows: list) -> list:
    """``TABLE[(bucket, mxfp4)] = ...`` from the fastest checked row of each (B, format);
    bf16 takes LOOP where the loop was faster."""
    lines = []
    for t in sorted({r["B"] for r in rows if "format" in r}):
        for fmt in ("mxfp4", "bf16"):
            ok = [r for r in rows if r.get("B") == t and r.get("format") == fmt and "us" in r]
            if not ok:
                continue
            best = min(ok, key=lambda r: r["us"])
            if fmt == "mxfp4" and best["candidate"] == "loop":
                best = min((r for r in ok if r["candidate"] != "loop"), key=lambda r: r["us"])
            pick = "LOOP" if best["candidate"] == "loop" else f"Config{tuple(best['candidate'])}"
            note = f"{best['us']:.1f} us, {best.get('of_roofline', 0) * 100:.1f} % of roofline"
            lines.append(f"INSTALL TABLE[({t}, {fmt == 'mxfp4'})] = {pick}  # {note}")
    return lines


def run_sweep(budget_s: float, batches: tuple[int, ...] = SWEEP_BATCHES) -> None:
    t0 = time.time()
    g = torch.Generator().manual_seed(0)
    ceilings = copy_ceilings(GIB // 2, GIB // 16)
    e, d, i = SHAPE["experts"], SHAPE["hidden"], SHAPE["intermediate"]
    packed = make_experts(e, d, i, g)
    experts = {"mxfp4": packed, "bf16": dequantised(packed)}
    if FORMATS:  # MOE_SWEEP_FORMATS=bf16: only those formats
        experts = {f: w for f, w in experts.items() if f in FORMATS}
    if N_MAJOR:
        experts["bf16_n_major"] = dequantised(packed, k_contiguous=False)
    rows = []
    for t in batches:
        try:
            rows += sweep_batch(t, experts, ceilings, g, t0 + budget_s)
        except Exception:
            rows.append({"B": t, "error": traceback.format_exc(limit=3)})
        torch.cuda.empty_cache()
    lines = install_lines(rows)
    payload = {"env": environment(), "shape": SHAPE, "ceilings": ceilings, "rows": rows,
               "install": lines, "elapsed_s": time.time() - t0,
               "mxfp4_decode": os.environ.get("UNIKV_MXFP4_DECODE", "table")}  # fmt: skip
    tag = "" if batches == SWEEP_BATCHES else "_B" + "_".join(map(str, batches))
    tag += os.environ.get("MOE_SWEEP_TAG", "")  # e.g. the MXFP4 decode of an A/B
    save_json(f"benchmarks/results/moe_sweep_h200{tag}.json", payload)
    if os.environ.get("OUT"):
        save_json(os.path.join(os.environ["OUT"], f"moe_sweep{tag}.json"), payload)
    for r in rows:
        print({k: v for k, v in r.items() if k not in ("env",)})
    print("\n".join(lines), f"\nsweep took {time.time() - t0:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller copy probe")
    parser.add_argument("--out", default="benchmarks/results/moe_h200.json")
    parser.add_argument("--sweep", action="store_true", help="time moe.CANDIDATES (alone)")
    parser.add_argument("--budget", type=float, default=85.0, help="sweep seconds")
    parser.add_argument("--batches", default="", help="sweep only these B (comma list)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe needs a CUDA GPU (the fused MoE is a Triton kernel)")
    if args.sweep:
        picked = tuple(int(b) for b in args.batches.split(",") if b) or SWEEP_BATCHES
        return run_sweep(args.budget, picked)
    g = torch.Generator().manual_seed(0)
    ceilings = copy_ceilings(GIB if args.quick else 4 * GIB, GIB // 4)
    ceilings["bf16_TFLOPs"] = bf16_tflops()
    e, d, i = SHAPE["experts"], SHAPE["hidden"], SHAPE["intermediate"]
    packed = make_experts(e, d, i, g)
    dense = dequantised(packed)
    rows = []
    for t in BATCHES:
        try:
            rows.append(run_batch(t, packed, dense, ceilings, g))
        except Exception:
            rows.append({"B": t, "error": traceback.format_exc(limit=3)})
        print(rows[-1])
        torch.cuda.empty_cache()
    payload = {"env": environment(), "shape": SHAPE, "ceilings": ceilings, "rows": rows}
    save_json(args.out, payload)
    if os.environ.get("OUT"):
        save_json(os.path.join(os.environ["OUT"], "bench_moe.json"), payload)


if __name__ == "__main__":
    main()
