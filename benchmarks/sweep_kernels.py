"""Tuning sweeps for the kernels' launch configurations (run by bench_kernels.py
with ``--sections sweep_decode,...``). Each sweep times candidate configs on the
H200 with do_bench and CUDA-graph replay, installs the best one in the kernel
module for the rest of the process, and returns every number for the JSON."""

# ruff: noqa: B023, BLE001  (lambdas are timed at once; a failing peer is recorded, not fatal)

from __future__ import annotations

import math

import torch

from benchmarks.bench_kernels import (
    DIM,
    HKV,
    HQ,
    OPS,
    PagedKV,
    check,
    extend_inputs,
    run_decode,
    run_extend,
    sdpa_decode,
    sdpa_extend,
)
from benchmarks.common import bench_us, graph_us
from unikv import layout
from unikv.kernels.attention import decode as decode_mod
from unikv.kernels.attention import extend as extend_mod
from unikv.kernels.attention import store as store_mod
from unikv.kernels.tables import page_copy as copy_mod
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

DECODE_CONFIGS = [
    (32, 4, 2),
    (32, 4, 3),
    (32, 4, 4),
    (64, 4, 2),
    (64, 4, 3),
    (64, 8, 3),
    (16, 4, 4),
]
DECODE_SHAPES = [(1, 32768), (16, 4096), (64, 4096)]


def sweep_decode() -> dict:
    """Best (block_n, warps, stages) per page size by graph time over three shapes,
    then graph time against the number of splits."""
    out = {"tiles": {}, "best": {}, "splits": {}}
    for ps in (1, 16, 64):
        score = {c: 0.0 for c in DECODE_CONFIGS}
        for bsz, length in DECODE_SHAPES:
            kv = PagedKV(bsz, length, ps)
            q = torch.randn(bsz, HQ, DIM, device="cuda", dtype=torch.bfloat16)
            ref, _ = sdpa_decode(q, kv, timed=False)
            for cfg in DECODE_CONFIGS:
                check(f"decode {cfg}", run_decode(q, kv, cfg), ref)
                g = graph_us(lambda: run_decode(q, kv, cfg))
                b = bench_us(lambda: run_decode(q, kv, cfg))
                out["tiles"][f"ps{ps} {bsz}x{length} {cfg}"] = {"graph_us": g, "bench_us": b}
                score[cfg] += math.log(g)
            kv = None
        best = min(DECODE_CONFIGS, key=lambda c: score[c])
        decode_mod.CONFIGS[(128, ps)] = best
        out["best"][ps] = list(best)
        print("decode ps", ps, "best", best, flush=True)
    for bsz, length in DECODE_SHAPES:
        kv = PagedKV(bsz, length, 16)
        q = torch.randn(bsz, HQ, DIM, device="cuda", dtype=torch.bfloat16)
        auto = decode_mod.choose_num_splits(bsz, HKV, length, q.device)
        for ns in sorted({1, 2, 4, 8, 16, 33, 66, 132, auto}):
            out["splits"][f"{bsz}x{length} splits={ns}{' (auto)' if ns == auto else ''}"] = (
                graph_us(lambda: run_decode(q, kv, None, ns))
            )
        kv = None
    print("decode sweep", out, flush=True)
    return out


EXTEND_CONFIGS = [
    (128, 64, 4, 3),
    (128, 64, 4, 4),
    (128, 64, 4, 2),
    (128, 128, 4, 2),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (128, 32, 4, 3),
]


def sweep_extend() -> dict:
    out = {}
    kv = PagedKV(8, 4096 + 512, 16)
    q, q_indptr = extend_inputs(kv, 512)
    ref, _ = sdpa_extend(q, kv, 512)
    for cfg in EXTEND_CONFIGS:
        try:
            check(f"extend {cfg}", run_extend(q, q_indptr, kv, 512, cfg), ref)
            out[str(cfg)] = bench_us(lambda: run_extend(q, q_indptr, kv, 512, cfg))
        except Exception as exc:  # e.g. out of shared memory
            out[str(cfg)] = repr(exc)[:200]
    timed = [c for c in EXTEND_CONFIGS if isinstance(out[str(c)], float)]
    best = min(timed, key=lambda c: out[str(c)])
    extend_mod.CONFIGS[128] = best
    print("extend sweep", out, "best", best, flush=True)
    return {"us": out, "best": list(best)}


def sweep_store() -> dict:
    spec = MHASpec(1, HKV, DIM, dtype=torch.bfloat16)
    cfg = [SubPoolConfig("full", spec, page_size=16)]
    pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"full": 4096}), "cuda")
    sub = pool["full"]
    kc, vc = sub.views[0]
    tokens = torch.randperm(sub.usable_pages * 16, device="cuda")[:8192] + 16
    ids = layout.kernel_ids(tokens, sub.page_size, sub.blocks_per_page).int()
    k = torch.randn(8192, HKV, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    src = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    out = {"d2d_copy_64MiB_us": bench_us(lambda: dst.copy_(src))}
    results = {}
    for tile in (2048, 4096, 8192, 16384):
        for warps in (4, 8):
            store_mod.TILE_ELEMS, store_mod.NUM_WARPS = tile, warps
            results[(tile, warps)] = bench_us(lambda: OPS.store_kv(kc, vc, ids, k, v))
            out[f"tile={tile} warps={warps}"] = results[(tile, warps)]
    best = min(results, key=results.get)
    store_mod.TILE_ELEMS, store_mod.NUM_WARPS = best
    out["best"] = list(best)
    print("store sweep", out, flush=True)
    return out


def sweep_copy() -> dict:
    out, results = {}, {}
    for num, page_bytes in ((64, 1 << 20), (2048, 64 << 10)):
        buf = torch.randint(0, 256, ((2 * num + 2) * page_bytes,), dtype=torch.uint8, device="cuda")
        perm = torch.randperm(2 * num + 1, device="cuda") + 1
        src, dst = perm[:num], perm[num : 2 * num]
        for chunk in (16 << 10, 32 << 10, 64 << 10, 128 << 10):
            for block in (8 << 10, 16 << 10, 32 << 10):
                for warps in (4, 8):
                    if block > chunk:
                        continue
                    copy_mod.CHUNK_BYTES, copy_mod.BLOCK_BYTES, copy_mod.NUM_WARPS = (
                        chunk,
                        block,
                        warps,
                    )
                    us = bench_us(lambda: OPS.copy_pages(buf, src, dst, page_bytes, disjoint=True))
                    key = (chunk, block, warps)
                    results[key] = results.get(key, 0.0) + math.log(us)
                    out[f"{num}x{page_bytes} chunk={chunk} block={block} warps={warps}"] = us
        buf = None
    best = min(results, key=results.get)
    copy_mod.CHUNK_BYTES, copy_mod.BLOCK_BYTES, copy_mod.NUM_WARPS = best
    out["best"] = list(best)
    print("copy sweep", out, flush=True)
    return out
