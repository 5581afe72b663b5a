"""The decode step's attention-side ops at the e2e's own shapes, on the H200.

Three sections, every candidate checked against its torch reference first:

- ``attention``: paged decode attention over a real 16-layer page-major pool (the
  Llama-3.2-1B shape: 32 / 8 heads, D 64, bf16, page 16; each layer's view strides
  over every layer's rows, as in the engine) at B 256 with ragged lengths 512-767
  (bench_e2e's decode batch) and at B 1 (512 and 4k): tile configs x KV splits, by
  CUDA-graph time, with the share of copy bandwidth the K/V bytes reach.
- ``rope_store``: the fused rope + K/V store against rope_qk then store_kv.
- ``argmax``: the split-row Triton argmax against torch.argmax, bf16 logits.

    python benchmarks/bench_decode_ops.py [--sections attention,rope_store,argmax] [--out F]
"""

# ruff: noqa: B023  (lambdas and closures are timed at once, inside their loop)

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import copy_ceilings, environment, graph_us, save_json

from unikv import layout
from unikv.kernels import get_backend
from unikv.kernels.attention import decode as decode_mod
from unikv.kernels.attention import ref
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

HQ, HKV, DIM, LAYERS, PS = 32, 8, 64, 16, 16
CONFIGS = [(64, 4, 2), (128, 4, 2), (128, 8, 2), (128, 4, 3)]  # 76019ce's best three, one more
OPS = get_backend("cuda", "triton")


class E2EPool:
    """B requests of the given lengths on randomly permuted pages of a LAYERS-layer pool."""

    def __init__(self, lens: list[int]) -> None:
        spec = MHASpec(LAYERS, HKV, DIM, dtype=torch.bfloat16)
        pages = math.ceil(max(lens) / PS)
        cfg = [SubPoolConfig("full", spec, page_size=PS)]
        self.pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"full": len(lens) * pages}), "cuda")
        sub = self.pool["full"]
        perm = torch.randperm(sub.usable_pages, device="cuda")[: len(lens) * pages]
        self.block_table = (
            (perm + sub.first_page).view(len(lens), pages) * sub.blocks_per_page
        ).int()
        self.k, self.v = sub.views[LAYERS // 2]  # a middle layer
        self.k.normal_()
        self.v.normal_()
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self.kv_bytes = sum(lens) * HKV * 2 * DIM * 2

    def run(self, q, config=None, splits=None):
        return OPS.decode_attention(
            q, self.k, self.v, self.block_table, self.seq_lens, page_size=PS,
            sm_scale=DIM**-0.5, config=config, num_splits=splits,
        )  # fmt: skip


def attention(copy_gbps: float) -> dict:
    out = {}
    shapes = {"B256 ragged 512-767": [512 + (i * 256) // 256 for i in range(256)],
              "B1 512": [512], "B1 4096": [4096]}  # fmt: skip
    for name, lens in shapes.items():
        kv = E2EPool(lens)
        q = torch.randn(len(lens), HQ, DIM, device="cuda", dtype=torch.bfloat16)
        want = ref.decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                    page_size=PS, sm_scale=DIM**-0.5)  # fmt: skip
        auto = decode_mod.choose_num_splits(len(lens), HKV, kv.block_table.shape[1] * PS, q.device)
        default = decode_mod.choose_config(DIM, PS, kv.block_table.shape[1] * PS, auto)
        splits = (1, 2) if len(lens) > 1 else (1, 2, 4, 8, 16, 32, 64)
        rows = {}
        for cfg, ns in [(c, ns) for c in (CONFIGS if len(lens) > 1 else [default])
                        for ns in sorted({*splits, auto})]:  # fmt: skip
            key = f"{cfg} splits={ns}"
            try:
                got = kv.run(q, cfg, ns)
                err = (got.float() - want.float()).abs().max().item()
                if not err < 2e-2:
                    rows[key] = {"error": f"max abs error {err}"}
                    continue
                us = graph_us(lambda: kv.run(q, cfg, ns))
            except Exception as exc:  # noqa: BLE001  (recorded, not fatal)
                rows[key] = {"error": repr(exc)[:200]}
                continue
            rows[key] = {"us": us, "bw_share": kv.kv_bytes / (us * 1e-6) / (copy_gbps * 1e9)}
        us_auto = graph_us(lambda: kv.run(q))
        best = min((r["us"], k) for k, r in rows.items() if "us" in r)
        out[name] = {"auto": {"config": list(default), "splits": auto, "us": us_auto,
                              "bw_share": kv.kv_bytes / (us_auto * 1e-6) / (copy_gbps * 1e9)},
                     "best": {"key": best[1], "us": best[0]}, "kv_bytes": kv.kv_bytes,
                     "rows": rows}  # fmt: skip
        print(name, "auto", out[name]["auto"], "best", out[name]["best"], flush=True)
        kv = None
        torch.cuda.empty_cache()
    return out


def rope_store() -> dict:
    out = {}
    spec = MHASpec(LAYERS, HKV, DIM, dtype=torch.bfloat16)
    cfg = [SubPoolConfig("full", spec, page_size=PS)]
    pool = UnifiedPool(cfg, pool_bytes_for(cfg, {"full": 1024}), "cuda")
    sub = pool["full"]
    k_cache, v_cache = sub.views[3]
    cos, sin = (
        torch.randn(16384, DIM // 2, device="cuda"),
        torch.randn(16384, DIM // 2, device="cuda"),
    )
    for t in (1, 256, 8192):
        physical = torch.randperm(sub.usable_pages * PS, device="cuda")[:t] + sub.first_page * PS
        ids = layout.kernel_ids(physical, PS, sub.blocks_per_page)
        qkv = torch.randn(t, (HQ + 2 * HKV) * DIM, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 16384, (t,), device="cuda")

        def views():
            q, k, v = qkv.split([HQ * DIM, HKV * DIM, HKV * DIM], dim=-1)
            return q.view(t, HQ, DIM), k.view(t, HKV, DIM), v.view(t, HKV, DIM)

        def fused():
            q, k, v = views()
            OPS.rope_store_kv(k_cache, v_cache, ids, q, k, v, cos, sin, pos)

        def two_ops():
            q, k, v = views()
            q, k = OPS.rope_qk(q, k, cos, sin, pos)
            OPS.store_kv(k_cache, v_cache, ids, k, v)

        out[f"T{t}"] = {"fused_us": graph_us(fused), "two_ops_us": graph_us(two_ops)}
        print("rope_store", t, out[f"T{t}"], flush=True)
    return out


def argmax(copy_gbps: float) -> dict:
    out = {}
    for rows in (1, 64, 256):
        logits = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(OPS.argmax(logits), logits.argmax(dim=-1)), "argmax differs"
        tri, tor = graph_us(lambda: OPS.argmax(logits)), graph_us(lambda: logits.argmax(dim=-1))
        share = logits.numel() * 2 / (tri * 1e-6) / (copy_gbps * 1e9)
        out[f"B{rows}"] = {"triton_us": tri, "torch_us": tor, "triton_bw_share": share}
        print("argmax", rows, out[f"B{rows}"], flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="attention,rope_store,argmax")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/decode_ops_h200.json"))
    args = p.parse_args(argv)
    copy = copy_ceilings()["d2d_GBps"]
    result = {"env": environment(), "copy_GBps": copy}
    sections = args.sections.split(",")
    if "attention" in sections:
        result["attention"] = attention(copy)
    if "rope_store" in sections:
        result["rope_store"] = rope_store()
    if "argmax" in sections:
        result["argmax"] = argmax(copy)
    save_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
