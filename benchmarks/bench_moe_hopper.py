"""The Hopper MXFP4 MoE (``kernels/moe/hopper.py``, Gluon) against the installed Triton
kernel (``moe.fused_moe``) on gpt-oss's expert shape, in one process.

    python benchmarks/bench_moe_hopper.py [--batches 1,64,256] [--out PATH]

For each B: the outputs checked against the torch reference on the packed experts
first (relative max error); then CUDA-graph replay times of the Triton kernel's table
entry, of the Hopper kernel's table entry (``moe_hopper.moe``, ``table_*``) and of
each Hopper candidate; ``of_roofline`` as in
``bench_moe.py`` (touched packed bytes at the copy bandwidth measured in this run).
"""

# ruff: noqa: BLE001  (a failing candidate is recorded, not fatal)

from __future__ import annotations

import argparse
import os
import sys
import traceback
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_moe import KW, SHAPE, make_experts, touched_bytes
from benchmarks.common import copy_ceilings, environment, graph_us, save_json
from unikv.kernels.moe import fused as moe
from unikv.kernels.moe import hopper as moe_hopper
from unikv.kernels.moe import ref as moe_ref

# (block_t, stages, one_mul, half, warps): the one-multiply decode where the scales
# allow (these do); half: a block whose second half is padding runs half the rows;
# warps: 16 feature rows each (4: 64 features a program, 8: 128)
CANDIDATES = (
    (64, 4, True, True, 4),
    (32, 4, True, True, 4),
    (16, 4, True, True, 4),
    (128, 3, True, True, 4),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,16,64,256,2048,8192")
    ap.add_argument("--out", default="benchmarks/results/moe_hopper_h200.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    e, k, d, i = (SHAPE[n] for n in ("experts", "top_k", "hidden", "intermediate"))
    packed = make_experts(e, d, i, g)
    frags = moe_hopper.pack_experts(packed["w1"], packed["w1_scales"], packed["w2"],
                                    packed["w2_scales"], KW["gate_up"])  # fmt: skip
    ceilings = copy_ceilings()
    rows = []
    for t in (int(b) for b in args.batches.split(",")):
        x = torch.randn(t, d, generator=g).bfloat16().cuda()
        top, ids = torch.topk(torch.randn(t, e, generator=g).cuda(), k, dim=-1)
        weights = torch.softmax(top, dim=-1).bfloat16()
        ref = moe_ref.fused_moe(x, weights, ids, **packed, **KW).float()
        scale = max(1.0, ref.abs().max().item())
        roof = touched_bytes(packed, ids, t, d) / (ceilings["d2d_GBps"] * 1e3)
        triton_fn = partial(moe.fused_moe, x, weights, ids, **packed, **KW)
        row = {"B": t, "roofline_us": roof,
               "triton_err": (triton_fn().float() - ref).abs().max().item() / scale}  # fmt: skip
        row["triton_us"] = graph_us(triton_fn)
        row["triton_of_roofline"] = roof / row["triton_us"]
        table_fn = partial(moe_hopper.moe, x, weights, ids, frags, b1=packed["b1"],
                           b2=packed["b2"], **KW)  # fmt: skip
        row["table_err"] = (table_fn().float() - ref).abs().max().item() / scale
        if row["table_err"] < 3e-2:
            row["table_us"] = graph_us(table_fn)
            row["table_of_roofline"] = roof / row["table_us"]
            row["table_vs_triton"] = row["triton_us"] / row["table_us"]
        for bt, st, one, half, warps in CANDIDATES:
            name = f"gluon_t{bt}_s{st}_w{warps}{'_one' * one}{'_half' * half}"
            fn = partial(moe_hopper.fused_moe_hopper, x, weights, ids, frags, b1=packed["b1"],
                         b2=packed["b2"], **KW, block_t=bt, stages=st, one_mul=one,
                         half=half, warps=warps)  # fmt: skip
            try:
                err = (fn().float() - ref).abs().max().item() / scale
                row[f"{name}_err"] = err
                if not err < 3e-2:
                    row[f"{name}_error"] = "differs from the reference; not timed"
                    continue
                row[f"{name}_us"] = graph_us(fn)
                row[f"{name}_of_roofline"] = roof / row[f"{name}_us"]
            except Exception:
                row[f"{name}_error"] = traceback.format_exc()[-1500:]
        print(row, flush=True)
        rows.append(row)
    payload = {"environment": environment(), "ceilings": ceilings, "shape": SHAPE, "rows": rows}
    save_json(args.out, payload)
    if os.environ.get("OUT"):
        save_json(os.path.join(os.environ["OUT"], "moe_hopper.json"), payload)


if __name__ == "__main__":
    main()
