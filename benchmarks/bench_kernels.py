"""Benchmark unikv's Triton kernels against ceilings and peers (protocol: README.md, Results).

    python benchmarks/bench_kernels.py [--quick] [--out benchmarks/results/kernels_h200.json]

Sections: copy ceilings; decode (GQA 32/8, D128, bf16; pages 1/16/64) vs SDPA on
contiguous KV, FlexAttention (contiguous) and FlashInfer paged decode over the
same pool bytes; extend vs FlashInfer paged prefill (FA2/FA3) and SDPA; KV store;
page copy. Every output is checked against a reference before it is timed.
"""

# ruff: noqa: B023, BLE001  (lambdas are timed at once; a failing peer is recorded, not fatal)

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import bench_us, copy_ceilings, environment, graph_us, save_json
from unikv import layout
from unikv.kernels import get_backend
from unikv.kernels.attention import extend as extend_mod
from unikv.kernels.attention.ref import copy_pages as torch_copy_pages
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

OPS = get_backend("cuda")
DECODE_SHAPES = [(1, 32768), (16, 4096), (64, 4096), (256, 1024), (128, 8192)]
HQ, HKV, DIM = 32, 8, 128


def try_flashinfer():
    try:
        import flashinfer

        return flashinfer
    except Exception as exc:  # recorded in the JSON, not hidden
        print(f"flashinfer unavailable: {exc!r}")
        return None


class PagedKV:
    """One-layer pool holding B requests of L tokens on randomly permuted pages,
    plus the same K/V in contiguous (B, H, L, D) form for the ceilings."""

    def __init__(self, bsz: int, length: int, page_size: int, heads: int = HKV, dim: int = DIM):
        spec = MHASpec(1, heads, dim, dtype=torch.bfloat16)
        pages = math.ceil(length / page_size)
        cfg = [SubPoolConfig("full", spec, page_size=page_size)]
        pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"full": bsz * pages}), "cuda")
        sub = pool["full"]
        perm = torch.randperm(sub.usable_pages, device="cuda")[: bsz * pages] + sub.first_page
        self.block_table = (perm.view(bsz, pages) * sub.blocks_per_page).int()
        self.k_cache, self.v_cache = sub.views[0]
        pos = torch.arange(length, device="cuda")
        ids = self.block_table[:, pos // page_size].long() * page_size + pos % page_size  # (B, L)
        self.k = torch.randn(bsz, heads, length, dim, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)
        self.k_cache[ids.flatten()] = self.k.transpose(1, 2).flatten(0, 1)  # naive indexed write
        self.v_cache[ids.flatten()] = self.v.transpose(1, 2).flatten(0, 1)
        self.seq_lens = torch.full((bsz,), length, dtype=torch.int32, device="cuda")
        self.pool, self.page_size, self.bsz, self.length = pool, page_size, bsz, length

    def flashinfer_table(self):
        return OPS.export_flashinfer(self.block_table, self.seq_lens, page_size=self.page_size)

    def paged_cache(self):
        ps = self.page_size
        return (
            self.k_cache.view(-1, ps, *self.k_cache.shape[1:]),
            self.v_cache.view(-1, ps, *self.v_cache.shape[1:]),
        )


def check(name, got, want, tol=3e-2):
    err = (got.float() - want.float()).abs().max().item()
    if not err <= tol:
        raise AssertionError(f"{name}: max abs error {err} > {tol}")
    return err


def sdpa_decode(q, kv: PagedKV, timed: bool = True):
    """The faster of SDPA with enable_gqa and SDPA with the query group as rows."""
    bsz = q.shape[0]
    q_rows = q.view(bsz, HKV, HQ // HKV, DIM)  # group rows of one KV head

    def gqa():
        return F.scaled_dot_product_attention(q.view(bsz, HQ, 1, DIM), kv.k, kv.v, enable_gqa=True)

    def rows():
        return F.scaled_dot_product_attention(q_rows, kv.k, kv.v)

    ref = rows().reshape(bsz, HQ, DIM)
    return ref, min(bench_us(gqa), bench_us(rows)) if timed else None


def flex_decode_us(q, kv: PagedKV):
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    qf = q.view(q.shape[0], HQ, 1, DIM)
    out = flex(qf, kv.k, kv.v, enable_gqa=True)
    return out.view(q.shape[0], HQ, DIM), bench_us(lambda: flex(qf, kv.k, kv.v, enable_gqa=True))


def flashinfer_decode_us(fi, q, kv: PagedKV, ref):
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    indptr, indices, last = kv.flashinfer_table()
    wrapper.plan(
        indptr,
        indices,
        last,
        HQ,
        HKV,
        DIM,
        kv.page_size,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    cache = kv.paged_cache()
    check("flashinfer decode", wrapper.run(q, cache), ref)
    us = bench_us(lambda: wrapper.run(q, cache))
    try:
        graph = graph_us(lambda: wrapper.run(q, cache)) if us < 400 else None
    except Exception as exc:
        print(f"flashinfer decode graph capture failed: {exc!r}")
        graph = None
    return us, graph


def run_decode(q, kv, config=None, num_splits=None):
    return OPS.decode_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_table,
        kv.seq_lens,
        page_size=kv.page_size,
        sm_scale=DIM**-0.5,
        config=config,
        num_splits=num_splits,
    )


def bench_decode(args, fi, ceil) -> list:
    rows = []
    for bsz, length in DECODE_SHAPES:
        per_page = {}
        for ps in (1, 16, 64):
            kv = PagedKV(bsz, length, ps)
            q = torch.randn(bsz, HQ, DIM, device="cuda", dtype=torch.bfloat16)
            ref, sdpa_us = sdpa_decode(q, kv, timed=ps == 1)
            if ps == 1:
                sdpa, flex = sdpa_us, None
                if args.flex and bsz in args.flex_batches:
                    out, flex = flex_decode_us(q, kv)
                    check("flex decode", out, ref)
            check(f"unikv decode {bsz}x{length} ps{ps}", run_decode(q, kv), ref)
            ours = bench_us(lambda: run_decode(q, kv))
            fi_us, fi_graph = flashinfer_decode_us(fi, q, kv, ref) if fi else (None, None)
            graph = graph_us(lambda: run_decode(q, kv)) if ours < 400 else None
            nbytes = 2 * kv.k.numel() * kv.k.element_size()
            per_page[ps] = ours
            rows.append(
                {
                    "B": bsz,
                    "L": length,
                    "page_size": ps,
                    "unikv_us": ours,
                    "graph_us": graph,
                    "TBps": nbytes / ours / 1e6,
                    "sdpa_contig_us": sdpa,
                    "vs_sdpa": sdpa / ours,
                    "flashinfer_us": fi_us,
                    "vs_flashinfer": fi_us / ours if fi_us else None,
                    "flashinfer_graph_us": fi_graph,
                    "graph_vs_flashinfer_graph": fi_graph / graph if fi_graph and graph else None,
                    "flex_contig_us": flex,
                    "vs_flex": flex / ours if flex else None,
                    "pct_copy": nbytes / ours / 1e3 / ceil["d2d_GBps"] * 100,
                }
            )
            print(rows[-1], flush=True)
            kv = None
            torch.cuda.empty_cache()
        rows[-1]["page1_over_page16"] = per_page[1] / per_page[16]
    return rows


def extend_inputs(kv: PagedKV, new: int):
    bsz = kv.bsz
    q = torch.randn(bsz * new, HQ, DIM, device="cuda", dtype=torch.bfloat16)
    q_indptr = torch.arange(0, bsz + 1, device="cuda", dtype=torch.int32) * new
    return q, q_indptr


def run_extend(q, q_indptr, kv, new, config=None):
    return OPS.extend_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_table,
        q_indptr,
        kv.seq_lens,
        max_q_len=new,
        page_size=kv.page_size,
        sm_scale=DIM**-0.5,
        config=config,
    )


def sdpa_extend(q, kv: PagedKV, new: int):
    from torch.nn.attention.bias import causal_lower_right

    qb = q.view(kv.bsz, new, HQ, DIM).transpose(1, 2)
    mask = causal_lower_right(new, kv.length)
    k = kv.k.repeat_interleave(HQ // HKV, 1)
    v = kv.v.repeat_interleave(HQ // HKV, 1)

    def fn():
        return F.scaled_dot_product_attention(qb, k, v, attn_mask=mask)

    return fn().transpose(1, 2).reshape(-1, HQ, DIM), bench_us(fn)


def flashinfer_prefill_us(fi, backend, q, q_indptr, kv: PagedKV, ref):
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    indptr, indices, last = kv.flashinfer_table()
    wrapper.plan(
        q_indptr,
        indptr,
        indices,
        last,
        HQ,
        HKV,
        DIM,
        kv.page_size,
        causal=True,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    cache = kv.paged_cache()
    check(f"flashinfer prefill {backend}", wrapper.run(q, cache), ref)
    return bench_us(lambda: wrapper.run(q, cache))


def bench_extend(args, fi) -> dict:
    shapes = (
        [(8, 4096, 512)]
        if args.quick
        else [(8, 4096, 512), (32, 1024, 128), (1, 0, 4096), (1, 0, 16384)]
    )
    out = {"rows": [], "config": list(extend_mod.CONFIGS[128])}
    for bsz, cached, new in shapes:
        for ps in (16, 64):
            kv = PagedKV(bsz, cached + new, ps)
            q, q_indptr = extend_inputs(kv, new)
            ref, sdpa = sdpa_extend(q, kv, new)
            check("unikv extend", run_extend(q, q_indptr, kv, new), ref)
            ours = bench_us(lambda: run_extend(q, q_indptr, kv, new))
            flops = 4 * DIM * HQ * bsz * sum(cached + j + 1 for j in range(new))
            row = {
                "B": bsz,
                "cached": cached,
                "new": new,
                "page_size": ps,
                "unikv_us": ours,
                "TFLOPs": flops / ours / 1e6,
                "sdpa_contig_us": sdpa,
                "vs_sdpa": sdpa / ours,
            }
            for backend in ("fa2", "fa3"):
                if fi is None:
                    continue
                try:
                    us = flashinfer_prefill_us(fi, backend, q, q_indptr, kv, ref)
                    row[f"flashinfer_{backend}_us"] = us
                    row[f"vs_flashinfer_{backend}"] = us / ours
                except Exception as exc:
                    row[f"flashinfer_{backend}_error"] = repr(exc)[:300]
            print(row, flush=True)
            out["rows"].append(row)
            kv = None
            torch.cuda.empty_cache()
    return out


def bench_store(ceil) -> list:
    rows = []
    spec = MHASpec(1, HKV, DIM, dtype=torch.bfloat16)
    ps = 16
    cfg = [SubPoolConfig("full", spec, page_size=ps)]
    pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"full": 4096}), "cuda")
    sub = pool["full"]
    kc, vc = sub.views[0]
    for num in (1, 64, 256, 8192):
        tokens = torch.randperm(sub.usable_pages * ps, device="cuda")[:num] + sub.first_page * ps
        ids = layout.kernel_ids(tokens, ps, sub.blocks_per_page).int()
        k = torch.randn(num, HKV, DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        OPS.store_kv(kc, vc, ids, k, v)
        check("store k", kc[ids.long()], k, 0)
        check("store v", vc[ids.long()], v, 0)
        ours = bench_us(lambda: OPS.store_kv(kc, vc, ids, k, v))

        def naive():
            kc[ids.long()] = k
            vc[ids.long()] = v

        torch_us = bench_us(naive)
        nbytes = 2 * 2 * k.numel() * k.element_size()  # K and V, read + written
        rows.append(
            {
                "tokens": num,
                "unikv_us": ours,
                "graph_us": graph_us(lambda: OPS.store_kv(kc, vc, ids, k, v)),
                "GBps": nbytes / ours / 1e3,
                "pct_copy": nbytes / ours / 1e3 / ceil["d2d_GBps"] * 100,
                "torch_index_us": torch_us,
                "vs_torch": torch_us / ours,
            }
        )
        print(rows[-1], flush=True)
    return rows


def bench_copy(args, ceil) -> list:
    rows = []
    envelopes = (
        [64 << 10, 1 << 20, 8 << 20]
        if args.quick
        else [64 << 10, 256 << 10, 1 << 20, 2 << 20, 8 << 20]
    )
    for num in (64, 2048):
        for page_bytes in envelopes:
            buf = torch.randint(
                0, 256, ((2 * num + 2) * page_bytes,), dtype=torch.uint8, device="cuda"
            )
            perm = torch.randperm(2 * num + 1, device="cuda") + 1
            src, dst = perm[:num], perm[num : 2 * num]
            expect = buf.view(-1, page_bytes)[src[:8]].clone()
            OPS.copy_pages(buf, src, dst, page_bytes, disjoint=True)
            assert torch.equal(buf.view(-1, page_bytes)[dst[:8]], expect), "page copy mismatch"
            ours = bench_us(lambda: OPS.copy_pages(buf, src, dst, page_bytes, disjoint=True))
            staged = bench_us(lambda: OPS.copy_pages(buf, src, dst, page_bytes))
            torch_us = None
            if num * page_bytes <= (256 << 20):
                torch_us = bench_us(lambda: torch_copy_pages(buf, src, dst, page_bytes))
            nbytes = 2 * num * page_bytes
            rows.append(
                {
                    "pages": num,
                    "page_bytes": page_bytes,
                    "unikv_us": ours,
                    "GBps": nbytes / ours / 1e3,
                    "pct_copy": nbytes / ours / 1e3 / ceil["d2d_GBps"] * 100,
                    "staged_us": staged,
                    "torch_index_us": torch_us,
                    "vs_torch": torch_us / ours if torch_us else None,
                }
            )
            print(rows[-1], flush=True)
            buf = None
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-flex", dest="flex", action="store_false")
    parser.add_argument("--flex-batches", default="1,64", help="decode batches that run Flex")
    parser.add_argument("--sections", default="decode,extend,store,copy")
    parser.add_argument("--out", default="benchmarks/results/kernels_h200.json")
    args = parser.parse_args()
    args.flex_batches = [int(b) for b in args.flex_batches.split(",") if b]
    torch.manual_seed(0)
    sections = args.sections.split(",")
    fi = try_flashinfer()
    result = {
        "env": environment(),
        "quick": args.quick,
        "flashinfer": getattr(fi, "__version__", None),
    }
    t0 = time.time()
    result["ceilings"] = ceil = copy_ceilings()
    print("ceilings", ceil, flush=True)
    from benchmarks import sweep_kernels

    steps = [
        ("sweep_decode", lambda: sweep_kernels.sweep_decode()),
        ("sweep_extend", lambda: sweep_kernels.sweep_extend()),
        ("sweep_store", lambda: sweep_kernels.sweep_store()),
        ("sweep_copy", lambda: sweep_kernels.sweep_copy()),
        ("decode", lambda: bench_decode(args, fi, ceil)),
        ("extend", lambda: bench_extend(args, fi)),
        ("store", lambda: bench_store(ceil)),
        ("copy", lambda: bench_copy(args, ceil)),
    ]
    for name, step in steps:
        if name not in sections:
            continue
        try:
            result[name] = step()
        except Exception as exc:  # keep the other sections' numbers
            result[name] = {"error": repr(exc)[:2000]}
            print(f"{name} failed: {exc!r}", flush=True)
        print(f"[{name} done at {time.time() - t0:.0f}s]", flush=True)
        save_json(args.out, result)


if __name__ == "__main__":
    main()
