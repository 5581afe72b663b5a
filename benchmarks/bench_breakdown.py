"""Where one decode (or prefill) step's device time goes, per op class, beside its roofline.

For each model (bench_e2e's random-init Llama-3.2-1B and gpt-oss shapes, no
download), ``--requests`` prompts of ``--prompt-len`` tokens are prefilled, then
decoded; after ``--warm`` full-batch decode steps (so the contexts are real,
about prompt + warm tokens) ``--steps`` steps run under ``torch.profiler``
(the GPU synchronised at both ends, so exactly those steps are recorded). Every
kernel of the trace is put in one class by its name (``CLASSES``, first match
wins): gemm, attention, store, norm, rope, activation, moe, sampling, other.

Each class is set beside its roofline, max(bytes / copy bandwidth, FLOPs / bf16
matmul rate), both rates measured in this run (``step_roofline``: the bytes and
FLOPs a decode step of that class must move and do, from the model's shape; MoE
experts: the experts a batch hits, read once). bench_e2e's roofline is the same
model summed over classes.

    python benchmarks/bench_breakdown.py [--models llama,gpt-oss] [--requests 256]
    python benchmarks/bench_breakdown.py --device cpu --tiny   # a smoke test of the plumbing

``--phase prefill --prefill-graphs ab`` runs each model twice in one process, the
engine's ``prefill_graphs`` off then on (issue 38 item 5), and adds per setting the
unprofiled prefill step wall ms (p50, every prompt at t0) and TTFT percentiles; the
summary ``prefill_graphs_ab`` sets both beside the eager run's device ms. Models may
also be bench_families' hybrid shapes (``qwen3_5``, ``nemotron_h``: no roofline here):

    python benchmarks/bench_breakdown.py --phase prefill --prefill-graphs ab --gaps \
        --models llama,qwen3_5

JSON to ``benchmarks/results/breakdown_<device>.json`` and, when set, ``$OUT``.
On CPU the trace holds nested CPU ops (times overlap): the figures are a smoke
test only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# class -> lower-case substrings of kernel names; the first class that matches wins
CLASSES = {
    "activation": ("silu", "gelu", "swiglu", "act_and_mul"),
    "moe": ("moe", "_gate_up_kernel", "_down_kernel", "expert", "topk", "router", "grouped"),
    "attention": ("decode_split", "decode_merge", "_extend", "attention", "flash", "fmha", "sdpa"),
    "store": ("store_kv", "_store", "copy_rows"),
    "norm": ("rms_norm", "layer_norm", "pow_tensor", "meanops", "rsqrt"),
    "rope": ("rope", "rotary"),
    "gemm": ("gemm", "nvjet", "xmma", "cutlass", "cublas", "gemv", "splitkreduce", "matmul"),
    "sampling": ("argmax", "gumbel", "sample"),
}
ORDER = (*CLASSES, "other")
SPARE_TOKENS = 8  # generated past the profiled steps (the engine keeps one step in flight)


def classify(name: str) -> str:
    """The op class of a kernel (or CPU op) name."""
    low = name.lower()
    for cls, patterns in CLASSES.items():
        if any(p in low for p in patterns):
            return cls
    return "other"


# -- the roofline model ------------------------------------------------------------------


def matmul_rate(device: str) -> float:
    """Dense matmul FLOP/s measured now: bf16 8192^3 on CUDA (the best of three
    medians, after a second of matmuls brings the clocks up: a cold first
    measurement read 716 against 785-788 TFLOP/s in the same lease), fp32 1024^3
    on CPU."""
    if device == "cuda":
        from benchmarks.common import bench_us

        n = 8192
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        for _ in range(500):  # about a second at 1.4 ms a product
            a @ b
        us = min(bench_us(lambda: a @ b, 10, 50) for _ in range(3))
        return 2 * n**3 / (us * 1e-6)
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    start = time.perf_counter()
    for _ in range(3):
        a @ b
    return 3 * 2 * n**3 / (time.perf_counter() - start)


def _shape(cfg: dict) -> dict:
    """The dims a step's cost depends on, from a transformers config.json dict."""
    h, hq = cfg["hidden_size"], cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["full_attention"] * layers
    window = cfg.get("sliding_window")
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    return {
        "h": h,
        "hq": hq,
        "hk": cfg.get("num_key_value_heads", hq),
        "d": cfg.get("head_dim") or h // hq,
        "inter": cfg["intermediate_size"],
        "vocab": cfg["vocab_size"],
        "windows": [window if t == "sliding_attention" else None for t in types[:layers]],
        "experts": experts,
        "topk": cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0,
    }


def step_work(cfg: dict, batch: int, context: float, itemsize: int) -> dict:
    """{class: (bytes, FLOPs)} one decode step of ``batch`` requests at mean
    ``context`` must move and do (activations included; weights read once)."""
    s, b, it = _shape(cfg), batch, itemsize
    h, hq, hk, d, inter, n = s["h"], s["hq"], s["hk"], s["d"], s["inter"], len(s["windows"])
    qkv_o = h * (hq + 2 * hk) * d + hq * d * h
    moe = s["experts"] > 0
    dense = n * (qkv_o + (h * s["experts"] if moe else 3 * h * inter)) + s["vocab"] * h
    work = {
        "gemm": (dense * it + 2 * b * (n * 6 * h + s["vocab"]) * it, 2 * b * dense),
        "store": (n * b * 2 * hk * d * it * 2, 0),
        "norm": ((2 * n + 1) * 4 * b * h * it, 0),
        "rope": (n * b * (2 * (hq + hk) * d * it + 4 * d), 0),
        "sampling": (b * s["vocab"] * it, 0),
        "other": (b * h * it, 0),  # the embedding rows
    }
    kv = sum(min(context, w) if w else context for w in s["windows"])  # tokens read per request
    work["attention"] = (b * kv * 2 * hk * d * it + n * b * 2 * hq * d * it, 4 * b * hq * d * kv)
    rows = b * (s["topk"] if moe else 1)  # rows through the (expert) MLPs
    work["activation"] = (n * 3 * rows * inter * it, 0)
    if moe:
        e, k = s["experts"], s["topk"]
        hit = e * (1 - (1 - k / e) ** b)  # expected distinct experts a batch routes to
        expert = 3 * h * inter  # gate_up + down of one expert
        acts = n * rows * (2 * h + 3 * inter) * it
        work["moe"] = (n * hit * expert * it + acts, 2 * n * rows * expert)
    return work


def prefill_work(cfg: dict, tokens: int, prompt: int, itemsize: int) -> dict:
    """{class: (bytes, FLOPs)} of one prefill step of ``tokens`` prompt tokens, whole
    fresh prompts of ``prompt`` tokens: a decode step's work at batch ``tokens`` and
    mean context ``prompt / 2`` (causal attention), except that attention moves each
    token's q, k, v and output once (its K/V tiles are reused on chip, not re-read
    per query) and only the prompts' last rows go through the lm_head and the sampler."""
    s, it = _shape(cfg), itemsize
    work = step_work(cfg, tokens, prompt / 2, it)
    n, hq, hk, d = len(s["windows"]), s["hq"], s["hk"], s["d"]
    work["attention"] = (n * tokens * 2 * (hq + hk) * d * it, work["attention"][1])
    rows = -(-tokens // prompt)  # prompts ending in the step: their logits rows
    vocab = s["vocab"] * s["h"]
    nbytes, nflops = work["gemm"]
    work["gemm"] = (nbytes, nflops - 2 * (tokens - rows) * vocab)
    work["sampling"] = (rows * s["vocab"] * it, 0)
    if s["experts"]:  # every expert is hit; the routed rows are already tokens * topk
        n, e, expert = len(s["windows"]), s["experts"], 3 * s["h"] * s["inter"]
        acts = n * tokens * s["topk"] * (2 * s["h"] + 3 * s["inter"]) * it
        work["moe"] = (n * e * expert * it + acts, work["moe"][1])
    return work


def step_roofline(
    cfg: dict,
    batch: int,
    context: float,
    itemsize: int,
    copy_bps: float,
    flops: float,
    work: dict | None = None,
) -> dict:
    """Per class {bytes, flops, ms, bound} and the step's total ``step_ms`` (the sum
    over classes of max(bytes / copy_bps, flops / flops)); ``work`` (``prefill_work``)
    replaces the decode step's."""
    classes = {}
    work = work or step_work(cfg, batch, context, itemsize)
    for cls, (nbytes, nflops) in work.items():
        t_bytes, t_flops = nbytes / copy_bps, nflops / flops
        classes[cls] = {
            "bytes": nbytes,
            "flops": nflops,
            "ms": max(t_bytes, t_flops) * 1e3,
            "bound": "flops" if t_flops > t_bytes else "bytes",
        }
    return {"classes": classes, "step_ms": sum(c["ms"] for c in classes.values())}


def prefill_roofline_ms(cfg: dict, batch: int, prompt: int, flops: float) -> float:
    """Prefill of ``batch`` prompts of ``prompt`` tokens: its GEMM and causal
    attention FLOPs at the matmul rate (prefill is compute-bound)."""
    s = _shape(cfg)
    h, hq, hk, d = s["h"], s["hq"], s["hk"], s["d"]
    mlp = 3 * h * s["inter"] * (s["topk"] if s["experts"] else 1) + h * s["experts"]
    per_token = len(s["windows"]) * (h * (hq + 2 * hk) * d + hq * d * h + mlp)
    attn = sum(2 * hq * d * min(prompt, w or prompt) * prompt for w in s["windows"])
    return (2 * batch * prompt * per_token + batch * attn) / flops * 1e3


# -- the profile -------------------------------------------------------------------------


def _kernels(trace: dict, device: str) -> list[tuple[str, float]]:
    """(name, microseconds) of every kernel (CPU op on CPU) of a chrome trace."""
    cats = ("kernel", "gpu_memcpy", "gpu_memset") if device == "cuda" else ("cpu_op",)
    return [
        (e["name"], float(e.get("dur", 0.0)))
        for e in trace["traceEvents"]
        if e.get("cat") in cats and e.get("ph") == "X"
    ]


def idle_gaps(trace: dict, steps: int, limit: int = 12) -> dict:
    """Where the device sat idle between the profiled steps' kernels and copies: per
    step, the span from the first start to the last end, the busy time (the union of
    the intervals), the overlap PDL bought (durations summed minus busy), and the idle
    gaps longer than 0.2 us summed by (the op before, the op after)."""
    evs = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"][:70])
        for e in trace["traceEvents"]
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"
    )
    if not evs:
        return {}
    busy, total, end, last, pairs = 0.0, 0.0, evs[0][1], evs[0][2], {}
    start = evs[0][0]
    busy_lo = start
    for lo, hi, name in evs[1:]:
        total += hi - lo
        if lo > end:
            busy += end - busy_lo
            if lo - end > 0.2:
                pairs.setdefault((last, name), []).append(lo - end)
            busy_lo = lo
        if hi > end:
            end, last = hi, name
    busy += end - busy_lo
    total += evs[0][1] - evs[0][0]
    ranked = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:limit]
    return {
        "span_us": (end - start) / steps,
        "busy_us": busy / steps,
        "idle_us": (end - start - busy) / steps,
        "overlap_us": (total - busy) / steps,
        "gaps": [
            {"before": a, "after": b, "us": sum(v) / steps, "per_step": len(v) / steps}
            for (a, b), v in ranked
        ],
    }


def profile_steps(llm, prompts, args) -> tuple[list[tuple[str, float]], float, dict]:
    """Kernels of ``args.steps`` full-batch decode steps after ``args.warm`` of
    them, the wall ms per profiled step (GPU synchronised at both ends) and the idle
    gaps between them (``idle_gaps``). ``--gaps`` records the device only (the host's
    op records slow it, so that its gaps would show the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from unikv.engine import SamplingParams

    acts = [] if args.gaps and args.device == "cuda" else [ProfilerActivity.CPU]
    acts += [ProfilerActivity.CUDA] if args.device == "cuda" else []
    prof = profile(activities=acts)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    seen, clock = [0], {}

    def wanted(batch) -> bool:
        if args.phase == "prefill":  # a full chunk of prompt tokens
            return not batch.is_decode and sum(batch.num_new) > args.chunk // 2
        return batch.is_decode and len(batch.requests) == len(prompts)

    def hook(_llm, batch, _logits) -> None:
        if not wanted(batch):
            return
        seen[0] += 1
        if seen[0] == args.warm:
            sync()
            prof.start()
            clock["start"] = time.perf_counter()
        elif seen[0] == args.warm + args.steps:
            sync()
            clock["end"] = time.perf_counter()
            prof.stop()

    # requests finish prefill up to one chunk-step apart and stop that far apart: the
    # full batch lasts max_tokens minus the prefill steps (127 of 144 at 256 x 512, H200)
    lag = -(-len(prompts) * args.prompt_len // args.chunk) + 1
    tokens = args.warm + args.steps + SPARE_TOKENS + lag
    try:
        llm.generate(
            prompts,
            SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0),
            on_step=hook,
        )
    finally:
        if "start" in clock and "end" not in clock:
            prof.stop()
    if "end" not in clock:
        raise RuntimeError(f"only {seen[0]} full {args.phase} steps ran; need warm + steps")
    path = Path(tempfile.mkdtemp(prefix="unikv_trace_")) / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    shutil.rmtree(path.parent, ignore_errors=True)
    wall = (clock["end"] - clock["start"]) * 1e3 / args.steps
    gaps = idle_gaps(trace, args.steps) if args.device == "cuda" else {}
    return _kernels(trace, args.device), wall, gaps


def breakdown(kernels, steps: int, roof: dict) -> dict:
    """Per class: measured ms and kernels per step, beside its roofline."""
    out = {}
    for cls in ORDER:
        mine = [us for name, us in kernels if classify(name) == cls]
        ms = sum(mine) / steps / 1e3
        r = roof["classes"].get(cls, {"ms": 0.0, "bytes": 0, "flops": 0, "bound": "-"})
        out[cls] = {
            "ms": ms,
            "kernels": len(mine) / steps,
            "roofline_ms": r["ms"],
            "roofline_bound": r["bound"],
            "bytes": r["bytes"],
            "flops": r["flops"],
            "x_roofline": ms / r["ms"] if r["ms"] > 0 else None,
        }
    return out


def top_other(kernels, steps: int, limit: int = 15) -> list[dict]:
    """The costliest kernel names left in 'other' (what to classify or fuse next)."""
    totals: dict[str, list[float]] = {}
    for name, us in kernels:
        if classify(name) == "other":
            totals.setdefault(name[:160], []).append(us)
    ranked = sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:limit]
    return [{"name": n, "ms": sum(v) / steps / 1e3, "per_step": len(v) / steps} for n, v in ranked]


def model_config(name: str, tiny: bool) -> dict:
    """config.json of shape ``name``: bench_e2e's (llama, gpt-oss), else bench_families'
    (qwen3_5, nemotron_h, ...: no roofline here, their step has no model of its own)."""
    from benchmarks import bench_e2e as e2e

    if name in e2e.MODELS:
        return e2e.model_config(name, tiny)
    from benchmarks import bench_families

    return bench_families.model_config(name, tiny)


def graph_modes(args) -> list[bool]:
    """``--prefill-graphs``: the prefill_graphs settings run, in order (ab: off, then on)."""
    return {"off": [False], "on": [True], "ab": [False, True]}[args.prefill_graphs]


def run_model(name: str, args, copy_bps: float, flops: float) -> list[dict]:
    """One entry per ``graph_modes`` setting, over one saved model."""
    from benchmarks import bench_e2e as e2e

    workdir = Path(tempfile.mkdtemp(prefix=f"unikv_breakdown_{name}_"))
    entries = []
    try:
        cfg = model_config(name, args.tiny)
        e2e.save_model(name, workdir, args.device, args.dtype, args.tiny, cfg=cfg)
        for graphs in graph_modes(args):
            entries.append(run_setting(name, cfg, workdir, args, copy_bps, flops, graphs))
    except Exception as err:  # noqa: BLE001 - recorded; the next model still runs
        entries.append({"model": name, "error": f"{type(err).__name__}: {err}",
                        "traceback": traceback.format_exc()[-3000:]})  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return entries


def run_setting(name, cfg, workdir, args, copy_bps, flops, graphs: bool) -> dict:
    from benchmarks import bench_e2e as e2e

    entry: dict = {
        "model": name,
        "phase": args.phase,
        "prefill_graphs": graphs,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "chunk": args.chunk,
    }
    try:
        prompts = e2e.make_prompts(args.requests, args.prompt_len, cfg["vocab_size"])
        lag = -(-args.requests * args.prompt_len // args.chunk) + 1  # as in profile_steps
        max_len = args.prompt_len + args.warm + args.steps + SPARE_TOKENS + lag + 8
        llm = e2e._unikv_llm(workdir, args.requests, max_len, args, prefill_graphs=graphs)
        llm.generate(prompts[:8], e2e_params(4))  # compile every kernel before timing
        kernels, wall_ms, gaps = profile_steps(llm, prompts, args)
        itemsize = torch.empty((), dtype=args.dtype).element_size()
        if name not in e2e.MODELS:  # (no roofline model of this shape here)
            context, roof = args.prompt_len / 2, {"classes": {}, "step_ms": float("nan")}
        elif args.phase == "prefill":
            context = args.prompt_len / 2
            work = prefill_work(cfg, args.chunk, args.prompt_len, itemsize)
            roof = step_roofline(cfg, args.requests, context, itemsize, copy_bps, flops, work)
        else:
            context = args.prompt_len + args.warm + args.steps / 2
            roof = step_roofline(cfg, args.requests, context, itemsize, copy_bps, flops)
        classes = breakdown(kernels, args.steps, roof)
        device_ms = sum(c["ms"] for c in classes.values())
        if not kernels:
            entry["warning"] = "the trace holds no kernels: rerun with --no-graphs"
        entry.update(
            mean_context=context,
            cuda_graphs=llm.runner.graphs is not None,
            step_wall_ms=wall_ms,
            step_device_ms=device_ms,
            kernels_per_step=len(kernels) / args.steps,
            roofline_step_ms=roof["step_ms"],
            step_x_roofline=wall_ms / roof["step_ms"],
            device_x_roofline=device_ms / roof["step_ms"],
            classes=classes,
            top_other=top_other(kernels, args.steps),
            idle=gaps,
        )
        if args.phase == "prefill":
            entry.update(prefill_timing(llm, prompts))
        if llm.runner.prefill_graphs is not None:
            entry["prefill_graph_replays"] = dict(llm.runner.prefill_graphs.replays)
        del llm
        e2e._free()
    except Exception as err:  # noqa: BLE001 - recorded; the next setting still runs
        entry["error"] = f"{type(err).__name__}: {err}"
        entry["traceback"] = traceback.format_exc()[-3000:]
    return entry


def prefill_timing(llm, prompts) -> dict:
    """Unprofiled: every prompt at t0 (the prefix cache emptied first), each step
    clocked (bench_e2e's ``_StepClock``): TTFT percentiles and the median wall ms of
    the prefill (extend) steps after the first."""
    import numpy as np

    from benchmarks import bench_e2e as e2e

    llm.reset_prefix_cache()
    clock = e2e._StepClock()
    llm.generate(prompts, e2e_params(2), on_step=clock)
    ttft = [times[0] - clock.t0 for times in clock.stamps.values() if times]
    steps = [sec for sec, decode, _ in clock.steps[1:] if not decode]
    out = e2e.latency(ttft, [])
    out["prefill_step_wall_ms_p50"] = float(np.median(steps)) * 1e3 if steps else None
    return out


def prefill_ab(entries: list[dict]) -> dict:
    """Per model with both settings: the prefill step's unprofiled wall ms, its device
    ms (profiled), wall over the eager run's device time, TTFT p50, off and on."""
    out = {}
    for name in dict.fromkeys(e["model"] for e in entries):
        got = {e.get("prefill_graphs"): e for e in entries if e["model"] == name}
        off, on = got.get(False), got.get(True)
        if off is None or on is None or "error" in off or "error" in on:
            continue
        device = off["step_device_ms"]  # the same kernels: the eager trace's time
        row = {}
        for key, e in (("off", off), ("on", on)):
            wall = e.get("prefill_step_wall_ms_p50")
            row[key] = {
                "step_wall_ms": wall,
                "step_device_ms": e["step_device_ms"],
                "wall_x_eager_device": wall / device if wall and device else None,
                "ttft_p50_ms": e.get("ttft_p50_ms"),
                "kernels_per_step": e["kernels_per_step"],
            }
        if row["off"]["step_wall_ms"] and row["on"]["step_wall_ms"]:
            row["wall_speedup"] = row["off"]["step_wall_ms"] / row["on"]["step_wall_ms"]
        if row["off"]["ttft_p50_ms"] and row["on"]["ttft_p50_ms"]:
            row["ttft_p50_speedup"] = row["off"]["ttft_p50_ms"] / row["on"]["ttft_p50_ms"]
        out[name] = row
    return out


def e2e_params(tokens: int):
    from unikv.engine import SamplingParams

    return SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)


def table(entry: dict) -> str:
    if "error" in entry:
        return f"{entry['model']}: FAILED {entry['error']}"
    graphs = " (prefill graphs)" if entry.get("prefill_graphs") else ""
    head = (
        f"{entry['model']} {entry['phase']}{graphs}: B {entry['requests']}, "
        f"chunk {entry['chunk']}, "
        f"mean context {entry['mean_context']:.0f}, "
        f"step wall {entry['step_wall_ms']:.2f} ms, device {entry['step_device_ms']:.2f} ms, "
        f"roofline {entry['roofline_step_ms']:.2f} ms ({entry['step_x_roofline']:.2f}x), "
        f"{entry['kernels_per_step']:.0f} kernels"
    )
    lines = [
        head,
        "| class | ms | kernels | roofline ms (bound) | x roofline |",
        "|---|---|---|---|---|",
    ]
    for cls, c in entry["classes"].items():
        x = f"{c['x_roofline']:.2f}" if c["x_roofline"] is not None else "-"
        lines.append(
            f"| {cls} | {c['ms']:.3f} | {c['kernels']:.0f} | "
            f"{c['roofline_ms']:.3f} ({c['roofline_bound']}) | {x} |"
        )
    idle = entry.get("idle") or {}
    if idle:
        lines.append(
            f"device span {idle['span_us']:.1f} us a step: busy {idle['busy_us']:.1f}, idle "
            f"{idle['idle_us']:.1f}, PDL overlap {idle['overlap_us']:.1f}; idle gaps:"
        )
        lines += [f"  {g['us']:6.2f} us ({g['per_step']:.1f}x) {g['before']} -> {g['after']}"
                  for g in idle["gaps"]]  # fmt: skip
    if entry.get("prefill_step_wall_ms_p50") is not None:
        lines.append(
            f"unprofiled: prefill step wall p50 {entry['prefill_step_wall_ms_p50']:.2f} ms, "
            f"TTFT p50 {entry.get('ttft_p50_ms', float('nan')):.1f} ms"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny models, 4 requests (smoke test)")
    p.add_argument("--models", default="llama,gpt-oss")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument(
        "--phase",
        choices=("decode", "prefill"),
        default="decode",
        help="profile full-batch decode steps, or prefill steps of a full chunk",
    )
    p.add_argument("--warm", type=int, default=None, help="steps of the phase before the profile")
    p.add_argument("--steps", type=int, default=None, help="steps of the phase profiled")
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--gaps", action="store_true", help="record the device only (idle gaps)")
    p.add_argument(
        "--prefill-graphs",
        choices=("off", "on", "ab"),
        default="off",
        help="the engine's prefill_graphs: off, on, or ab (both, off first, one process; "
        "the A/B summary under 'prefill_graphs_ab')",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    prefill = args.phase == "prefill"
    args.requests = args.requests or (16 if args.tiny and prefill else 4 if args.tiny else 256)
    args.prompt_len = args.prompt_len or (32 if args.tiny else 512)
    args.warm = args.warm or (1 if prefill else 3 if args.tiny else 128)
    args.steps = args.steps or (2 if args.tiny else 4 if prefill else 8)
    args.chunk = args.chunk or (64 if args.tiny else 8192)
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    suffix = "h200" if args.device == "cuda" and not args.tiny else f"{args.device}_tiny"
    suffix += "_prefill" if prefill else ""
    args.out = args.out or str(ROOT / f"benchmarks/results/breakdown_{suffix}.json")
    return args


def main(argv=None) -> dict:
    from benchmarks.bench_e2e import copy_bandwidth
    from benchmarks.common import environment

    args = parse_args(argv)
    copy_bps, flops = copy_bandwidth(args.device), matmul_rate(args.device)
    results = {
        "env": {**environment(), "device": args.device},
        "copy_GBps": copy_bps / 1e9,
        "matmul_TFLOPs": flops / 1e12,
        "dtype": str(args.dtype),
        "models": [],
    }
    outs = [Path(args.out)]
    if os.environ.get("OUT"):
        outs.append(Path(os.environ["OUT"]) / Path(args.out).name)
    for name in args.models:
        print(f"[{name}] ...", flush=True)
        for entry in run_model(name, args, copy_bps, flops):
            results["models"].append(entry)
            print(table(entry), flush=True)
        if args.prefill_graphs == "ab":
            results["prefill_graphs_ab"] = prefill_ab(results["models"])
            print(json.dumps(results["prefill_graphs_ab"].get(name), indent=1), flush=True)
        for out in outs:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1, default=str))
    print(f"saved {', '.join(map(str, outs))}")
    return results


if __name__ == "__main__":
    main()
