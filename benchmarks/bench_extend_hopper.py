"""The Hopper fresh-prompt attention (Gluon) against SDPA and the Triton fresh kernel.

One process, one GPU, bf16: for each shape ``B x T`` (fresh prompts, no cached
prefix) at Hq / Hkv heads and head dim D, the rows are views of one fused QKV
output, as the model hands them over. Timed with CUDA events (median of ``--reps``
after warm-up), each checked first against SDPA (max abs error):

- ``hopper``: the Gluon kernel (``extend_hopper.fresh_attention``, at every length:
  ``extend_attention_fresh`` takes it from ``MIN_Q_LEN[D]`` tokens);
- ``triton``: the same call with the Triton kernel's installed tile
  (``extend_fresh.CONFIGS[D]``);
- ``sdpa_default``: torch SDPA's default dispatch (cuDNN on this build) on contiguous
  (B, Hq, T, D) q and head-repeated K/V, causal: the issue's peer;
- ``sdpa_gqa``: the same with ``enable_gqa`` over the KV heads as they are.

Ratios are peer_ms / ours_ms (> 1: ours faster); TFLOP/s counts the causal half.
``kernel_ms``: the device time of the call's kernels alone (torch.profiler), which a
short shape's host launch cost can hide in ``ms`` (back-to-back calls).
Run: ``python benchmarks/bench_extend_hopper.py [--shapes 1x16384,8x2048]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_extend_long import time_ms
from benchmarks.common import environment, save_json
from unikv.kernels.attention import fresh as extend_fresh
from unikv.kernels.attention import fresh_hopper as extend_hopper

TOL = 3e-2  # bf16 output, max abs error against SDPA


def kernel_ms(fn, reps: int) -> float:
    """Mean device milliseconds a call's kernels take (host time excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in events) / reps / 1e3


def bench_shape(bsz: int, tokens: int, hq: int, hkv: int, dim: int, reps: int) -> dict:
    total = bsz * tokens
    qkv = torch.randn(total, (hq + 2 * hkv) * dim, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : hq * dim].view(total, hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(total, hkv, dim)
    v = qkv[:, (hq + hkv) * dim :].view(total, hkv, dim)
    indptr = torch.arange(0, total + 1, tokens, dtype=torch.int32, device="cuda")
    scale = dim**-0.5
    out = torch.empty_like(q)
    qb = q.view(bsz, tokens, hq, dim).transpose(1, 2).contiguous()
    kb = k.view(bsz, tokens, hkv, dim).transpose(1, 2).contiguous()
    vb = v.view(bsz, tokens, hkv, dim).transpose(1, 2).contiguous()
    kr, vr = kb.repeat_interleave(hq // hkv, 1), vb.repeat_interleave(hq // hkv, 1)
    runs = {
        "hopper": lambda: extend_hopper.fresh_attention(
            q, k, v, indptr, out, max_q_len=tokens, sm_scale=scale
        ),
        "triton": lambda: extend_fresh.extend_attention_fresh(
            q, k, v, indptr, max_q_len=tokens, sm_scale=scale, config=extend_fresh.CONFIGS[dim]
        ),
        "sdpa_default": lambda: F.scaled_dot_product_attention(qb, kr, vr, is_causal=True),
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, enable_gqa=True
        ),
    }
    ref = runs["sdpa_default"]().transpose(1, 2).reshape(total, hq, dim).float()
    flops = 4 * bsz * hq * dim * tokens * (tokens + 1) / 2
    res = {"shape": f"{bsz}x{tokens}", "hq": hq, "hkv": hkv, "dim": dim,
           "hopper_taken": extend_hopper.usable(q, k, v, 0, 0.0, tokens)}  # fmt: skip
    for name, fn in runs.items():
        out = fn()
        if out.dim() == 4:
            out = out.transpose(1, 2).reshape(total, hq, dim)
        err = (out.float() - ref).abs().max().item()
        row = {"max_abs_err": err, "ok": err < TOL}
        if row["ok"]:
            row["ms"] = time_ms(fn, reps)
            row["kernel_ms"] = kernel_ms(fn, reps)
            row["tflops"] = flops / row["ms"] / 1e9
        res[name] = row
    for peer in ("sdpa_default", "sdpa_gqa", "triton"):
        if "ms" in res["hopper"] and "ms" in res[peer]:
            res[f"hopper_vs_{peer}"] = res[peer]["ms"] / res["hopper"]["ms"]
    if "ms" in res["triton"] and "ms" in res["sdpa_default"]:
        res["triton_vs_sdpa_default"] = res["sdpa_default"]["ms"] / res["triton"]["ms"]
    if "ms" in res["hopper"] and "ms" in res["triton"]:
        res["hopper_vs_triton_kernel"] = res["triton"]["kernel_ms"] / res["hopper"]["kernel_ms"]
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x16384,1x4096,8x2048,4x1000")
    parser.add_argument("--d64", default="1x8192,16x512", help="shapes at 32 / 8 heads, D 64")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/extend_hopper_h200.json")
    args = parser.parse_args()
    results = []
    cases = [(s, 32, 8, 128) for s in args.shapes.split(",") if s]
    cases += [(s, 32, 8, 64) for s in args.d64.split(",") if s]
    for shape, hq, hkv, dim in cases:
        bsz, tokens = (int(x) for x in shape.split("x"))
        res = bench_shape(bsz, tokens, hq, hkv, dim, args.reps)
        results.append(res)
        line = " ".join(
            f"{n} {res[n].get('ms', float('nan')):.3f}ms"
            f"({res[n].get('kernel_ms', float('nan')):.3f})/{res[n]['max_abs_err']:.1e}"
            for n in ("hopper", "triton", "sdpa_default", "sdpa_gqa")
        )
        print(f"{shape} D{dim}: {line} | x sdpa {res.get('hopper_vs_sdpa_default', 0):.3f} "
              f"x triton {res.get('hopper_vs_triton', 0):.3f} "
              f"(kernels {res.get('hopper_vs_triton_kernel', 0):.3f})", flush=True)  # fmt: skip
    save_json(args.out, {"env": environment(), "results": results})


if __name__ == "__main__":
    main()
