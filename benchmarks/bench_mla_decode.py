"""Benchmark the MLA decode kernel (``unikv/kernels/mla/decode.py``) against the current
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
The step with its latent store (each request's last row, rewritten as it is): the store
then the new kernel (``store_two_graph_us``) against ``store_mla_attention``, the store
inside the launch (``store_one_graph_us``), both graph replays; ``store_one_vs_two`` =
two / one (> 1: one launch is faster).
JSON: ``--out`` and ``$OUT/<name>``, rewritten after every shape.

``--sweep`` (alone, ``--budget`` s of timing, < 120 s on an H200 with cold caches): at
each of ``--heads`` (128; 64 and 16 too: DeepSeek-V2-Lite's 16, a TP shard's 64),
B {1, 32, 128} x L {1k, 8k, 32k} on page 64 and B 32 x L 8k on page 1, every candidate
of SWEEP_CANDIDATES[heads bucket] (variant x BLOCK_N x warps x stages; ``mla_decode_plan``)
under both split rules, each checked against the torch reference on the first
REF_REQUESTS requests before it is timed (CUDA-graph replay), FlashInfer fa2 / fa3 on
the same bytes. Compile or shared-memory failures, wrong outputs and budget cuts are
recorded per candidate. Writes ``mla_decode_sweep_h200.json``; prints the best
candidate per shape with its ratios (FlashInfer us / ours: > 1 is faster) and the
``mla_decode_plan.TABLE`` entries it suggests.
"""

# ruff: noqa: B023, BLE001  (lambdas are timed at once; a failing shape is recorded, not fatal)

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_mla as peer
from benchmarks.common import bench_us, copy_ceilings, environment, graph_us, save_json
from unikv.kernels.mla import decode as mla_decode
from unikv.kernels.mla import decode_fused as mla_decode_fused
from unikv.kernels.mla import plan as mla_decode_plan
from unikv.kernels.mla import prefill as mla
from unikv.kernels.mla import ref as mla_ref
from unikv.kernels.runtime.checks import device_sms

QUICK = [(1, 32768, 128), (32, 4096, 128), (128, 8192, 128), (1, 32768, 16), (128, 1024, 16),
         (128, 8192, 16)]  # fmt: skip


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
            bsz, heads, peer.RANK, max_len, torch.bfloat16, self.q_lat.device, page_size
        )
        self.out = torch.empty_like(self.q_lat)
        self.workspace = torch.empty(numel, dtype=torch.float32, device="cuda")
        # the step's new rows: each request's last row as stored (the pool keeps its bytes)
        self.write_ids = kv.ids[:, -1].contiguous()
        rows = kv.cache[self.write_ids]
        self.latent, self.rope = rows[:, : peer.RANK].clone(), rows[:, peer.RANK :].clone()

    def args(self):
        kv = self.kv
        return (self.q_lat, self.q_rope, kv.cache, kv.block_table, self.q_indptr, kv.seq_lens)

    def new(self):
        """The new kernel as planned, into the caller buffers."""
        return mla_decode.mla_attention(
            *self.args(), max_q_len=1, page_size=self.kv.page_size, sm_scale=peer.SCALE,
            config=self.config, num_splits=self.splits, out=self.out, workspace=self.workspace,
        )  # fmt: skip

    def two_launches(self):
        """The latent store, then the new kernel (the engine's decode before issue 38)."""
        mla.store_mla(self.kv.cache, self.write_ids, self.latent, self.rope)
        return self.new()

    def one_launch(self):
        """``store_mla_attention``: the store inside the new kernel's launch."""
        kv = self.kv
        return mla_decode.store_mla_attention(
            kv.cache, self.write_ids, self.q_lat, self.q_rope, self.latent, self.rope,
            kv.block_table, self.q_indptr, kv.seq_lens, max_q_len=1, page_size=kv.page_size,
            sm_scale=peer.SCALE, config=self.config, num_splits=self.splits, out=self.out,
            workspace=self.workspace,
        )  # fmt: skip

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
    got = peer.agreement(step.one_launch(), ours)  # the store rewrites the rows as they are
    row["err_store_one_launch"] = got["rel_err"]
    assert got["ok"], f"store_mla_attention disagrees with the new kernel: {got}"
    row.update(store_two_graph_us=graph_us(step.two_launches),
               store_one_graph_us=graph_us(step.one_launch))  # fmt: skip
    row["store_one_vs_two"] = row["store_two_graph_us"] / row["store_one_graph_us"]
    return row


# -- --sweep: every candidate at 128 heads (the lead fills mla_decode_plan.TABLE) ------

SWEEP_BATCHES, SWEEP_LENS, SWEEP_PAGE1 = (1, 32, 128), (1024, 8192, 32768), (32, 8192)
# heads bucket -> [(name, block_h, num_v, block_n, num_warps, num_stages, variant)], most
# promising first (a budget cut drops the tail of each shape's list); the first entry is
# the bucket's kernel before any sweep installed one ("today": best_vs_today's base)
SWEEP_CANDIDATES = {
    128: [
        ("wide128", 128, 2, 32, 8, 2, "split"),
        ("fused_n32_s2", 64, 1, 32, 8, 2, "fused"),
        ("fused_n64_s2", 64, 1, 64, 8, 2, "fused"),
        ("tma_n32_s2", 64, 1, 32, 8, 2, "tma"),
        ("tma_n64_s2", 64, 1, 64, 8, 2, "tma"),
        ("fused_n32_s3", 64, 1, 32, 8, 3, "fused"),
        ("tma_n32_s3", 64, 1, 32, 8, 3, "tma"),
        ("wide64", 64, 2, 32, 4, 2, "split"),
    ],
    64: [  # installed at cac53ea: tma_n64_s2 (page 64), fused_n64_s2 (pages 1 and 16)
        ("tma_n64_s2", 64, 1, 64, 8, 2, "tma"),
        ("fused_n64_s2", 64, 1, 64, 8, 2, "fused"),
        ("wide64", 64, 2, 32, 4, 2, "split"),
        ("tma_n64_s3", 64, 1, 64, 8, 3, "tma"),
    ],
    16: [  # 16 heads: mma.sync tiles (wgmma needs 64 rows); installed at cac53ea: the first
        ("fused16_n64_w4", 16, 1, 64, 4, 2, "fused"),
        ("narrow90", 16, 1, 64, 8, 2, "split"),
        ("fused16_n32_w4", 16, 1, 32, 4, 2, "fused"),
        ("fused16_n64_w4_s3", 16, 1, 64, 4, 3, "fused"),
        ("tma16_n64_w4", 16, 1, 64, 4, 2, "tma"),
        ("fused16_n64_w8", 16, 1, 64, 8, 2, "fused"),
    ],
}
# split rules x programs an SM holds (``Config.ctas_per_sm``: ``fill`` makes that many
# programs per SM; more bytes in flight where the heads are few and the kernel reads)
SWEEP_RULES = (("model", 1), ("fill", 1), ("fill", 2), ("fill", 4))
PAGE1_COUNT = 3  # page 1 times the first candidates of the bucket's list only
REF_REQUESTS = 2  # the torch reference checks the first requests of every shape
DEVICE, DTYPE = "cuda", torch.bfloat16  # a CPU dry run of the sweep logic may change them


class Prefix:
    """The first ``length`` tokens of every request of a LatentPool: what
    ``peer.flashinfer_runner`` reads (cache, block_table, seq_lens, page_size)."""

    def __init__(self, kv: peer.LatentPool, length: int):
        self.cache, self.page_size, self.bsz, self.length = kv.cache, kv.page_size, kv.bsz, length
        self.block_table = kv.block_table[:, : -(-length // kv.page_size)].contiguous()
        self.seq_lens = torch.full_like(kv.seq_lens, length)
        self.parent = kv

    def flashinfer_cache(self):
        return self.parent.flashinfer_cache()


def timed(fn) -> tuple[float, str]:
    """(us, how): CUDA-graph replay, or eager when capture fails."""
    try:
        return graph_us(fn, warmup=5, rep=25), "graph"
    except Exception:
        return bench_us(fn, warmup=5, rep=25), "eager"


def candidate_rows(kv: Prefix, q_lat, q_rope, candidates, t_end) -> list:
    """Every candidate x split rule on one shape: checked against the torch reference on
    the first REF_REQUESTS requests (nothing timed before), then timed. Failures
    (compile, shared memory, wrong output) and budget cuts are recorded, never fatal."""
    q_indptr = torch.arange(kv.bsz + 1, dtype=torch.int32, device=DEVICE)
    n = min(kv.bsz, REF_REQUESTS)
    ref = mla_ref.mla_attention(q_lat[:n], q_rope[:n], kv.cache, kv.block_table[:n],
                                q_indptr[: n + 1], kv.seq_lens[:n], max_q_len=1,
                                page_size=kv.page_size, sm_scale=peer.SCALE)  # fmt: skip
    sms, rows, seen = device_sms(q_lat.device), [], {}
    args = (q_lat, q_rope, kv.cache, kv.block_table, q_indptr, kv.seq_lens)
    for name, *tile, variant in candidates:
        for rule, ctas in SWEEP_RULES:
            token_ns = 45.0 if variant != "split" else 70.0
            cfg = mla_decode.Config(*tile, ctas, token_ns, variant, rule)
            splits = mla_decode.choose_num_splits(kv.bsz, q_lat.shape[1], peer.RANK,
                                                  kv.block_table.shape[1] * kv.page_size, cfg,
                                                  sms)  # fmt: skip
            row = {"candidate": name, "config": list(cfg), "splits": splits}
            rows.append(row)
            if (name, splits) in seen:  # the other rule gave the same count: same kernel
                row.update({k: v for k, v in seen[name, splits].items() if k not in row})
                continue
            seen[name, splits] = row
            if variant == "tma" and not mla_decode_fused.tma_ok(
                kv.cache, peer.RANK, kv.page_size, cfg.block_n
            ):
                row["error"] = "tma needs page_size % block_n == 0 and aligned rows"
                continue
            if time.time() > t_end:
                row["error"] = "skipped: time budget"
                continue
            out = torch.empty_like(q_lat)
            ws = torch.empty(mla_decode.workspace_numel(kv.bsz, q_lat.shape[1], peer.RANK,
                                                        splits), device=DEVICE)  # fmt: skip
            kw = {"max_q_len": 1, "page_size": kv.page_size, "sm_scale": peer.SCALE,
                  "config": cfg, "num_splits": splits, "out": out, "workspace": ws}  # fmt: skip
            try:
                got = mla_decode.mla_attention(*args, **kw)
                check = peer.agreement(got[:n], ref)
                row.update(err_vs_reference=check["rel_err"], max_abs_err=check["max_abs_err"])
                assert check["ok"] and torch.isfinite(got).all(), "disagrees with the reference"
                row["us"], row["timing"] = timed(lambda: mla_decode.mla_attention(*args, **kw))
            except Exception as exc:
                row["error"] = repr(exc)[:300]
    return rows


def sweep_shape(fi, kv: Prefix, heads: int, t_end: float, candidates) -> dict:
    """One shape: FlashInfer fa2 / fa3 (checked against the reference via our best
    agreeing output) and every candidate; the best candidate and its ratios."""
    q_lat = torch.randn(kv.bsz, heads, peer.RANK, device=DEVICE, dtype=DTYPE)
    q_rope = torch.randn(kv.bsz, heads, peer.ROPE, device=DEVICE, dtype=DTYPE)
    shape = {"B": kv.bsz, "L": kv.length, "H": heads, "page_size": kv.page_size}
    shape["candidates"] = rows = candidate_rows(kv, q_lat, q_rope, candidates, t_end)
    today_name, *today_tile, today_variant = candidates[0]
    today_cfg = mla_decode.Config(*today_tile, 1, 70.0, today_variant)
    q_indptr = torch.arange(kv.bsz + 1, dtype=torch.int32, device=DEVICE)
    ours = mla_decode.mla_attention(q_lat, q_rope, kv.cache, kv.block_table, q_indptr,
                                    kv.seq_lens, max_q_len=1, page_size=kv.page_size,
                                    sm_scale=peer.SCALE, config=today_cfg)  # fmt: skip
    for backend, run in peer.check_peers(fi, shape, q_lat, q_rope, kv, q_indptr, ours,
                                         causal=False).items():  # fmt: skip
        try:
            shape[f"flashinfer_{backend}_us"], _ = timed(run)
        except Exception as exc:
            shape[f"flashinfer_{backend}_error"] = repr(exc)[:300]
    timed_rows = [r for r in rows if "us" in r]
    if timed_rows:
        best = min(timed_rows, key=lambda r: r["us"])
        shape.update(best=best["candidate"], best_config=best["config"], best_us=best["us"])
        today = next((r["us"] for r in timed_rows if r["candidate"] == today_name), None)
        shape["best_vs_today"] = today / best["us"] if today else None
        for backend in ("fa2", "fa3"):
            fi_us = shape.get(f"flashinfer_{backend}_us")
            for r in timed_rows:
                r[f"vs_{backend}"] = fi_us / r["us"] if fi_us else None
            shape[f"best_vs_{backend}"] = best.get(f"vs_{backend}")
    return shape


def suggest(shapes: list) -> dict:
    """Per (heads bucket, page bucket): the config with the best geometric-mean speed
    over the shapes where it ran (against the fastest candidate of each shape)."""
    groups: dict = {}
    for shape in shapes:
        timed_rows = [r for r in shape.get("candidates", []) if "us" in r]
        if not timed_rows:
            continue
        fastest = min(r["us"] for r in timed_rows)
        key = str((mla_decode_plan.heads_bucket(shape["H"]),
                   mla_decode_plan.page_bucket(shape["page_size"])))  # fmt: skip
        for r in timed_rows:  # a candidate under one split rule
            cand = groups.setdefault(key, {}).setdefault((r["candidate"], r["config"][-1]), [])
            cand.append((fastest / r["us"], r["config"]))
    out = {}
    for key, scores in groups.items():
        most = max(len(v) for v in scores.values())  # candidates that ran on every shape
        geo = {
            c: math.exp(sum(math.log(x) for x, _ in v) / len(v))
            for c, v in scores.items()
            if len(v) == most
        }
        best = max(geo, key=geo.get)
        out[key] = {"candidate": best[0], "config": scores[best][0][1],
                    "geomean_of_fastest": geo[best], "shapes": most}  # fmt: skip
    return out


def run_sweep(fi, result: dict, outs: list, budget_s: float, heads_list=(128,)) -> None:
    """Per head count, page 64: batch x context; page 1 at one shape. JSON after every
    shape. The budget is shared: the later head counts get what the earlier left."""
    t_end = time.time() + budget_s
    shapes = result["sweep"] = []
    for heads in heads_list:
        candidates = SWEEP_CANDIDATES[mla_decode_plan.heads_bucket(heads)]
        jobs = [(b, 64, SWEEP_LENS, candidates) for b in SWEEP_BATCHES]
        jobs.append((SWEEP_PAGE1[0], 1, (SWEEP_PAGE1[1],), candidates[:PAGE1_COUNT]))
        for bsz, ps, lens, cands in jobs:
            pool = peer.LatentPool(bsz, max(lens), ps)
            for length in lens:
                try:
                    shape = sweep_shape(fi, Prefix(pool, length), heads, t_end, cands)
                except Exception as exc:  # keep the other shapes' numbers
                    shape = {"B": bsz, "L": length, "H": heads, "page_size": ps,
                             "error": repr(exc)[:1000]}  # fmt: skip
                shapes.append(shape)
                print(f"sweep H={heads} B={bsz} L={length} ps={ps}: best {shape.get('best')} "
                      f"{shape.get('best_us', float('nan')):.1f} us, vs fa3 "
                      f"{shape.get('best_vs_fa3')}, vs fa2 {shape.get('best_vs_fa2')}, vs today "
                      f"{shape.get('best_vs_today')}", flush=True)  # fmt: skip
                result["suggested_table"] = suggest(shapes)
                for out in outs:
                    save_json(out, result)
            pool = None
            torch.cuda.empty_cache()
    for key, entry in result["suggested_table"].items():
        print(f"suggest mla_decode_plan.TABLE[{key}] = Config{tuple(entry['config'])}  "
              f"(geomean {entry['geomean_of_fastest']:.3f} of the fastest)", flush=True)  # fmt: skip


def decode_section(fi, result: dict, outs: list, quick: bool) -> None:
    """The planned kernel against the current one and FlashInfer on bench_mla's shapes."""
    result["ceilings"] = ceil = copy_ceilings()
    if quick:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--backends", default="fa2,fa3", help="FlashInfer backends ('' for none)")
    parser.add_argument("--budget", type=float, default=100.0, help="--sweep: seconds of timing")
    parser.add_argument("--heads", default="128", help="--sweep: head counts, e.g. 128,64,16")
    parser.add_argument("--out", default=None, help="default benchmarks/results/mla_decode_"
                        "h200.json (mla_decode_sweep_h200.json with --sweep)")  # fmt: skip
    args = parser.parse_args()
    t0 = time.time()
    if args.out is None:
        name = "mla_decode_sweep_h200.json" if args.sweep else "mla_decode_h200.json"
        args.out = f"benchmarks/results/{name}"
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
    if args.sweep:  # the sweep alone (one short device call)
        heads = tuple(int(h) for h in args.heads.split(","))
        run_sweep(fi, result, outs, args.budget - (time.time() - t0), heads)
    else:
        decode_section(fi, result, outs, args.quick)
    result["wall_s"] = time.time() - t0
    print(f"[done at {result['wall_s']:.0f}s]", flush=True)
    for out in outs:
        save_json(out, result)


if __name__ == "__main__":
    main()
