"""Benchmark unikv's Triton MLA attention against FlashInfer's MLA paged attention
(``flashinfer.mla.BatchMLAPagedAttentionWrapper``) in the same process, both
reading the SAME pool bytes (the protocol of README.md, Results).

    python benchmarks/bench_mla.py [--quick] [--sweep] [--out benchmarks/results/mla_h200.json]

The latent rows live in a 2-layer MLA sub-pool (rank 512, rope 64, bf16) on
randomly permuted pages; layer 1 is read. unikv reads its dense latent view
through the block table; FlashInfer reads the same bytes through the FlashInfer
export: ``kv_indices`` from ``export_flashinfer`` (kernel page entries) and the
view ``dense.view(-1, ps, 576)`` split into its latent ``[..., :512]`` and rope
``[..., 512:]`` parts (strided: FlashInfer takes page and row strides).

FlashInfer 0.5.3's API, as used here: ``plan(qo_indptr, kv_indptr, kv_indices,
kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
q_data_type, kv_data_type)`` (host copies of the indptrs: outside the timed
region) and ``run(q_nope, q_pe, ckv_cache, kpe_cache)``. Its C++ run reads
``ckv_cache.stride(0)`` / ``stride(1)`` (page and row strides, in elements, as
uint32) and assumes a unit last stride, so the two strided views of one pool
buffer are passed as they are: no copy (recorded as ``flashinfer_cache`` in the
JSON). Before FlashInfer's int64 fix of ``page index * page stride`` (PR #3136,
2026), that product wraps at 2**32 elements: a shape whose view would reach past
it is run on a one-layer pool (``pool_layers`` 1 in its row) so both kernels
still read the same bytes correctly.

Sections: decode (B in 1..128 x L in 1k..32k, H 16 and 128, page 16; pages 1 and
64 on a subset) and extend (absorbed prefill chunks, causal; plus the whole
prefill attention absorbed vs expanded + SDPA, to pick the prefill path). Every
output is checked against the other implementation (max abs and relative error;
and the torch reference on small shapes) BEFORE anything is timed; a FlashInfer
backend whose output disagrees is recorded with its errors and not timed. Ratios
``vs_flashinfer_*`` are FlashInfer's time over unikv's (> 1: unikv is faster).
``--sweep`` times alternative tile configs and split counts on a few decode
shapes (to retune ``unikv/kernels/mla/prefill.py CONFIGS``). The JSON goes to ``--out``
and, when the environment sets ``$OUT``, to ``$OUT/<its file name>`` too.
"""

# ruff: noqa: B023, BLE001  (lambdas are timed at once; a failing peer is recorded, not fatal)

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
from benchmarks.common import bench_us, copy_ceilings, environment, graph_us, save_json
from unikv.kernels import get_backend
from unikv.kernels.mla import prefill as mla
from unikv.kernels.mla import ref as mla_ref
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MLASpec

OPS = get_backend("cuda")
RANK, ROPE = 512, 64
SCALE = 192**-0.5  # (nope 128 + rope 64) ** -0.5, DeepSeek-V3
BACKENDS = ("fa2", "fa3")
DECODE = [(b, n) for b in (1, 8, 32, 128) for n in (1024, 4096, 32768)]
QUICK = [(1, 32768), (32, 4096), (128, 1024), (128, 8192)]
EXTEND = [(1, 0, 4096), (8, 4096, 512), (32, 1024, 128)]
SWEEP = [(16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2)]
REL_TOL = 2e-2  # relative (norm) error allowed between two bf16 implementations
ABS_TOL = 0.1  # max abs error allowed, as a fraction of the output's largest magnitude
UINT32_ELEMS = 2**32  # FlashInfer < PR #3136: page index x page stride wraps here
CACHE_NOTE = (
    "strided views of the pool buffer, ckv = view(-1, ps, 576)[..., :512], kpe = [..., 512:]"
    " (page stride ps*576, row stride 576, unit last stride): passed without a copy"
)


def pool_layers(bsz: int, length: int, page_size: int) -> int:
    """2 (read layer 1 of two: a real row-block stride) unless FlashInfer's view of
    such a pool would reach past 2**32 elements (its 32-bit page offsets), then 1."""
    rows = 2 * bsz * math.ceil(length / page_size) * page_size  # B = 2 row-blocks per page
    return 2 if (rows + page_size) * (RANK + ROPE) < UINT32_ELEMS else 1


class LatentPool:
    """B requests of ``cached + new`` tokens on permuted pages of an MLA pool of
    ``pool_layers`` layers (its last layer is read)."""

    def __init__(self, bsz: int, length: int, page_size: int):
        self.layers = pool_layers(bsz, length, page_size)
        spec = MLASpec(self.layers, RANK, ROPE, dtype=torch.bfloat16)
        pages = math.ceil(length / page_size)
        cfg = [SubPoolConfig("mla", spec, page_size=page_size)]
        pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"mla": bsz * pages}), "cuda")
        sub = pool["mla"]
        perm = torch.randperm(sub.usable_pages, device="cuda")[: bsz * pages] + sub.first_page
        self.block_table = (perm.view(bsz, pages) * sub.blocks_per_page).int()
        self.cache = sub.views[-1]  # (N, 576) dense latent view of the last layer
        pos = torch.arange(length, device="cuda")
        ids = self.block_table[:, pos // page_size].long() * page_size + pos % page_size
        for b in range(bsz):  # a naive indexed write, one request at a time
            rows = torch.randn(length, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
            self.cache[ids[b]] = rows
        self.seq_lens = torch.full((bsz,), length, dtype=torch.int32, device="cuda")
        self.pool, self.page_size, self.bsz, self.length = pool, page_size, bsz, length
        self.ids = ids  # (B, L) int64 rows of each request's tokens in the dense view

    def flashinfer_cache(self):
        paged = self.cache.view(-1, self.page_size, RANK + ROPE)  # FlashInfer's page layout
        return paged[..., :RANK], paged[..., RANK:]


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def agreement(got, want) -> dict:
    """max abs and relative error of ``got`` against ``want`` and whether they agree
    (``REL_TOL``, ``ABS_TOL``); a wrong page shows as a large max abs error."""
    diff = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    rel = rel_err(got, want)
    return {"max_abs_err": diff, "rel_err": rel, "ok": rel < REL_TOL and diff <= ABS_TOL * scale}


def run_unikv(q_lat, q_rope, kv: LatentPool, q_indptr, max_q_len, op=None, **kw):
    """unikv's MLA attention: the backend's op, or ``op`` (the sweep passes
    ``kernels.mla.prefill.mla_attention``, whose configs are (BLOCK_H, BLOCK_N, warps, stages))."""
    return (op or OPS.mla_attention)(
        q_lat, q_rope, kv.cache, kv.block_table, q_indptr, kv.seq_lens,
        max_q_len=max_q_len, page_size=kv.page_size, sm_scale=SCALE, **kw,
    )  # fmt: skip


def flashinfer_runner(fi, backend, q_lat, q_rope, kv: LatentPool, q_indptr, causal):
    """FlashInfer's MLA planned over the pool's export: a no-argument callable that
    runs it on the pool's own bytes (the plan's host copies happen here, once)."""
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = fi.BatchMLAPagedAttentionWrapper(ws, backend=backend)
    kv_indptr, kv_indices, _ = OPS.export_flashinfer(
        kv.block_table, kv.seq_lens, page_size=kv.page_size
    )
    wrapper.plan(
        q_indptr, kv_indptr, kv_indices, kv.seq_lens, q_lat.shape[1], RANK, ROPE,
        kv.page_size, causal, SCALE, q_lat.dtype, kv.cache.dtype,
    )  # fmt: skip
    ckv, kpe = kv.flashinfer_cache()
    return lambda: wrapper.run(q_lat, q_rope, ckv, kpe)


def check_peers(fi, row, q_lat, q_rope, kv, q_indptr, ours, causal) -> dict:
    """Plan and run every FlashInfer backend once and compare its output with
    unikv's (nothing is timed yet). Returns {backend: runner} of those that agree;
    the others' errors or exceptions go into ``row``."""
    runners = {}
    for backend in BACKENDS if fi is not None else ():
        try:
            run = flashinfer_runner(fi, backend, q_lat, q_rope, kv, q_indptr, causal)
            check = agreement(ours, run())
            torch.cuda.synchronize()
        except Exception as exc:
            row[f"flashinfer_{backend}_error"] = repr(exc)[:300]
            continue
        row[f"max_abs_err_vs_flashinfer_{backend}"] = check["max_abs_err"]
        row[f"err_vs_flashinfer_{backend}"] = check["rel_err"]
        if check["ok"]:
            runners[backend] = run
        else:
            row[f"flashinfer_{backend}_error"] = "outputs disagree with unikv: not timed"
    return runners


def time_peers(runners, row, ours_us) -> None:
    """Time the FlashInfer backends that agreed (eager, and replayed in a CUDA graph
    for short kernels) and record the ratios to unikv's times."""
    for backend, run in runners.items():
        try:
            us = bench_us(run)
        except Exception as exc:
            row[f"flashinfer_{backend}_error"] = repr(exc)[:300]
            continue
        graph = None
        try:
            graph = graph_us(run) if us < 400 else None
        except Exception as exc:  # eager numbers still count
            row[f"flashinfer_{backend}_graph_error"] = repr(exc)[:300]
        row[f"flashinfer_{backend}_us"], row[f"flashinfer_{backend}_graph_us"] = us, graph
        row[f"vs_flashinfer_{backend}"] = us / ours_us
        if graph and row.get("graph_us"):
            row[f"graph_vs_flashinfer_{backend}_graph"] = graph / row["graph_us"]


def decode_row(fi, ceil, bsz, length, heads, ps) -> dict:
    kv = LatentPool(bsz, length, ps)
    q_lat = torch.randn(bsz, heads, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(bsz, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    q_indptr = torch.arange(bsz + 1, dtype=torch.int32, device="cuda")
    ours = run_unikv(q_lat, q_rope, kv, q_indptr, 1)
    row = {"B": bsz, "L": length, "H": heads, "page_size": ps, "pool_layers": kv.layers}
    if bsz * length * heads <= 1 << 22:  # the torch reference fits in memory
        ref = mla_ref.mla_attention(
            q_lat, q_rope, kv.cache, kv.block_table, q_indptr, kv.seq_lens,
            max_q_len=1, page_size=ps, sm_scale=SCALE,
        )  # fmt: skip
        check = agreement(ours, ref)
        row["err_vs_reference"], row["max_abs_err_vs_reference"] = (
            check["rel_err"],
            check["max_abs_err"],
        )
        assert check["ok"], f"unikv disagrees with the torch reference: {check}"
    runners = check_peers(fi, row, q_lat, q_rope, kv, q_indptr, ours, causal=False)
    us = bench_us(lambda: run_unikv(q_lat, q_rope, kv, q_indptr, 1))
    nbytes = bsz * length * (RANK + ROPE) * 2
    row.update(
        unikv_us=us,
        graph_us=graph_us(lambda: run_unikv(q_lat, q_rope, kv, q_indptr, 1)) if us < 400 else None,
        splits=mla.choose_num_splits(
            bsz * math.ceil(heads / mla.choose_config(RANK, heads)[0]), 1, length, q_lat.device
        ),
        TBps=nbytes / us / 1e6,
        pct_copy=nbytes / us / 1e3 / ceil["d2d_GBps"] * 100,
    )
    time_peers(runners, row, us)
    return row


def absorbed_vs_expanded(row, kv: LatentPool, q_rope, q_indptr, new, heads) -> None:
    """The whole prefill attention both ways, from q_nope (T, H, 128) and the cached
    rows: absorbed (q_nope @ W_UK, unikv's kernel, @ W_UV) and expanded (gather the
    rows, K = [W_UK c | k_rope], V = W_UV c, SDPA causal lower-right); outputs checked
    against each other, both timed (``absorbed_total_us``, ``expanded_sdpa_us``)."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    bsz, length, dim = kv.bsz, kv.length, 128
    w_uk, w_uv = (
        torch.randn(heads, dim, RANK, device="cuda", dtype=torch.bfloat16) * RANK**-0.5
        for _ in range(2)
    )
    q_nope = torch.randn(bsz * new, heads, dim, device="cuda", dtype=torch.bfloat16)
    mask = causal_lower_right(new, length)

    def absorbed():
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        out = run_unikv(q_lat, q_rope, kv, q_indptr, new)  # (T, H, rank)
        return torch.einsum("thr,hvr->thv", out, w_uv)

    def expanded():
        rows = kv.cache[kv.ids]  # (B, L, rank + rope)
        k_nope = torch.einsum("blr,hdr->bhld", rows[..., :RANK], w_uk)
        k = torch.cat([k_nope, rows[:, None, :, RANK:].expand(-1, heads, -1, -1)], dim=-1)
        v = torch.einsum("blr,hvr->bhlv", rows[..., :RANK], w_uv)
        q = torch.cat([q_nope, q_rope], dim=-1).view(bsz, new, heads, -1).transpose(1, 2)
        out = sdpa(q, k, v, attn_mask=mask, scale=SCALE)  # (B, H, new, v)
        return out.transpose(1, 2).reshape(bsz * new, heads, dim)

    row["err_absorbed_vs_expanded"] = rel_err(absorbed(), expanded())
    row["absorbed_total_us"] = bench_us(absorbed)
    row["expanded_sdpa_us"] = bench_us(expanded)
    row["expanded_over_absorbed"] = row["expanded_sdpa_us"] / row["absorbed_total_us"]


def extend_row(fi, bsz, cached, new, heads, ps) -> dict:
    kv = LatentPool(bsz, cached + new, ps)
    q_lat = torch.randn(bsz * new, heads, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(bsz * new, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    q_indptr = torch.arange(bsz + 1, dtype=torch.int32, device="cuda") * new
    ours = run_unikv(q_lat, q_rope, kv, q_indptr, new)
    row = {"B": bsz, "cached": cached, "new": new, "H": heads, "page_size": ps}
    row["pool_layers"] = kv.layers
    runners = check_peers(fi, row, q_lat, q_rope, kv, q_indptr, ours, causal=True)
    us = bench_us(lambda: run_unikv(q_lat, q_rope, kv, q_indptr, new))
    flops = 2 * (2 * RANK + ROPE) * heads * bsz * sum(cached + j + 1 for j in range(new))
    row.update(unikv_us=us, TFLOPs=flops / us / 1e6)
    time_peers(runners, row, us)
    try:
        absorbed_vs_expanded(row, kv, q_rope, q_indptr, new, heads)
    except Exception as exc:
        row["expanded_error"] = repr(exc)[:300]
    return row


def sweep(shapes) -> list:
    """Tile configs x split counts of ``kernels.mla.prefill`` on decode shapes (H 128, page 16)."""
    from unikv.kernels.mla import prefill as mla

    rows = []
    for bsz, length in shapes:
        kv = LatentPool(bsz, length, 16)
        q_lat = torch.randn(bsz, 128, RANK, device="cuda", dtype=torch.bfloat16)
        q_rope = torch.randn(bsz, 128, ROPE, device="cuda", dtype=torch.bfloat16)
        q_indptr = torch.arange(bsz + 1, dtype=torch.int32, device="cuda")
        want = run_unikv(q_lat, q_rope, kv, q_indptr, 1)
        for config in SWEEP:
            for splits in (None, 1, 4, 16, 64):
                kw = {"config": config, "num_splits": splits, "op": mla.mla_attention}
                try:
                    got = run_unikv(q_lat, q_rope, kv, q_indptr, 1, **kw)
                    assert rel_err(got, want) < 1e-2
                    us = bench_us(lambda: run_unikv(q_lat, q_rope, kv, q_indptr, 1, **kw))
                    rows.append(
                        {"B": bsz, "L": length, "config": config, "splits": splits, "us": us}
                    )
                except Exception as exc:  # e.g. out of shared memory
                    rows.append({"B": bsz, "L": length, "config": config, "error": repr(exc)[:200]})
                print(rows[-1], flush=True)
        kv = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sections", default="decode,extend")
    parser.add_argument("--out", default="benchmarks/results/mla_h200.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    try:
        fi = importlib.import_module("flashinfer.mla")  # BatchMLAPagedAttentionWrapper
        version = getattr(importlib.import_module("flashinfer"), "__version__", None)
    except Exception as exc:  # recorded, not hidden
        print(f"flashinfer unavailable: {exc!r}")
        fi, version = None, f"unavailable: {exc!r}"[:300]
    result = {
        "env": environment(),
        "quick": args.quick,
        "flashinfer": version,
        "flashinfer_cache": CACHE_NOTE,
        "checks": {"rel_tol": REL_TOL, "abs_tol_of_max": ABS_TOL, "before_timing": True},
    }
    outs = [args.out]
    if os.environ.get("OUT"):  # the device runs collect $OUT
        outs.append(str(Path(os.environ["OUT"]) / Path(args.out).name))
    result["config"] = {"CONFIGS": {str(k): v for k, v in mla.CONFIGS.items()}}
    result["ceilings"] = ceil = copy_ceilings()
    t0 = time.time()
    jobs = []
    if "decode" in args.sections:
        shapes = QUICK if args.quick else DECODE
        jobs += [("decode", (bsz, n, h, 16)) for h in (128, 16) for bsz, n in shapes]
        jobs += [("decode", (bsz, n, 128, ps)) for ps in (1, 64) for bsz, n in QUICK[:2]]
    if "extend" in args.sections:
        jobs += [("extend", (b, c, n, 128, 16)) for b, c, n in EXTEND[: 1 if args.quick else 3]]
    for section, shape in jobs:
        try:
            row = decode_row(fi, ceil, *shape) if section == "decode" else extend_row(fi, *shape)
        except Exception as exc:  # keep the other shapes' numbers
            row = {"shape": shape, "error": repr(exc)[:2000]}
        print(section, row, flush=True)
        result.setdefault(section, []).append(row)
        torch.cuda.empty_cache()
        for out in outs:  # after every shape: a killed run keeps what it measured
            save_json(out, result)
    if args.sweep:
        result["sweep"] = sweep(QUICK)
    print(f"[done at {time.time() - t0:.0f}s]", flush=True)
    for out in outs:
        save_json(out, result)


if __name__ == "__main__":
    main()
