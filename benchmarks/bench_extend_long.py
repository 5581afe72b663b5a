"""Long-prefill extend attention against torch SDPA, in one short device call (issue 15, item 4).

For each shape (B, cached, new) and page size (16, 1), bf16, Hq 32 / Hkv 8 / D 128
(``--dim 64 --shapes 16x0+512``: Llama-3.2-1B's heads and its e2e prefill chunk):
every paged candidate tile (``extend.CANDIDATES``) and, for prompts without a cached
prefix, every fresh-path candidate (``extend_fresh.CANDIDATES``: contiguous K/V,
pointer or TMA loads), the engine's op as the runner calls it ("engine") and, for one
prompt, ``extend_sdpa``'s SDPA op (cuDNN; KV heads grouped by ``enable_gqa`` or
repeated) are checked against SDPA (max abs error) and timed with CUDA
events (median of ``--reps`` after warm-up). SDPA runs on contiguous, head-repeated
K/V, causal (lower-right for a prefix), once with the flash backend forced (the
ratio's denominator) and once with torch's default dispatch. Ratios are
``sdpa_ms / ours_ms`` (> 1: faster than SDPA). A candidate that fails to compile or
gives a wrong result is recorded and left out of the picks. The JSON ends with
"install": the tiles to put in ``extend.CONFIGS[D]`` and ``extend_fresh.CONFIGS[D]``
(best geometric-mean ratio over the shapes). Run: ``python benchmarks/bench_extend_long.py``.
"""

# ruff: noqa: B023, BLE001  (lambdas are timed at once; a failing candidate is recorded)

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_kernels import DIM, HKV, HQ, OPS, PagedKV
from benchmarks.common import environment, save_json
from unikv.kernels.attention import extend as extend_mod
from unikv.kernels.attention import fresh as fresh_mod
from unikv.kernels.attention import sdpa as extend_sdpa

SHAPES = [(1, 0, 16384), (8, 4096, 512), (1, 0, 4096)]  # the headline shape first
PAGE_SIZES = (16, 1)
TOL = 3e-2  # bf16 output, max abs error against SDPA


def time_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def sdpa_fn(q, kv: PagedKV, cached: int, new: int):
    """SDPA over contiguous, head-repeated (B, Hq, L, D) K/V -> (B, Hq, new, D)."""
    from torch.nn.attention.bias import causal_lower_right

    qb = q.view(kv.bsz, new, HQ, q.shape[-1]).transpose(1, 2)
    k = kv.k.repeat_interleave(HQ // HKV, 1)
    v = kv.v.repeat_interleave(HQ // HKV, 1)
    if cached == 0:
        fn = lambda: F.scaled_dot_product_attention(qb, k, v, is_causal=True)
    else:
        mask = causal_lower_right(new, kv.length)
        fn = lambda: F.scaled_dot_product_attention(qb, k, v, attn_mask=mask)
    return fn


def sdpa_times(fn, reps: int) -> tuple[torch.Tensor, dict]:
    """SDPA's output (T, Hq, D) with the flash backend, and its times (reps > 0)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return fn()

    ref = flash()
    out = (
        {"sdpa_flash_ms": time_ms(flash, reps), "sdpa_default_ms": time_ms(fn, reps)}
        if reps
        else {}
    )
    return ref.transpose(1, 2).reshape(-1, HQ, ref.shape[-1]), out


def run_candidate(fn, ref, sdpa: dict, reps: int, flops: int) -> dict:
    try:
        err = (fn().float() - ref.float()).abs().max().item()
        if not err <= TOL:
            return {"error": f"max abs error {err} > {TOL}", "max_abs_err": err}
        ms = time_ms(fn, reps)
    except Exception as exc:  # e.g. out of shared memory, no TMA: recorded, not fatal
        return {"error": repr(exc)[:300]}
    return {
        "ms": ms,
        "TFLOPs": flops / ms / 1e9,
        "max_abs_err": err,
        "vs_sdpa": sdpa["sdpa_flash_ms"] / ms,
        "vs_sdpa_default": sdpa["sdpa_default_ms"] / ms,
    }


def sweep(cands, make_fn, ref, sdpa, flops, args, t0, label) -> dict:
    rows = {}
    for cfg in cands:
        if time.perf_counter() - t0 > args.budget_s:
            rows[str(cfg)] = {"error": "skipped: time budget"}
            continue
        rows[str(cfg)] = row = run_candidate(make_fn(cfg), ref, sdpa, args.reps, flops)
        print(f"  {label} {cfg}: {row}", flush=True)
    return rows


def best_of(rows: dict) -> tuple[str, float] | None:
    timed = {c: r["vs_sdpa"] for c, r in rows.items() if "ms" in r}
    return max(timed.items(), key=lambda kv: kv[1]) if timed else None


def bench_shape(bsz, cached, new, args, t0) -> dict:
    dim = args.dim
    res = {"B": bsz, "cached": cached, "new": new, "dim": dim, "paged": {}}
    flops = 4 * dim * HQ * bsz * (cached * new + new * (new + 1) // 2)
    for i, ps in enumerate(PAGE_SIZES):
        kv = PagedKV(bsz, cached + new, ps, dim=dim)
        q = torch.randn(bsz * new, HQ, dim, device="cuda", dtype=torch.bfloat16)
        q_indptr = torch.arange(0, bsz + 1, device="cuda", dtype=torch.int32) * new
        # SDPA sees contiguous K/V: the page size does not matter to it, time it once
        ref, sdpa = sdpa_times(sdpa_fn(q, kv, cached, new), args.reps if i == 0 else 0)
        if i == 0:
            res.update(sdpa, sdpa_flash_TFLOPs=flops / sdpa["sdpa_flash_ms"] / 1e9)
        sdpa = {k: res[k] for k in ("sdpa_flash_ms", "sdpa_default_ms")}

        def paged(cfg):
            return lambda: OPS.extend_attention(
                q, kv.k_cache, kv.v_cache, kv.block_table, q_indptr, kv.seq_lens,
                max_q_len=new, page_size=ps, sm_scale=dim**-0.5, config=cfg,
            )  # fmt: skip

        res["paged"][f"ps{ps}"] = sweep(
            extend_mod.CANDIDATES,
            paged,
            ref,
            sdpa,
            flops,
            args,
            t0,
            f"{bsz}x({cached}+{new}) ps{ps}",
        )
        if cached == 0 and i == 0:  # the fresh path never reads the pool
            k_new = kv.k.transpose(1, 2).reshape(-1, HKV, dim).contiguous()  # (T, Hkv, D)
            v_new = kv.v.transpose(1, 2).reshape(-1, HKV, dim).contiguous()

            def fresh(cfg):
                return lambda: OPS.extend_attention(
                    q, kv.k_cache, kv.v_cache, kv.block_table, q_indptr, kv.seq_lens,
                    max_q_len=new, page_size=ps, sm_scale=dim**-0.5, config=cfg,
                    fresh_kv=(k_new, v_new),
                )  # fmt: skip

            res["fresh"] = sweep(
                fresh_mod.CANDIDATES,
                fresh,
                ref,
                sdpa,
                flops,
                args,
                t0,
                f"{bsz}x({cached}+{new}) fresh",
            )
            # the engine's op as the runner calls it, with the step's plan (one prompt:
            # SDPA where enabled; a long one: the Gluon kernel on sm_90)
            launch = OPS.plan_extend(bsz, max_q_len=new, head_dim=dim).launch
            engine = lambda: OPS.extend_attention(
                q, kv.k_cache, kv.v_cache, kv.block_table, q_indptr, kv.seq_lens,
                max_q_len=new, page_size=ps, sm_scale=dim**-0.5, fresh_kv=(k_new, v_new),
                **launch,
            )  # fmt: skip
            res["engine"] = run_candidate(engine, ref, sdpa, args.reps, flops)
            fits = extend_sdpa.takes_sdpa(q, (k_new, v_new), new, 0, None, 0.0, None)
            res["engine"]["path"] = "sdpa" if extend_sdpa.ENABLED and fits else "triton"
            print(f"  {bsz}x({cached}+{new}) engine: {res['engine']}", flush=True)
            for repeat in (False, True) if fits else ():  # the SDPA op, enabled or not
                fn = lambda: extend_sdpa.fresh_attention(
                    q, k_new, v_new, sm_scale=dim**-0.5, repeat=repeat
                )
                name = "sdpa_op_repeat" if repeat else "sdpa_op_gqa"
                res[name] = run_candidate(fn, ref, sdpa, args.reps, flops)
                print(f"  {bsz}x({cached}+{new}) {name}: {res[name]}", flush=True)
        kv = q = ref = None
        torch.cuda.empty_cache()
    res["best"] = {
        name: best_of(rows)
        for name, rows in [*res["paged"].items(), ("fresh", res.get("fresh", {}))]
        if best_of(rows)
    }
    return res


def summary(name: str, res: dict) -> str:
    parts = [
        f"{name}: SDPA flash {res['sdpa_flash_ms']:.3f} ms (default {res['sdpa_default_ms']:.3f})"
    ]
    for path, pick in res["best"].items():
        rows = res["fresh"] if path == "fresh" else res["paged"][path]
        parts.append(f"{path} {pick[0]} {rows[pick[0]]['ms']:.3f} ms = {pick[1]:.2f}x SDPA")
    engine = res.get("engine", {})
    if "ms" in engine:
        parts.append(f"engine ({engine['path']}) {engine['ms']:.3f} ms = "
                     f"{engine['vs_sdpa_default']:.2f}x SDPA default")  # fmt: skip
    return " | ".join(parts)


def install(results: dict, dim: int = 128) -> dict:
    """Per path, the candidate with the best geometric-mean ratio over every row it
    ran in (a candidate missing or failing anywhere is out)."""
    picks = {}
    for path, table, cands in (
        ("paged", f"extend.CONFIGS[{dim}]", extend_mod.CANDIDATES),
        ("fresh", f"extend_fresh.CONFIGS[{dim}]", fresh_mod.CANDIDATES),
    ):
        tables = [
            rows
            for res in results.values()
            for rows in (res["paged"].values() if path == "paged" else [res.get("fresh")])
            if rows
        ]
        score = {}
        for cfg in map(str, cands):
            ratios = [rows.get(cfg, {}).get("vs_sdpa") for rows in tables]
            if tables and all(ratios):
                score[cfg] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        if score:
            best = max(score, key=score.get)
            picks[table] = {"config": best, "geomean_vs_sdpa": score[best], "all": score}
    return picks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=70.0, help="skip candidates after this")
    parser.add_argument("--dim", type=int, default=DIM, help="head dim (Hq 32, Hkv 8)")
    parser.add_argument(
        "--shapes",
        default=",".join(f"{b}x{c}+{n}" for b, c, n in SHAPES),
        help="BxCACHED+NEW,... (requests x (cached + new tokens))",
    )
    parser.add_argument("--out", default="benchmarks/results/extend_long_h200.json")
    args = parser.parse_args()
    shapes = [tuple(map(int, re.split(r"[x+]", one))) for one in args.shapes.split(",")]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    payload = {"env": environment(), "reps": args.reps, "tol": TOL, "dim": args.dim, "shapes": {}}
    for bsz, cached, new in shapes:
        name = f"{bsz}x({cached}+{new})"
        payload["shapes"][name] = bench_shape(bsz, cached, new, args, t0)
        payload["install"] = install(payload["shapes"], args.dim)
        payload["elapsed_s"] = time.perf_counter() - t0
        save_json(args.out, payload)  # after every shape: a cut-off run keeps what it has
    for name, res in payload["shapes"].items():
        print("SUMMARY", summary(name, res), flush=True)
    for table, pick in payload["install"].items():
        print(f"INSTALL {table} = {pick['config']}  (geomean {pick['geomean_vs_sdpa']:.3f}x SDPA)")


if __name__ == "__main__":
    main()
