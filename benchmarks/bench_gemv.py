"""One request's linear layers: cuBLAS (``F.linear``) against the Triton GEMV
(``unikv/kernels/linear/gemv.py``) at the Llama-3.2-1B shape, M = 1, bf16.

    python benchmarks/bench_gemv.py [--out benchmarks/results/gemv_h200.json]

- ``shapes``: each weight shape alone, every ``gemv.CANDIDATES`` config and cuBLAS,
  replayed in a CUDA graph over enough distinct copies of the weight that L2 (50 MB)
  never holds one (each call streams its bytes from HBM); ``of_bw`` = bytes / copy
  bandwidth / time.
- ``chain``: the decode step's GEMM sequence (16 layers of qkv, o, gate_up, down, then
  lm_head; distinct weights, 2.47 GB) in one CUDA graph, as the step runs it: cuBLAS,
  and the Triton GEMV at each shape's best config; ``of_bw`` as above; at 1, 2 and 4
  rows (``_m2``, ``_m4``: the same configs).
Every Triton output is checked against cuBLAS first (a wrong one is recorded, not timed).

    python benchmarks/bench_gemv.py --chain-sweep [--out ...]

- ``chain_sweep``: the step's GEMV chain as the engine runs it (qkv with the pre-norm
  and residual, o, gate_up with add + norm, down with SwiGLU inside, lm_head with the
  final norm), one shape's config swept over ``gemv.CANDIDATES`` at a time, the others
  at ``gemv.config_for``; the base chain is timed again before each shape. ``table``:
  each shape's fastest config where it beat the base by more than 0.5 %, as
  ``UNIKV_GEMV_TABLE`` takes it (also written to ``$OUT/gemv_table.json``).
"""

# ruff: noqa: BLE001  (a failing config is recorded, not fatal)

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import GIB, copy_ceilings, environment, graph_us, save_json
from unikv.kernels.linear import gemv

HIDDEN, INTER, VOCAB, LAYERS = 2048, 8192, 128256, 16
SHAPES = {"qkv": (3072, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}  # fmt: skip


def copies_for(n: int, k: int) -> list[torch.Tensor]:
    """Distinct weights totalling >= 256 MB (at least 2), so L2 holds none between calls."""
    count = max(2, -(-256 * 2**20 // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]


def time_over(fn_for, weights, x) -> float:
    """Microseconds per call: all the copies in one graph, the median replay / count."""
    return graph_us(lambda: [fn_for(w)(x) for w in weights], warmup=3, rep=20) / len(weights)


def step_chain(layers, head, nw, x, res, cfgs) -> torch.Tensor:
    """The decode step's GEMVs with the engine's fusions (no attention: o reads q's
    columns of the qkv output in its place)."""
    h, r = x, res
    for layer in layers:
        qkv, r = gemv.gemv(h, layer["qkv"], config=cfgs["qkv"], norm=(r, nw, 1e-5, 0.0))
        o = gemv.gemv(qkv[:, :HIDDEN], layer["o"], config=cfgs["o"])
        gate_up, r = gemv.gemv(o, layer["gate_up"], config=cfgs["gate_up"],
                               norm=(r, nw, 1e-5, 0.0))  # fmt: skip
        h = gemv.gemv(gate_up, layer["down"], config=cfgs["down"], silu_mul_input=True)
    return gemv.gemv(h, head, config=cfgs["lm_head"], norm=(r, nw, 1e-5, 0.0))[0]


def chain_sweep(out: str) -> None:
    ceilings = copy_ceilings(GIB, GIB // 16)
    bw = ceilings["d2d_GBps"] * 1e3  # bytes per us
    layers = [{s: torch.randn(*SHAPES[s], device="cuda", dtype=torch.bfloat16) * 0.02
               for s in ("qkv", "o", "gate_up", "down")} for _ in range(LAYERS)]  # fmt: skip
    head = torch.randn(*SHAPES["lm_head"], device="cuda", dtype=torch.bfloat16) * 0.02
    total = sum(w.numel() * 2 for layer in layers for w in layer.values()) + head.numel() * 2
    nw = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    base = {s: gemv.config_for(*nk) for s, nk in SHAPES.items()}
    want = step_chain(layers, head, nw, x, res, base).float()

    def timed(cfgs) -> float:
        got = step_chain(layers, head, nw, x, res, cfgs).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        if not err < 2e-2:
            raise AssertionError(f"chain output differs from the base configs' by {err:.3g}")
        return graph_us(lambda: step_chain(layers, head, nw, x, res, cfgs), 3, 20)

    rows, table, bases = [], {}, []
    for shape, (n, k) in SHAPES.items():
        base_us = timed(base)
        bases.append(base_us)
        best = (base_us, base[shape])
        for cfg in gemv.CANDIDATES:
            row = {"shape": shape, "config": list(cfg)}
            try:
                row["us"] = timed({**base, shape: cfg})
                row["vs_base"] = base_us / row["us"]
                best = min(best, (row["us"], cfg))
            except Exception as exc:
                row["error"] = repr(exc)[:500]
            rows.append(row)
        if best[1] != base[shape] and best[0] < base_us / 1.005:
            table[f"{n},{k}"] = list(best[1])
        print(shape, base_us, best, flush=True)
    chosen = {**base, **{s: tuple(table[f"{n},{k}"]) for s, (n, k) in SHAPES.items()
                         if f"{n},{k}" in table}}  # fmt: skip
    ends = {"base_us": timed(base), "table_us": timed(chosen), "base_again_us": timed(base)}
    payload = {"env": environment(), "ceilings": ceilings, "chain_bytes": total,
               "chain_ideal_us": total / bw, "bases_us": bases, "rows": rows,
               "table": table, **ends,
               "table_of_bw": total / bw / ends["table_us"]}  # fmt: skip
    print({k: v for k, v in payload.items() if k not in ("rows", "env")})
    save_json(out, payload)
    if os.environ.get("OUT"):
        save_json(os.path.join(os.environ["OUT"], "gemv_table.json"), table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gemv_h200.json")
    parser.add_argument("--chain-sweep", action="store_true", help="per-shape configs in the chain")
    args = parser.parse_args()
    if args.chain_sweep:
        chain_sweep(args.out)
        return
    ceilings = copy_ceilings(GIB, GIB // 16)
    bw = ceilings["d2d_GBps"] * 1e3  # bytes per us
    x = torch.randn(1, INTER, device="cuda", dtype=torch.bfloat16)
    rows, best = [], {}
    for name, (n, k) in SHAPES.items():
        weights = copies_for(n, k)
        xk = x[:, :k].contiguous()
        ideal = n * k * 2 / bw
        cublas = time_over(lambda w: lambda a: F.linear(a, w), weights, xk)
        rows.append({"shape": name, "N": n, "K": k, "impl": "cublas", "us": cublas,
                     "of_bw": ideal / cublas})  # fmt: skip
        want = F.linear(xk, weights[0]).float()
        best[name] = (cublas, None)
        for cfg in gemv.CANDIDATES:
            row = {"shape": name, "N": n, "K": k, "impl": "triton", "config": list(cfg)}
            rows.append(row)
            try:
                got = gemv.gemv(xk, weights[0], config=cfg).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                row["rel_err"] = err
                if not err < 2e-2:
                    row["error"] = "differs from cuBLAS; not timed"
                    continue
                row["us"] = time_over(
                    lambda w, c=cfg: lambda a: gemv.gemv(a, w, config=c), weights, xk
                )
                row["of_bw"] = ideal / row["us"]
                if row["us"] < best[name][0]:
                    best[name] = (row["us"], cfg)
            except Exception as exc:
                row["error"] = repr(exc)[:500]
        print([r for r in rows if r["shape"] == name], flush=True)
        del weights
        torch.cuda.empty_cache()
    layers = [{s: torch.randn(*SHAPES[s], device="cuda", dtype=torch.bfloat16) * 0.02
               for s in ("qkv", "o", "gate_up", "down")} for _ in range(LAYERS)]  # fmt: skip
    head = torch.randn(*SHAPES["lm_head"], device="cuda", dtype=torch.bfloat16) * 0.02
    total = sum(w.numel() * 2 for layer in layers for w in layer.values()) + head.numel() * 2

    def chain(lin, m=1):
        h = xs[:m, :HIDDEN]
        for layer in layers:
            lin(h, layer["qkv"])
            h = lin(h, layer["o"])
            g = lin(h, layer["gate_up"])
            h = lin(g[:, :INTER], layer["down"])
        return lin(h, head)

    def triton_lin(a, w):
        shape = next(s for s, nk in SHAPES.items() if nk == tuple(w.shape))
        cfg = best[shape][1]
        return F.linear(a, w) if cfg is None else gemv.gemv(a, w, config=cfg)

    xs = torch.randn(gemv.MAX_ROWS, INTER, device="cuda", dtype=torch.bfloat16)
    chains = {}
    for m in (1, 2, 4):  # the best M = 1 configs at more rows: where the GEMV stops paying
        suffix = "" if m == 1 else f"_m{m}"
        chains["cublas" + suffix] = graph_us(lambda m=m: chain(F.linear, m), 3, 20)
        chains["triton_best" + suffix] = graph_us(lambda m=m: chain(triton_lin, m), 3, 20)
    ideal = total / bw
    payload = {
        "env": environment(), "ceilings": ceilings, "rows": rows,
        "best": {s: {"us": us, "config": cfg} for s, (us, cfg) in best.items()},
        "chain": {k: {"us": v, "of_bw": ideal / v} for k, v in chains.items()},
        "chain_bytes": total, "chain_ideal_us": ideal,
    }  # fmt: skip
    print(payload["best"], payload["chain"])
    save_json(args.out, payload)
    if os.environ.get("OUT"):
        save_json(os.path.join(os.environ["OUT"], "bench_gemv.json"), payload)


if __name__ == "__main__":
    main()
