"""The block-scaled FP8 GEMM (``unikv/kernels/linear/fp8_gemm.py``) against the bf16 GEMM
(cuBLAS, ``F.linear``) of the same shape, on DeepSeek-V3 and Qwen3 layer shapes with
128 x 128 blocks, in one run.

    python benchmarks/bench_fp8_gemm.py [--out benchmarks/results/fp8_gemm.json] [--quick]

- ``decode`` (M = 1, 4, 16): every call streams its weight from HBM (distinct copies,
  >= 256 MB in all, replayed in one CUDA graph); ``of_bw`` = FP8 weight + scale bytes /
  device copy bandwidth / time (target >= 0.80); the plan's config (``fp8_plan``: split
  K reduced inside the launch, ``Fp8Plan.fused_split``), the same config with the
  partials summed by torch after the launch (``fp8_plan_torch_sum``: the former path)
  and other configs (``fp8_cand``, fused; ``config`` lists the Fp8Plan, ``target`` and
  ``min_k`` the split rule's programs and least K a split that picked the split: for
  the small-N shapes, narrower tiles and more or fewer splits than the plan's); bf16
  cuBLAS's time and ``of_bw`` (its 2-byte weight) beside it. ``launches``: the GPU
  kernels (and memsets / copies) one eager call runs, counted by ``torch.profiler``.
- ``prefill`` (M = 4096, 8192): ``do_bench`` medians; ``speedup`` = bf16 cuBLAS time /
  FP8 time (target >= 1.4): the backend's plan (``fp8_plan``: the ``scaled_mm`` variant,
  activation quantisation included, where ``fp8_gemm.scaled_mm_supported`` found this
  torch's block-scaled ``torch._scaled_mm`` usable, else the Triton w8a8 plan), the
  Triton w8a8 plan beside it (``fp8_triton_w8a8``) and a few other Triton configs; and
  ``torch._scaled_mm`` alone with DeepSeek's scales (1 x 128 activations, 128 x 128
  weights) on the same quantised operands (activations quantised outside the timing).
- Weights held as the model holds them: where the backend pads (``fp8_gemm.
  padded_rows`` when ``scaled_mm`` is usable: N 576 -> 640, the packed q_a | kv_a
  2112 -> 2176) every FP8 row runs on the padded weight with ``out_features`` = N
  (``held`` in the row), the bf16 GEMM on the real N.
- ``quant`` (M = 4096): ``quantize_act`` alone per K (one read of x in bf16, one write
  of the FP8 copy and its scales): ``of_bw`` = those bytes / copy bandwidth / time, the
  plan's tiling (``fp8_gemm.QUANT_TILE``) and, for K 7168 (or every K without
  ``--quick``), other tilings (rows, groups a program, warps).
- ``norm`` (M = 4096, 8192; ``--quick``: 4096): a block's pre-norm and its GEMM, as the
  model runs them, on the layers an RMSNorm precedes (q_a, kv_a, the packed q_a | kv_a,
  gate|up): ``bf16_norm_gemm`` (the Triton ``add_rms_norm``, then cuBLAS bf16),
  ``fp8_norm_then_gemm`` (the same norm, then ``fp8_linear``, which quantises x itself)
  and ``fp8_norm_quant_gemm`` (``add_rms_norm_quant``: the add, the norm and x's
  quantisation in one pass, then ``fp8_linear_quantized``); ``speedup`` = the bf16
  pair's time / the row's (target >= 1.4); the fused output must equal the unfused one
  bit for bit (else recorded, not timed).
Every FP8 output is checked against the torch reference first (a wrong one is
recorded, not timed). ``summary`` gives each target's worst shape and the misses.
"""

# ruff: noqa: BLE001  (a failing config is recorded, not fatal)

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import GIB, bench_us, copy_ceilings, environment, graph_us, save_json
from unikv.kernels.linear import elementwise, fp8_gemm, fp8_gemm_ref, norm_quant

BLOCK = (128, 128)
SHAPES = {  # (N, K): DeepSeek-V3 (hidden 7168) and Qwen3-8B / 32B layers
    "dsv3.q_a_proj": (1536, 7168),
    "dsv3.kv_a_proj_with_mqa": (576, 7168),
    "dsv3.qkv_a_proj": (2112, 7168),  # q_a | kv_a packed: the GEMM the model runs
    "dsv3.q_b_proj": (24576, 1536),
    "dsv3.o_proj": (7168, 16384),
    "dsv3.dense_gate_up": (36864, 7168),
    "dsv3.dense_down": (7168, 18432),
    "qwen3_8b.qkv": (6144, 4096),
    "qwen3_8b.gate_up": (24576, 4096),
    "qwen3_8b.down": (4096, 12288),
    "qwen3_32b.gate_up": (51200, 5120),
}
NORM_SHAPES = ("dsv3.q_a_proj", "dsv3.kv_a_proj_with_mqa", "dsv3.qkv_a_proj",
               "dsv3.dense_gate_up", "qwen3_8b.gate_up")  # fmt: skip
DECODE_M, PREFILL_M = (1, 4, 16), (4096, 8192)
DECODE_TARGET, PREFILL_TARGET = 0.80, 1.4
SCALED_MM = [False]  # set in main: the backend's probe (fp8_gemm.scaled_mm_supported)
P = fp8_gemm.Fp8Plan
# (block_n, warps, stages, target programs, least K a split): split by ``with_split``'s
# rule with that target and least K (the plan's: TARGET_PROGRAMS, MIN_K_PER_SPLIT); with
# the reduction in the launch, small-N shapes may gain from narrower tiles (N 576: 18
# tiles of 32 against 9 of 64) or from more splits (the plan's kv_a at M 1: 126 programs,
# under one wave of 132 SMs, capped by MIN_K_PER_SPLIT)
DECODE_CANDIDATES = [(32, 4, 4, 264, 512), (64, 4, 4, 264, 512), (128, 4, 3, 264, 512),
                     (64, 4, 6, 264, 512), (32, 2, 5, 264, 512), (32, 4, 4, 132, 512),
                     (32, 4, 4, 396, 256), (64, 4, 4, 264, 256), (32, 4, 4, 528, 256),
                     (64, 4, 4, 528, 256), (16, 4, 4, 264, 512)]  # fmt: skip
PREFILL_CANDIDATES = [P("w8a8", bm, bn, 128, 1, True, w, st) for bm, bn, w, st in
                      [(128, 128, 8, 3), (128, 128, 4, 4), (128, 256, 8, 3), (64, 128, 4, 4),
                       (128, 128, 8, 4), (256, 128, 8, 3)]]  # fmt: skip
QUANT_M = 4096
# (rows, groups, warps): 16, 32 or 64 elements a thread (the plan's: 16), in several shapes
QUANT_CANDIDATES = [(16, 2, 4), (16, 4, 4), (8, 4, 4), (4, 8, 4), (1, 16, 4), (1, 8, 1),
                    (2, 8, 2), (32, 1, 8), (8, 8, 8), (4, 4, 2)]  # fmt: skip


def operands(n: int, k: int, copies: int = 1):
    """``copies`` FP8 weights and their scales, each held in ``held_rows`` rows (zero
    rows and unit scales past n, as ``Fp8BlockLinear.finish_loading`` holds them)."""
    ws, ss, rows = [], [], held_rows(n, k)
    for _ in range(copies):
        w = torch.zeros(rows, k, device="cuda", dtype=torch.float8_e4m3fn)
        w[:n] = (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(w.dtype)
        ws.append(w)
        s = torch.ones(-(-rows // 128), -(-k // 128), device="cuda")
        s[: -(-n // 128)] = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-4 + 1e-5
        ss.append(s)
    return ws, ss


def held_rows(n: int, k: int) -> int:
    """The rows the backend holds an FP8 weight of n rows in (its ``fp8_padded_rows``)."""
    return fp8_gemm.padded_rows(n, k, BLOCK) if SCALED_MM[0] else n


def real(w: torch.Tensor, s: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unpadded weight and scales (the reference's operands)."""
    return w[:n], s[: -(-n // 128)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def with_split(cand: tuple, m: int, n: int, k: int) -> fp8_gemm.Fp8Plan:
    """A decode candidate (``DECODE_CANDIDATES``) as a plan: the plan's split rule for
    its tiles, with its own target programs and least K a split."""
    block_n, warps, stages, target, min_k = cand
    tiles = -(-m // 16) * -(-n // block_n)
    split = fp8_gemm.split_count(tiles, k, 128, target, min_k)
    return P("w8a16", 16, block_n, 128, split, True, warps, stages)


def launches(fn) -> int | None:
    """GPU kernels, memsets and copies one call of ``fn`` runs (after a warm call),
    counted by ``torch.profiler``; None where the profiler records no device events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    count = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    return count or None


def fp8_call(x, w, s, n: int, cfg):
    """The FP8 GEMM as the model runs it: the held weight, its real rows ``n``."""
    out = None if n == w.shape[0] else n
    return fp8_gemm.fp8_linear(x, w, s, block=BLOCK, config=cfg, out_features=out)


def fp8_time(graph: bool, x, ws, ss, n: int, cfg) -> float:
    """Microseconds per FP8 GEMM: over all the weight copies in one CUDA graph
    (decode), or ``do_bench``'s median of one (prefill)."""
    calls = [lambda w=w, s=s: fp8_call(x, w, s, n, cfg) for w, s in zip(ws, ss)]
    if graph:
        return graph_us(lambda: [c() for c in calls], 3, 20) / len(calls)
    return bench_us(calls[0])


def candidate_rows(base: dict, cands, x, ws, ss, want, graph: bool, extra) -> list[dict]:
    """One row per candidate config: checked against ``want``, then timed."""
    rows, n = [], base["N"]
    for label, cfg in cands:
        row = base | {"impl": f"fp8_{label}", "config": list(cfg), "held": ws[0].shape[0]}
        rows.append(row)
        try:
            got = fp8_call(x, ws[0], ss[0], n, cfg)
            row["rel_err"] = rel_err(got, want) if got.shape == want.shape else float("inf")
            if not row["rel_err"] < 2e-2:
                row["error"] = "differs from the reference; not timed"
                continue
            row |= extra(fp8_time(graph, x, ws, ss, n, cfg))
        except Exception as exc:
            row["error"] = repr(exc)[:400]
    return rows


def decode_shape(name: str, n: int, k: int, bw: float, quick: bool) -> list[dict]:
    count = max(2, -(-256 * 2**20 // (n * k)))
    ws, ss = operands(n, k, count)
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
             for _ in range(max(2, count // 2))]  # fmt: skip
    fp8_bytes = n * k + -(-n // 128) * ss[0].shape[1] * 4  # the rows read (pad rows: none)
    rows = []
    for m in DECODE_M:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = fp8_gemm_ref.fp8_linear(x, *real(ws[0], ss[0], n), block=BLOCK)
        bf16 = graph_us(lambda x=x: [F.linear(x, w) for w in dense], 3, 20) / len(dense)
        base = {"shape": name, "N": n, "K": k, "M": m}
        rows.append(base | {"impl": "bf16_cublas", "us": bf16, "of_bw": n * k * 2 / bw / bf16,
                            "launches": launches(lambda x=x: F.linear(x, dense[0]))})  # fmt: skip
        plan = fp8_gemm.plan(m, ws[0].shape[0], k, BLOCK, False, SCALED_MM[0])
        cands = [("plan", plan), ("plan_torch_sum", plan._replace(fused_split=False))]
        rules = [None, None] + ([] if quick else DECODE_CANDIDATES)
        cands += [("cand", with_split(c, m, n, k)) for c in rules[2:]]

        def extra(us, bf16=bf16):
            return {"us": us, "of_bw": fp8_bytes / bw / us, "vs_bf16": bf16 / us}

        got = candidate_rows(base, cands, x, ws, ss, want, True, extra)
        for row, (label, cfg), rule in zip(got, cands, rules):
            if rule is not None:
                row |= {"target": rule[3], "min_k": rule[4]}
            if not label.startswith("plan") or "us" not in row:
                continue
            try:
                row["launches"] = launches(lambda x=x, cfg=cfg: fp8_call(x, ws[0], ss[0], n, cfg))
            except Exception as exc:
                row["launches_error"] = repr(exc)[:400]
        rows += got
        print([r for r in rows if r["M"] == m], flush=True)
    return rows


def scaled_mm_fn(x, w, s, n: int):
    """torch._scaled_mm with 1x128 activation and 128x128 weight scales (DeepSeek's
    recipe) on the same FP8 operands (the held weight; its first n columns), or raise
    where this torch / GPU lacks it."""
    xq, xs = fp8_gemm.quantize_act(x, 128, m_major=True)  # M-major, as cuBLAS reads them
    return lambda: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.t(),
                                    out_dtype=torch.bfloat16)[:, :n]  # fmt: skip


def quant_rows(ks, quick: bool, bw: float) -> list[dict]:
    """``quantize_act`` alone on (QUANT_M, K) bf16, per K: the plan's tiling and others."""
    rows = []
    for k in ks:
        x = torch.randn(QUANT_M, k, device="cuda", dtype=torch.bfloat16)
        rq, rs = fp8_gemm_ref.quantize_act(x, 128)
        moved = QUANT_M * k * 3 + QUANT_M * -(-k // 128) * 4  # read 2 B, write 1 B + scales
        tiles = [None] + ([] if quick and k != 7168 else QUANT_CANDIDATES)
        for tile in tiles:
            row = {"shape": "quantize_act", "M": QUANT_M, "K": k, "impl": "quant",
                   "tile": list(tile or fp8_gemm.QUANT_TILE), "plan": tile is None}  # fmt: skip
            rows.append(row)
            try:
                xq, xs = fp8_gemm.quantize_act(x, 128, tile)
                same = torch.equal(xs, rs) and torch.equal(xq.view(torch.uint8),
                                                           rq.view(torch.uint8))  # fmt: skip
                if not same:
                    row["error"] = "differs from the reference; not timed"
                    continue
                us = bench_us(lambda x=x, tile=tile: fp8_gemm.quantize_act(x, 128, tile))
                row |= {"us": us, "GBps": moved / us / 1e3, "of_bw": moved / bw / us}
            except Exception as exc:
                row["error"] = repr(exc)[:400]
        print([r for r in rows if r["K"] == k], flush=True)
    return rows


def prefill_shape(name: str, n: int, k: int, quick: bool) -> list[dict]:
    ws, ss = operands(n, k)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    rows = []
    for m in PREFILL_M[:1] if quick else PREFILL_M:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        flops = 2 * m * n * k
        bf16 = bench_us(lambda x=x: F.linear(x, dense))
        base = {"shape": name, "N": n, "K": k, "M": m}
        rows.append(base | {"impl": "bf16_cublas", "us": bf16, "tflops": flops / bf16 / 1e6})
        want = fp8_gemm_ref.fp8_linear_w8a8(x, *real(ws[0], ss[0], n), block=BLOCK)
        cands = [("plan", fp8_gemm.plan(m, ws[0].shape[0], k, BLOCK, False, SCALED_MM[0]))]
        if SCALED_MM[0]:  # the Triton plan the scaled_mm variant replaces, beside it
            cands.append(("triton_w8a8", fp8_gemm.plan(m, n, k, BLOCK, False)))
        if not quick:
            cands += [("cand", c) for c in PREFILL_CANDIDATES]

        def extra(us, flops=flops, bf16=bf16):
            return {"us": us, "tflops": flops / us / 1e6, "speedup": bf16 / us}

        rows += candidate_rows(base, cands, x, ws, ss, want, False, extra)
        row = base | {"impl": "torch_scaled_mm_blockwise"}
        rows.append(row)
        try:
            fn = scaled_mm_fn(x, ws[0], ss[0], n)
            row["rel_err"] = rel_err(fn(), want)
            row |= extra(bench_us(fn))  # the GEMM alone (activations quantised outside)
        except Exception as exc:
            row["error"] = repr(exc)[:400]
        print([r for r in rows if r["M"] == m], flush=True)
    return rows


def norm_shape(name: str, n: int, k: int, quick: bool) -> list[dict]:
    """The pre-norm and the GEMM after it: bf16, FP8 unfused, FP8 with the norm
    quantising x (module docstring)."""
    (w,), (s,) = operands(n, k)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    norm_w = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    out = None if n == w.shape[0] else n
    rows = []
    for m in PREFILL_M[:1] if quick else PREFILL_M:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        quant = fp8_gemm.fp8_act_quant(m, w.shape[0], k, BLOCK, x.dtype, scaled_mm=SCALED_MM[0])
        base = {"shape": name, "N": n, "K": k, "M": m, "held": w.shape[0],
                "quant": None if quant is None else list(quant)}  # fmt: skip

        def bf16_pair(x=x, r=res):
            return F.linear(elementwise.add_rms_norm(x, r, norm_w, 1e-6)[0], dense)

        def unfused(x=x, r=res):
            h = elementwise.add_rms_norm(x, r, norm_w, 1e-6)[0]
            return fp8_gemm.fp8_linear(h, w, s, block=BLOCK, scaled_mm=SCALED_MM[0],
                                       out_features=out)  # fmt: skip

        def fused(x=x, r=res, q=quant):
            xq, xs, _ = norm_quant.add_rms_norm_quant(x, r, norm_w, 1e-6, group=q.group,
                                                      m_major=q.m_major)  # fmt: skip
            return fp8_gemm.fp8_linear_quantized(xq, xs, w, s, block=BLOCK, out_dtype=x.dtype,
                                                 out_features=out, scaled_mm=SCALED_MM[0])  # fmt: skip

        bf16 = bench_us(bf16_pair)
        rows.append(base | {"impl": "bf16_norm_gemm", "us": bf16})
        for label, fn in (("fp8_norm_then_gemm", unfused), ("fp8_norm_quant_gemm", fused)):
            row = base | {"impl": label}
            rows.append(row)
            try:
                if label == "fp8_norm_quant_gemm":
                    if quant is None:
                        row["error"] = "the plan does not quantise x at these rows"
                        continue
                    r1, r2 = res.clone(), res.clone()
                    same = torch.equal(unfused(r=r1), fused(r=r2)) and torch.equal(r1, r2)
                    if not same:
                        row["error"] = "differs from the unfused path; not timed"
                        continue
                row |= {"us": (us := bench_us(fn)), "speedup": bf16 / us}
            except Exception as exc:
                row["error"] = repr(exc)[:400]
        print([r for r in rows if r["M"] == m], flush=True)
    return rows


def norm_rows(quick: bool) -> list[dict]:
    rows = []
    for name in NORM_SHAPES:
        rows += norm_shape(name, *SHAPES[name], quick)
        torch.cuda.empty_cache()
    return rows


def decode_rows(bw: float, quick: bool) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        rows += decode_shape(name, n, k, bw, quick)
        torch.cuda.empty_cache()
    return rows


def prefill_rows(quick: bool) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        rows += prefill_shape(name, n, k, quick)
        torch.cuda.empty_cache()
    return rows


def quant_best(rows: list[dict]) -> dict:
    """Per K: the plan tiling's ``of_bw`` and the best tiling measured."""
    out = {}
    for r in rows:
        if "of_bw" not in r:
            continue
        at = out.setdefault(str(r["K"]), {"plan_of_bw": None, "best": None, "best_of_bw": 0.0})
        if r["plan"]:
            at["plan_of_bw"] = round(r["of_bw"], 3)
        if r["of_bw"] > at["best_of_bw"]:
            at["best"], at["best_of_bw"] = r["tile"], round(r["of_bw"], 3)
    return out


def summary(decode: list[dict], prefill: list[dict], norm: list[dict]) -> dict:
    def plan_rows(rows, key):
        return [r for r in rows if r["impl"] == "fp8_plan" and key in r]

    def best_rows(rows, key):
        best = {}
        for r in rows:
            if r["impl"].startswith("fp8") and key in r:
                at = (r["shape"], r["M"])
                if at not in best or r[key] > best[at][key]:
                    best[at] = r
        return list(best.values())

    out = {"decode_torch_sum_over_fused": {  # > 1: the in-launch reduction is faster
        f"{r['shape']}@{r['M']}": round(t["us"] / r["us"], 3)
        for r in decode for t in decode
        if r["impl"] == "fp8_plan" and t["impl"] == "fp8_plan_torch_sum" and "us" in r
        and "us" in t and (t["shape"], t["M"]) == (r["shape"], r["M"])
    }}  # fmt: skip
    for impl in ("fp8_norm_then_gemm", "fp8_norm_quant_gemm"):
        got = [r for r in norm if r["impl"] == impl and "speedup" in r]
        out[f"norm_{impl}_speedup"] = {
            "target": PREFILL_TARGET,
            "by_shape": {f"{r['shape']}@{r['M']}": round(r["speedup"], 3) for r in got},
            "misses": [f"{r['shape']}@{r['M']}" for r in got if r["speedup"] < PREFILL_TARGET],
            "errors": [
                f"{r['shape']}@{r['M']}" for r in norm if r["impl"] == impl and "error" in r
            ],
        }
    for label, rows, key, target in (("decode_of_bw", decode, "of_bw", DECODE_TARGET),
                                     ("prefill_speedup", prefill, "speedup", PREFILL_TARGET)):  # fmt: skip
        for kind, pick in (("plan", plan_rows), ("best_config", best_rows)):
            got = pick(rows, key)
            misses = [{"shape": r["shape"], "M": r["M"], key: round(r[key], 3)}
                      for r in got if r[key] < target]  # fmt: skip
            worst = min(got, key=lambda r: r[key]) if got else None
            out[f"{label}_{kind}"] = {
                "target": target,
                "worst": None if worst is None else {
                    "shape": worst["shape"], "M": worst["M"], key: worst[key]},
                "misses": misses,
                "measured": len(got),
            }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/fp8_gemm.json")
    parser.add_argument("--quick", action="store_true", help="the plan's configs only")
    args = parser.parse_args()
    ceilings = copy_ceilings(GIB, GIB // 16)
    bw = ceilings["d2d_GBps"] * 1e3  # bytes per us
    SCALED_MM[0] = fp8_gemm.scaled_mm_supported(torch.device("cuda"))
    print({"scaled_mm_supported": SCALED_MM[0]}, flush=True)
    decode = decode_rows(bw, args.quick)
    prefill = prefill_rows(args.quick)
    norm = norm_rows(args.quick)
    quant = quant_rows(sorted({k for _, k in SHAPES.values()}), args.quick, bw)
    payload = {"env": environment(), "ceilings": ceilings, "block": list(BLOCK),
               "scaled_mm_supported": SCALED_MM[0],
               "summary": summary(decode, prefill, norm), "decode": decode, "prefill": prefill,
               "norm": norm, "quant": quant}  # fmt: skip
    payload["summary"]["quant_best"] = quant_best(quant)
    print(payload["summary"])
    save_json(args.out, payload)
    if os.environ.get("OUT"):
        save_json(os.path.join(os.environ["OUT"], "bench_fp8_gemm.json"), payload)


if __name__ == "__main__":
    main()
