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

``--fp8`` (alone; about a minute): block-scaled FP8 experts (``kernels/moe/fp8.py``,
128 x 128 blocks) on a DeepSeek-V3 expert shape (hidden 7168, intermediate 2048, 32
experts, top-8), bf16 activations, at decode T = 1 ... 64 and a 2048-token prefill
chunk. Per T, in one run: ``fp8_us`` (graph replay; 16-bit activations, each weight
tile dequantised in registers), ``w8a8_us`` (activations quantised per token and 128
columns, FP8 x FP8 dots), both at their plan's tiles, ``bf16_us`` the 16-bit fused MoE
on the same experts dequantised to bf16 (the same tiles), ``dequant_per_call_us`` the
path it replaces (``fp8_gemm_ref.moe_fp8`` into the Triton MoE: the experts dequantised
to bf16 every call); ``fp8_roofline_us``: the FP8 bytes of the distinct routed experts
(weights + scales, plus x and the output) over the copy bandwidth measured in this
run, ``fp8_of_roofline`` = roofline / fp8_us (``bf16_of_roofline`` the same for the
bf16 bytes and time), ``fp8_vs_bf16`` = bf16_us / fp8_us; ``best`` the faster FP8
variant, ``best_vs_bf16`` and ``best_of_fp8_roofline`` its ratios (printed per T at
the end). Checked first: 16-bit activations against the bf16 kernel (max error over
max |bf16|, and whether bit-equal) and the per-call path; W8A8 against its exact
description (``fp8_gemm_ref.moe_fp8_w8a8(exact=True)``, fp64 sums: ``w8a8_check``, relative rms
within ``W8A8_RMS_BOUND`` overall and ``W8A8_ROW_BOUND`` per row; the max error over max
|reference| recorded, not checked: a tail statistic, docs/perf.md), with its rms distance
to the bf16 kernel. The exact description's fp64 GEMMs take ~30 s at T 2048 on an H100.
JSON: benchmarks/results/moe_fp8.json and ``$OUT/bench_moe_fp8.json``.

``--fp8 --sweep [--budget 85] [--batches ...]`` (T 1, 8, 16, 64, 256, 2048; about two
and a half minutes on an H100 with the exact description at T 2048): per T the bf16
kernel, then each variant (16-bit activations, W8A8) at its plan's tiles and
``fp8.SWEEP``'s candidates, each checked first (16-bit: the bf16 kernel at 3e-2; W8A8:
``w8a8_check``), each T given its share of the budget (not counting the exact
description). Prints per T the best FP8 variant against the bf16 kernel and its share
of the FP8 bytes roofline (and of the FP8 / bf16 matmul rate measured in the run), then
``INSTALL`` lines for ``kernels/moe/fp8.TABLE[(bucket, w8a8)]`` and
``fp8.W8A8_MIN_TOKENS`` (the smallest swept T from which W8A8 won at every larger one
where both variants were timed; an untimed (T, variant) keeps its current entry, with a
"kept" note and an UNTIMED line), and the TABLE as Python to paste (JSON:
moe_fp8_sweep.json, keys "install", "paste").

``--fp8 --diagnose T`` (alone; < 60 s at T 2048 on an H100): the W8A8 kernel (plan tiles
and a second-pass tile) and the fp32 reference against the exact description at T on
the FP8 shape: relative rms (overall, worst row) against the bounds, the max error over
max |exact|, x's codes from the launcher's quantiser against the torch one's, and the
fraction of each side's activation elements, e4m3 codes and group scales that differ
from the exact ones (``$OUT/moe_fp8_diagnose.json``).
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
from unikv.kernels.linear import fp8_gemm_ref
from unikv.kernels.moe import fp8 as moe_fp8
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
    x = torch.randn(t, d, generator=g).bfloat16().to(FP8_DEVICE)
    top, ids = torch.topk(torch.randn(t, e, generator=g).to(FP8_DEVICE), k, dim=-1)
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


FP8_SHAPE = {"experts": 32, "top_k": 8, "hidden": 7168, "intermediate": 2048}
FP8_BATCHES = (1, 2, 4, 8, 16, 32, 64, 2048)
FP8_BLOCK = (128, 128)
FP8_DEVICE = "cuda"  # where the FP8 runs put their operands (a CPU test sets "cpu")


def make_fp8_experts(e: int, d: int, i: int) -> tuple[dict, dict]:
    """Random FP8 experts in 128 x 128 blocks (multipliers 2^-12..2^-8) on the GPU, and
    the same experts dequantised to bf16 one expert at a time (``dequantize_experts``)."""
    g = torch.Generator(device=FP8_DEVICE).manual_seed(0)
    fp8, dense = {}, {}
    for w, rows, cols, parts in (("w1", i, d, 2), ("w2", d, i, 1)):
        q = torch.empty(e, parts * rows, cols, dtype=torch.float8_e4m3fn, device=FP8_DEVICE)
        for x in range(e):
            q[x] = (torch.randn(parts * rows, cols, device=FP8_DEVICE, generator=g) * 100).clamp(
                -448, 448
            )
        blocks = (e, parts * -(-rows // 128), -(-cols // 128))
        s = 2.0 ** torch.randint(-12, -7, blocks, device=FP8_DEVICE, generator=g).float()
        fp8[w], fp8[w + "_scale"] = q, s
        dense[w] = torch.cat([
            fp8_gemm_ref.dequantize_experts(q[x : x + 1], s[x : x + 1], parts, FP8_BLOCK,
                                            torch.bfloat16) for x in range(e)
        ])  # fmt: skip
    return fp8, dense


def fp8_routing(t: int, g) -> tuple:
    """x (T, d) bf16, routing weights (T, k) bf16 and ids (T, k) on the GPU."""
    e, k, d = FP8_SHAPE["experts"], FP8_SHAPE["top_k"], FP8_SHAPE["hidden"]
    x = torch.randn(t, d, generator=g).bfloat16().to(FP8_DEVICE)
    top, ids = torch.topk(torch.randn(t, e, generator=g).to(FP8_DEVICE), k, dim=-1)
    return x, torch.softmax(top, dim=-1).bfloat16(), ids


def fp8_bytes(experts: dict, ids: torch.Tensor, t: int) -> int:
    """The bytes of the distinct routed experts (weights and scales), x and the output."""
    per_expert = sum(v[0].numel() * v.element_size() for v in experts.values())
    return int(ids.unique().numel()) * per_expert + 2 * t * FP8_SHAPE["hidden"] * 2


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max error / max |want|, rms error / rms want)."""
    diff = got.float() - want.float()
    return (diff.abs().max() / want.float().abs().max()).item(), (
        diff.norm() / want.float().norm()
    ).item()


def matmul_rates() -> dict:
    """The bf16 and FP8 (``torch._scaled_mm``, per-tensor scales) 8192^3 GEMM rates in
    TFLOP/s measured in this run: the prefill rows' compute ceilings (FP8 None where
    this torch / GPU has no ``_scaled_mm``)."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
    one = torch.ones((), device="cuda")
    try:
        fn = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        fp8_rate = 2 * n**3 / bench_us(fn, 5, 30) / 1e6
    except Exception:
        fp8_rate = None
    return {"bf16_TFLOPs": bf16_tflops(), "fp8_TFLOPs": fp8_rate}


def fp8_flops(t: int) -> int:
    """The routed experts' FLOPs: gate, up and down over T x top-k assignments."""
    k, d, i = (FP8_SHAPE[n] for n in ("top_k", "hidden", "intermediate"))
    return 2 * t * k * 3 * d * i


def run_fp8_batch(t: int, experts: dict, dense: dict, ceilings: dict, g) -> dict:
    """One T: FP8 experts with 16-bit activations (``fp8_us``) and W8A8 (``w8a8_us``),
    each at its plan's tiles, against the bf16 kernel and the per-call path."""
    x, weights, ids = fp8_routing(t, g)
    ops = (experts["w1"], experts["w1_scale"], experts["w2"], experts["w2_scale"])
    fp8 = lambda: moe_fp8.moe_fp8(x, weights, ids, *ops, block=FP8_BLOCK, w8a8=False)
    w8a8 = lambda: moe_fp8.moe_fp8(x, weights, ids, *ops, block=FP8_BLOCK, w8a8=True)
    bf16 = lambda: moe.fused_moe(x, weights, ids, dense["w1"], dense["w2"])
    per_call = lambda: fp8_gemm_ref.moe_fp8(x, weights, ids, *ops, block=FP8_BLOCK, moe=moe.moe)
    got, base, old = fp8(), bf16().float(), per_call().float()
    row = {"B": t, "distinct_experts": int(ids.unique().numel())}
    rel = lambda want: ((got.float() - want).abs().max() / want.abs().max()).item()
    row["rel_err_vs_bf16_kernel"] = rel(base)
    row["bit_equal_to_bf16_kernel"] = bool(torch.equal(got.float(), base))
    row["rel_err_vs_dequant_per_call"] = rel(old)
    if not max(row["rel_err_vs_bf16_kernel"], row["rel_err_vs_dequant_per_call"]) < 3e-2:
        row["error"] = "FP8 output differs from the bf16 kernel / the per-call path; not timed"
        return row
    want8 = fp8_gemm_ref.moe_fp8_w8a8(x, weights, ids, *ops, block=FP8_BLOCK)
    exact = fp8_gemm_ref.moe_fp8_w8a8(x, weights, ids, *ops, block=FP8_BLOCK, exact=True)
    out8, check = w8a8(), {}
    w8a8_ok = w8a8_check(out8, exact, want8, check)
    row.update({"w8a8_" + k: v for k, v in check.items()})
    row["w8a8_reference_vs_exact"] = fp8_gemm_ref.w8a8_errors(want8, exact)
    row["w8a8_rms_vs_bf16_kernel"] = rel_rms(out8, base)[1]
    row["fp8_us"], row["bf16_us"] = graph_us(fp8), graph_us(bf16)
    if w8a8_ok:
        row["w8a8_us"] = graph_us(w8a8)
    row["dequant_per_call_us"], row["dequant_per_call_timing"] = timed(per_call)
    nbytes, bf16_bytes = fp8_bytes(experts, ids, t), fp8_bytes(dense, ids, t)
    row["fp8_MB"], row["bf16_MB"] = nbytes / 1e6, bf16_bytes / 1e6
    row["fp8_roofline_us"] = nbytes / (ceilings["d2d_GBps"] * 1e3)
    row["fp8_of_roofline"] = row["fp8_roofline_us"] / row["fp8_us"]
    row["bf16_of_roofline"] = bf16_bytes / (ceilings["d2d_GBps"] * 1e3) / row["bf16_us"]
    row["fp8_vs_bf16"] = row["bf16_us"] / row["fp8_us"]
    row["fp8_vs_dequant_per_call"] = row["dequant_per_call_us"] / row["fp8_us"]
    best = min(("w8a8", "fp8"), key=lambda v: row.get(v + "_us", float("inf")))
    row["best"], row["best_us"] = best, row[best + "_us"]
    row["best_vs_bf16"] = row["bf16_us"] / row["best_us"]
    row["best_of_fp8_roofline"] = row["fp8_roofline_us"] / row["best_us"]
    return row


def run_fp8() -> None:
    t0 = time.time()
    g = torch.Generator().manual_seed(0)
    ceilings = copy_ceilings(GIB, GIB // 16)
    e, d, i = (FP8_SHAPE[n] for n in ("experts", "hidden", "intermediate"))
    experts, dense = make_fp8_experts(e, d, i)
    rows = []
    for t in FP8_BATCHES:
        try:
            rows.append(run_fp8_batch(t, experts, dense, ceilings, g))
        except Exception:
            rows.append({"B": t, "error": traceback.format_exc(limit=3)})
        print(rows[-1])
        torch.cuda.empty_cache()
    payload = {"env": environment(), "shape": FP8_SHAPE, "block": FP8_BLOCK,
               "ceilings": ceilings, "rows": rows, "elapsed_s": time.time() - t0}  # fmt: skip
    save_json("benchmarks/results/moe_fp8.json", payload)
    if os.environ.get("OUT"):
        save_json(os.path.join(os.environ["OUT"], "bench_moe_fp8.json"), payload)
    for r in rows:
        if "best_us" in r:
            print(f"T {r['B']}: best {r['best']} {r['best_us']:.1f} us = "
                  f"{r['best_vs_bf16']:.2f}x bf16 ({r['bf16_us']:.1f} us), "
                  f"{r['best_of_fp8_roofline'] * 100:.1f} % of the FP8 roofline")  # fmt: skip
    print(f"fp8 run took {time.time() - t0:.0f} s")


FP8_SWEEP_BATCHES = (1, 8, 16, 64, 256, 2048)


def fp8_sweep_batch(t: int, state: dict, g, t_end: float) -> list:
    """One T's rows: the bf16 kernel (its plan), then per variant (16-bit activations,
    W8A8) the plan and ``fp8.SWEEP``'s candidates, each checked first (``a16_check``,
    ``w8a8_check``) and timed until ``t_end`` (moved by the exact description's time)."""
    experts, dense, ceilings = state["experts"], state["dense"], state["ceilings"]
    ops = (experts["w1"], experts["w1_scale"], experts["w2"], experts["w2_scale"])
    x, weights, ids = fp8_routing(t, g)
    bf16 = lambda: moe.fused_moe(x, weights, ids, dense["w1"], dense["w2"])
    base = bf16().float()
    bf16_us, how = timed(bf16)
    rows = [{"B": t, "variant": "bf16", "candidate": "plan", "us": bf16_us, "timing": how}]
    roof = fp8_bytes(experts, ids, t) / (ceilings["d2d_GBps"] * 1e3)
    t_exact = time.time()  # the exact description's fp64 GEMMs are not the T's budget
    exact = fp8_gemm_ref.moe_fp8_w8a8(x, weights, ids, *ops, block=FP8_BLOCK, exact=True)
    want8 = fp8_gemm_ref.moe_fp8_w8a8(x, weights, ids, *ops, block=FP8_BLOCK).float()
    rows[0]["w8a8_reference_vs_exact"] = fp8_gemm_ref.w8a8_errors(want8, exact)
    spent = time.time() - t_exact
    t_end += spent
    state["exact_s"] = state.get("exact_s", 0.0) + spent  # later T keep their shares
    span = "small" if t <= 64 else "prefill"
    for w8a8 in (False, True):
        rate = ceilings["fp8_TFLOPs" if w8a8 else "bf16_TFLOPs"]
        planned = moe_fp8.plan(t, torch.bfloat16, w8a8=w8a8)
        for cfg in dict.fromkeys((planned, *moe_fp8.SWEEP[w8a8, span])):
            row = {"B": t, "variant": "w8a8" if w8a8 else "a16", "candidate": list(cfg),
                   "plan": cfg == planned, "roofline_us": roof}  # fmt: skip
            rows.append(row)
            if time.time() > t_end:
                row["error"] = "skipped: time budget"
                continue
            kw = {"block": FP8_BLOCK, "config": cfg, "w8a8": w8a8}
            fn = lambda: moe_fp8.moe_fp8(x, weights, ids, *ops, **kw)  # noqa: B023
            try:
                out = fn()
                row["rms_vs_bf16_kernel"] = rel_rms(out, base)[1]
                if not (w8a8_check(out, exact, want8, row) if w8a8 else a16_check(out, base, row)):
                    row["error"] = "output differs from its reference; not timed"
                    continue
                row["us"], row["timing"] = timed(fn)
                row["of_roofline"] = roof / row["us"]
                row["vs_bf16"] = bf16_us / row["us"]
                if rate:
                    row["of_matmul_rate"] = fp8_flops(t) / (rate * 1e6) / row["us"]
            except Exception:
                row["error"] = traceback.format_exc(limit=2)[-1500:]
            torch.cuda.synchronize()
    return rows


def a16_check(out: torch.Tensor, base: torch.Tensor, row: dict) -> bool:
    """16-bit activations: max error over max |bf16 kernel| < 3e-2 (recorded in ``row``)."""
    row["rel_err_vs_reference"] = rel_rms(out, base)[0]
    return row["rel_err_vs_reference"] < 3e-2


def w8a8_check(out: torch.Tensor, exact: torch.Tensor, ref: torch.Tensor, row: dict) -> bool:
    """W8A8: the relative rms distance to the exact description (overall and worst row,
    ``fp8_gemm_ref.w8a8_errors``) within ``W8A8_RMS_BOUND`` / ``W8A8_ROW_BOUND``; the max
    error over max |reference| (the tail statistic the check used before) is recorded."""
    rms, worst_row = fp8_gemm_ref.w8a8_errors(out, exact)
    row["rms_vs_exact"], row["worst_row_vs_exact"] = rms, worst_row
    row["rel_err_vs_reference"] = rel_rms(out, ref)[0]
    return rms <= fp8_gemm_ref.W8A8_RMS_BOUND and worst_row <= fp8_gemm_ref.W8A8_ROW_BOUND


def fp8_install(
    rows: list, batches: tuple[int, ...], current: dict | None = None
) -> tuple[list, dict, int | None]:
    """(INSTALL lines, {(bucket, w8a8): Config list}, W8A8's threshold): the fastest
    checked row per (T, variant), and the smallest swept T from which W8A8's best beat
    the 16-bit activations' best at every larger swept T where both were timed (None: at
    none). A (T, variant) with no timed row (every candidate failed its check, or the
    budget ran out) keeps ``current``'s entry (``fp8.TABLE`` by default), re-installed
    with a "kept" note, and a T where either variant is untimed is neither a win nor a
    loss for the threshold (an "UNTIMED" line says so)."""
    current = moe_fp8.TABLE if current is None else current
    lines, table, best = [], {}, {}
    for t in batches:
        for variant in ("a16", "w8a8"):
            key = (moe.bucket(t), variant == "w8a8")
            ok = [r for r in rows if r["B"] == t and r["variant"] == variant and "us" in r]
            if not ok:
                kept = current.get(key)
                if kept is not None and key not in table:
                    table[key] = list(kept)
                    lines.append(f"INSTALL fp8.TABLE[{key}] = Config{tuple(kept)}  # kept: no "
                                 f"{variant} candidate timed at T {t}")  # fmt: skip
                continue
            pick = min(ok, key=lambda r: r["us"])
            best[t, variant] = pick["us"]
            table[key] = pick["candidate"]
            note = (f"{pick['us']:.1f} us, {pick['vs_bf16']:.2f}x bf16, "
                    f"{pick['of_roofline'] * 100:.1f} % of the FP8 roofline")  # fmt: skip
            lines.append(f"INSTALL fp8.TABLE[{key}] = Config{tuple(pick['candidate'])}  # {note}")
    threshold, untimed = None, []
    for t in sorted(batches, reverse=True):
        a16, w8 = best.get((t, "a16")), best.get((t, "w8a8"))
        if a16 is None or w8 is None:
            untimed.append(t)
            continue
        if w8 >= a16:
            break
        threshold = t
    won = "no swept T" if threshold is None else f"every timed swept T >= {threshold}"
    if untimed:
        why = "a variant had no timed candidate there"
        lines.append(f"UNTIMED T {sorted(untimed)}: {why}; neither a win nor a loss for "
                     "W8A8_MIN_TOKENS, their TABLE entries kept")  # fmt: skip
    lines.append(f"INSTALL fp8.W8A8_MIN_TOKENS = {threshold or '1 << 62'}  # W8A8 won at {won}")
    return lines, table, threshold


def fp8_summary(t: int, rows: list) -> str:
    """T's line: FP8's best variant against the bf16 kernel, and its share of the FP8
    bytes roofline (and of the matmul rate, for prefill)."""
    mine = [r for r in rows if r["B"] == t and "us" in r]
    fp8 = [r for r in mine if r["variant"] != "bf16"]
    if not fp8:
        return f"T {t}: no FP8 candidate ran"
    pick = min(fp8, key=lambda r: r["us"])
    best = {v: min((r["us"] for r in fp8 if r["variant"] == v), default=float("nan"))
            for v in ("a16", "w8a8")}  # fmt: skip
    rms = min((r["rms_vs_bf16_kernel"] for r in fp8 if r["variant"] == "w8a8"), default=None)
    bf16_us = next(r["us"] for r in mine if r["variant"] == "bf16")
    text = (
        f"T {t}: FP8 best {pick['variant']} Config{tuple(pick['candidate'])} {pick['us']:.1f}"
        f" us = {pick['vs_bf16']:.2f}x bf16 ({bf16_us:.1f} us), "
        f"{pick['of_roofline'] * 100:.1f} % of the FP8 roofline"
    )
    if "of_matmul_rate" in pick:
        text += f", {pick['of_matmul_rate'] * 100:.0f} % of its matmul rate"
    text += f" | 16-bit act {best['a16']:.1f} us, W8A8 {best['w8a8']:.1f} us"
    return text + ("" if rms is None else f" (W8A8 rms vs bf16 {rms:.3f})")


def run_fp8_sweep(budget_s: float, batches: tuple[int, ...]) -> None:
    """``--fp8 --sweep``: per T, the bf16 kernel, then FP8 experts with 16-bit
    activations and with W8A8 at the plan's tiles and ``fp8.SWEEP``'s, each T given its
    share of ``budget_s`` (what one leaves rolls over); ``INSTALL`` lines for
    ``kernels/moe/fp8.TABLE`` and ``W8A8_MIN_TOKENS``, the TABLE as Python to paste."""
    t0 = time.time()
    g = torch.Generator().manual_seed(0)
    ceilings = {**copy_ceilings(GIB, GIB // 16), **matmul_rates()}
    experts, dense = make_fp8_experts(
        *(FP8_SHAPE[n] for n in ("experts", "hidden", "intermediate"))
    )
    state = {"experts": experts, "dense": dense, "ceilings": ceilings}
    rows = []
    for n, t in enumerate(batches):
        t_end = t0 + state.get("exact_s", 0.0) + budget_s * (n + 1) / len(batches)
        try:
            rows += fp8_sweep_batch(t, state, g, t_end)
        except Exception:
            rows.append({"B": t, "variant": "error", "error": traceback.format_exc(limit=3)})
        print(fp8_summary(t, rows), flush=True)
        torch.cuda.empty_cache()
    lines, table, threshold = fp8_install(rows, batches)
    paste = "TABLE: dict[tuple[int, bool], fused.Config] = {\n" + "".join(
        f"    {key}: C{tuple(cfg)},\n" for key, cfg in sorted(table.items())
    ) + "}"  # fmt: skip
    payload = {"env": environment(), "shape": FP8_SHAPE, "ceilings": ceilings, "rows": rows,
               "install": lines, "table": {str(k): v for k, v in table.items()},
               "w8a8_min_tokens": threshold, "paste": paste,
               "elapsed_s": time.time() - t0}  # fmt: skip
    save_json("benchmarks/results/moe_fp8_sweep.json", payload)
    if os.environ.get("OUT"):
        save_json(os.path.join(os.environ["OUT"], "moe_fp8_sweep.json"), payload)
    print("\n".join(lines), f"\n{paste}\nsweep took {time.time() - t0:.0f} s")


DIAGNOSE_SECOND_PASS = moe.Config(128, 64, 128, 1, 8, 3)  # N tile 64: a second pass quantises


def code_changes(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Two 16-bit activations (rows, I) quantised alike (``fp8_gemm_ref.quantize_act``):
    the fraction of their elements, e4m3 codes and group scales that differ."""
    (qa, sa), (qb, sb) = (fp8_gemm_ref.quantize_act(v, FP8_BLOCK[1]) for v in (a, b))
    frac = lambda u, v: (u != v).float().mean().item()
    return {"elements": frac(a, b), "codes": frac(qa.view(torch.uint8), qb.view(torch.uint8)),
            "scales": frac(sa, sb)}  # fmt: skip


def run_fp8_diagnose(t: int) -> None:
    """``--fp8 --diagnose``: at T tokens on ``FP8_SHAPE``, the W8A8 kernel's and the fp32
    reference's distance to the exact description (``fp8_gemm_ref.w8a8_errors``: relative
    rms overall and worst row, against the bounds; and the max error over max |exact|,
    the tail statistic), and where their codes move: x's codes as the launcher quantised
    them against the torch quantiser's, and each side's activation (the kernel's through
    a second-pass tile, ``DIAGNOSE_SECOND_PASS``) against the exact one (fraction of
    elements, e4m3 codes and group scales that differ)."""
    t0 = time.time()
    g = torch.Generator().manual_seed(0)
    experts, _ = make_fp8_experts(*(FP8_SHAPE[n] for n in ("experts", "hidden", "intermediate")))
    ops = (experts["w1"], experts["w1_scale"], experts["w2"], experts["w2_scale"])
    x, weights, ids = fp8_routing(t, g)
    exact, act = fp8_gemm_ref.moe_fp8_w8a8(x, weights, ids, *ops, block=FP8_BLOCK,
                                           with_act=True, exact=True)  # fmt: skip
    if x.is_cuda:
        torch.cuda.synchronize()
    print(f"T {t}: exact description {time.time() - t0:.1f} s", flush=True)
    ref, ref_act = fp8_gemm_ref.moe_fp8_w8a8(x, weights, ids, *ops, block=FP8_BLOCK,
                                             with_act=True)  # fmt: skip
    report = {"T": t, "bounds": (fp8_gemm_ref.W8A8_RMS_BOUND, fp8_gemm_ref.W8A8_ROW_BOUND)}

    def errors(name, out):
        rms, row = fp8_gemm_ref.w8a8_errors(out, exact)
        tail = ((out.double() - exact).abs().max() / exact.abs().max()).item()
        report[name] = {"rms_vs_exact": rms, "worst_row_vs_exact": row, "max_over_max": tail,
                        "max_over_max_vs_reference": rel_rms(out, ref)[0]}  # fmt: skip

    errors("reference", ref)
    report["reference"]["act_vs_exact"] = code_changes(ref_act, act)
    calls, real = [], moe.quantize_act
    moe.quantize_act = lambda v, group: calls.append((v, *real(v, group))) or calls[-1][1:]
    try:
        for name, cfg in (("kernel_plan", None), ("kernel_second_pass", DIAGNOSE_SECOND_PASS)):
            calls.clear()
            errors(name, moe_fp8.moe_fp8(x, weights, ids, *ops, block=FP8_BLOCK, config=cfg,
                                         w8a8=True))  # fmt: skip
        sorted_ids, _ = moe.align_by_expert(ids, FP8_SHAPE["experts"], DIAGNOSE_SECOND_PASS.block_m)
    finally:
        moe.quantize_act = real
    xq, xs = fp8_gemm_ref.quantize_act(x, FP8_BLOCK[1])
    report["x_codes_vs_torch"] = {
        "codes": (calls[0][1].view(torch.uint8) != xq.view(torch.uint8)).float().mean().item(),
        "scales": (calls[0][2] != xs).float().mean().item()}  # fmt: skip
    valid = sorted_ids < ids.numel()
    kernel_act = calls[1][0][valid]  # the second pass's input: sorted rows of the activation
    report["kernel_second_pass"]["act_vs_exact"] = code_changes(
        kernel_act, act[sorted_ids[valid].long()]
    )
    report["elapsed_s"] = time.time() - t0
    for key, value in report.items():
        print(f"{key}: {value}")
    if os.environ.get("OUT"):
        save_json(os.path.join(os.environ["OUT"], "moe_fp8_diagnose.json"), report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller copy probe")
    parser.add_argument("--out", default="benchmarks/results/moe_h200.json")
    parser.add_argument("--sweep", action="store_true", help="time moe.CANDIDATES (alone)")
    parser.add_argument("--budget", type=float, default=85.0, help="sweep seconds")
    parser.add_argument("--batches", default="", help="sweep only these B (comma list)")
    parser.add_argument("--fp8", action="store_true", help="FP8 experts vs bf16 (alone)")
    parser.add_argument("--diagnose", type=int, default=0,
                        help="with --fp8: W8A8 vs its exact description at this T")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe needs a CUDA GPU (the fused MoE is a Triton kernel)")
    if args.fp8 and args.diagnose:
        return run_fp8_diagnose(args.diagnose)
    if args.fp8 and args.sweep:
        picked = tuple(int(b) for b in args.batches.split(",") if b)
        return run_fp8_sweep(args.budget, picked or FP8_SWEEP_BATCHES)
    if args.fp8:
        return run_fp8()
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
