"""End to end: unikv's engine against transformers on the same random-init models.

Models (bf16 on CUDA, built with transformers from configs in this file, saved
with ``save_pretrained`` to a temp dir; no download):
- ``llama``: Llama-3.2-1B-shaped (hidden 2048, 16 layers, 32/8 heads, head dim
  64, intermediate 8192, vocab 128256, tied embeddings);
- ``gpt-oss``: gpt-oss-20b-shaped (hidden 2880, 64/8 heads, head dim 64, 32
  experts top-4, window 128, sinks) with 4 layers (sliding, full, sliding, full).

Workload: 256 requests of 512 random token ids (fixed seed), 256 new tokens
each, greedy, EOS ignored. Paths, one at a time in this process:
- ``unikv``: ``LLM.generate`` (CUDA graphs for decode), all requests at t0;
- ``hf_static`` / ``hf_dynamic``: transformers ``generate`` (static / dynamic
  cache; sdpa for Llama, eager for gpt-oss, which has no sdpa), in batches of
  ``--hf-batch``; torch.compile off unless ``--hf-compile``;
- ``hf_cb``: transformers continuous batching ``generate_batch``.

Reported per path: output tokens/s, TTFT and inter-token latency p50/p90/p99
(all requests arrive at t0), and the fraction of the roofline (``roofline``):
per decode step, the sum over op classes of max(bytes / device-copy bandwidth,
FLOPs / bf16 matmul rate), both measured in this run; the whole run adds the
prefill's FLOPs. unikv's full-batch decode step is also set against the step's
roofline. A failing path is recorded (error, traceback)
and the run goes on. ``--quick``: the transformers paths generate 64 tokens
instead of 256 (say so in the JSON); ``--device cpu --tiny``: tiny models, 8
requests (a smoke test of this script).

Usage: ``python benchmarks/bench_e2e.py --device cuda [--quick] [--models llama,gpt-oss]``
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PATHS = ("unikv", "hf_dynamic", "hf_static", "hf_cb")
CACHING = {"auto": None, "on": True, "off": False}  # --prefix-caching: LLM's argument
MODELS = ("llama", "gpt-oss")
PRESETS = ROOT / "unikv/presets"


# -- models ------------------------------------------------------------------------------


def model_config(name: str, tiny: bool) -> dict:
    """config.json content of benchmark model ``name`` (``tiny``: a few-KB version)."""
    common = {
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    if name == "llama":
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            "hidden_act": "silu",
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
        if tiny:
            cfg.update(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=512,
            )
    elif name == "gpt-oss":
        preset = "demo-gpt-oss.json" if tiny else "gpt-oss-20b.json"
        cfg = json.loads((PRESETS / preset).read_text())
        cfg.pop("_source", None)
        if not tiny:
            cfg.update(num_hidden_layers=4, layer_types=cfg["layer_types"][:4])
    else:
        raise ValueError(f"model must be 'llama' or 'gpt-oss', got {name!r}")
    cfg.update(common)
    return cfg


def save_model(
    name: str, path: Path, device: str, dtype: torch.dtype, tiny: bool, cfg: dict | None = None
) -> None:
    """Random-init transformers model ``name`` (seed 0), saved to ``path``; ``cfg``: its
    config.json (default: ``model_config(name, tiny)``)."""
    import transformers as tf

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg or model_config(name, tiny)))
    config = tf.AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    del model


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=g).tolist()


# -- ceilings and roofline ---------------------------------------------------------------


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy in bytes/s (bytes read + written), measured now."""
    if device == "cuda":
        from benchmarks.common import bench_us

        a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        us = bench_us(lambda: b.copy_(a), 5, 30)
        del a, b
        torch.cuda.empty_cache()
        return 2 * (1 << 31) / (us * 1e-6)
    a = torch.ones(1 << 26, dtype=torch.uint8)
    b = torch.empty_like(a)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - start)
    return 2 * a.numel() / float(np.median(times))


def roofline(
    cfg: dict, dtype: torch.dtype, batch: int, prompt: int, new_tokens: int, rates: tuple
) -> dict:
    """The workload's roofline from the model's shape (``bench_breakdown``'s model).

    A decode step at the mean context: the sum over op classes (GEMM, attention,
    store, norm, rope, activation, MoE, sampling) of max(bytes / copy bandwidth,
    FLOPs / bf16 matmul rate), ``rates`` = (copy B/s, matmul FLOP/s) measured in
    this run; MoE experts read once per step (those the batch hits). The whole
    run adds the prefill's FLOPs at the matmul rate."""
    from benchmarks.bench_breakdown import prefill_roofline_ms, step_roofline

    copy_bps, flops = rates
    context = prompt + new_tokens / 2
    itemsize = torch.empty((), dtype=dtype).element_size()
    step = step_roofline(cfg, batch, context, itemsize, copy_bps, flops)
    prefill_ms = prefill_roofline_ms(cfg, batch, prompt, flops)
    run_s = (prefill_ms + new_tokens * step["step_ms"]) / 1e3
    classes = step["classes"]
    return {
        "weight_bytes": classes["gemm"]["bytes"] + classes.get("moe", {}).get("bytes", 0),
        "kv_bytes": classes["attention"]["bytes"],
        "mean_context": context,
        "batch": batch,
        "copy_GBps": copy_bps / 1e9,
        "matmul_TFLOPs": flops / 1e12,
        "classes": classes,
        "step_ms": step["step_ms"],
        "prefill_ms": prefill_ms,
        "run_s": run_s,
        "decode_tokens_per_s": batch / step["step_ms"] * 1e3,
        "tokens_per_s": batch * new_tokens / run_s,
    }


def latency(ttft: list[float], itl: list[float]) -> dict:
    """p50/p90/p99 in ms of time-to-first-token and inter-token latency samples."""
    out = {}
    for key, values in (("ttft", ttft), ("itl", itl)):
        if values:
            for q in (50, 90, 99):
                out[f"{key}_p{q}_ms"] = float(np.percentile(values, q)) * 1e3
    return out


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- paths -------------------------------------------------------------------------------


def _unikv_llm(path: Path, n: int, max_len: int, args, **extra):
    """An LLM whose pool holds all ``n`` requests at once (no preemption); ``extra``:
    more ``LLM`` options (``prefill_graphs``)."""
    from unikv.engine import LLM
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for, worst_case_pages

    configs = specs_from_hf_config(path, page_size=args.page_size, dtype=args.dtype)
    pages = {
        c.name: n * worst_case_pages(c.spec, c.page_size, max_len, args.chunk) for c in configs
    }
    kv_bytes = int(pool_bytes_for(configs, pages) * 1.25)
    return LLM(
        str(path),
        device=args.device,
        dtype=args.dtype,
        kv_cache_bytes=kv_bytes,
        page_size=args.page_size,
        max_num_seqs=n,
        max_num_batched_tokens=args.chunk,
        max_model_len=max_len,
        cuda_graphs=args.device == "cuda" and not getattr(args, "no_graphs", False),
        enable_prefix_caching=CACHING[getattr(args, "prefix_caching", "auto")],
        **extra,
    )


class _StepClock:
    """``on_step`` hook: the time of every step and of every request's tokens.
    The engine keeps one step in flight: when step N's hook runs, step N-1's
    tokens are on the host and step N's are placeholders (negative ids), so a
    token is stamped at the first hook that sees its value."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.stamps: dict[int, list[float]] = {}
        self.steps: list[tuple[float, bool, int]] = []  # (seconds, is_decode, batch size)

    def __call__(self, _llm, batch, _logits) -> None:
        now = time.perf_counter()
        self.steps.append((now - self.last, batch.is_decode, len(batch.requests)))
        self.last = now
        for r in batch.requests:
            got = self.stamps.setdefault(r.request_id, [])
            known = len(r.output_ids) - (bool(r.output_ids) and r.output_ids[-1] < 0)
            if known > len(got):
                got.append(now)


def run_unikv(path: Path, prompts, new_tokens: int, args) -> dict:
    """unikv's LLM over the whole workload, all requests at t0."""
    from benchmarks.common import GcWatch, JitWatch, allocator_counts
    from unikv.engine import SamplingParams

    n = len(prompts)
    start = time.perf_counter()
    llm = _unikv_llm(path, n, len(prompts[0]) + new_tokens + 8, args)
    init_s = time.perf_counter() - start
    llm.generate(
        prompts, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    )  # JIT: every step shape
    warmup_s = time.perf_counter() - start - init_s
    llm.reset_prefix_cache()  # the timed run prefills the same prompts: no hits from warm-up
    clock = _StepClock()
    cuda = args.device == "cuda"
    alloc_before = allocator_counts() if cuda else {}
    with JitWatch() as watch, GcWatch() as gcs:  # stalls the warm-up did not cover
        outputs = llm.generate(
            prompts,
            SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0),
            on_step=clock,
        )
    alloc = {k: v - alloc_before[k] for k, v in allocator_counts().items()} if cuda else {}
    wall = time.perf_counter() - clock.t0
    made = sum(len(o.output_ids) for o in outputs)
    full = [s for s, dec, b in clock.steps if dec and b == n]
    stats = llm.stats
    res = {
        "requests": n,
        "new_tokens": new_tokens,
        "output_tokens": made,
        "seconds": wall,
        "output_tokens_per_s": made / wall,
        "init_s": init_s,
        "warmup_s": warmup_s,
        "steps": stats.steps,
        "decode_steps": stats.decode_steps,
        "preemptions": stats.preemptions,
        "peak_pages": stats.peak_pages,
        "kv_cache_bytes": llm.pool.total_bytes,
        "chunk_tokens": args.chunk,
        "page_size": args.page_size,
        "cuda_graphs": llm.runner.graphs is not None,
        "prefix_caching": llm.prefix_caching,
        "full_batch_decode_step_ms_p50": float(np.median(full)) * 1e3 if full else None,
        "first_tokens": [o.output_ids[0] for o in outputs],
        "jit_compiles_in_run": watch.summary() if cuda else [],
        "gc_in_run": gcs.summary(),
        "allocator_in_run": alloc,
    }
    ttft = [times[0] - clock.t0 for times in clock.stamps.values()]
    res.update(latency(ttft, _gaps(clock.stamps.values())))
    del llm, outputs
    _free()
    return res


def _gaps(series) -> list[float]:
    return [b - a for times in series for a, b in itertools.pairwise(times)]


class _TimingStreamer:
    """A transformers streamer that stamps each generated step (after a sync)."""

    def __init__(self, sync) -> None:
        self.sync, self.times = sync, []

    def put(self, value) -> None:
        self.sync()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_model(path: Path, args):
    import transformers as tf

    attn = "eager" if args.model == "gpt-oss" else "sdpa"  # gpt-oss has no sdpa in transformers
    model = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=args.dtype, attn_implementation=attn
    )
    return model.to(args.device).eval(), attn


def run_hf_generate(path: Path, prompts, new_tokens: int, args, cache: str) -> dict:
    """transformers ``generate`` in batches of ``args.hf_batch`` (all requests at t0)."""
    from transformers import GenerationConfig

    model, attn = _hf_model(path, args)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static" if cache == "static" else None,
        disable_compile=not args.hf_compile,
    )
    warm = torch.tensor(prompts[:1], device=args.device)
    model.generate(
        warm,
        attention_mask=torch.ones_like(warm),
        generation_config=GenerationConfig(
            max_new_tokens=2, do_sample=False, pad_token_id=0, disable_compile=not args.hf_compile
        ),
    )
    ttft, itl, first, made = [], [], [], 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch):
        ids = torch.tensor(prompts[i : i + args.hf_batch], device=args.device)
        streamer = _TimingStreamer(sync)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                streamer=streamer,
            )
        times = streamer.times[1:]  # the first put is the prompt
        made += out[:, ids.shape[1] :].numel()
        first += out[:, ids.shape[1]].tolist()
        ttft += [times[0] - t0] * len(ids)
        itl += [b - a for a, b in itertools.pairwise(times)] * len(ids)
    wall = time.perf_counter() - t0
    res = {
        "requests": len(prompts),
        "new_tokens": new_tokens,
        "output_tokens": made,
        "seconds": wall,
        "output_tokens_per_s": made / wall,
        "batch": args.hf_batch,
        "attn_implementation": attn,
        "cache": cache,
        "torch_compile": args.hf_compile,
        "first_tokens": first,
    }
    res.update(latency(ttft, itl))
    del model
    _free()
    return res


def run_hf_cb(path: Path, prompts, new_tokens: int, args) -> dict:
    """transformers continuous batching ``generate_batch`` with per-token timestamps;
    the clock starts when the requests are added (after its warm-up)."""
    from transformers import GenerationConfig

    model, attn = _hf_model(path, args)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    with torch.no_grad():
        results = model.generate_batch(
            inputs=prompts, generation_config=config, record_timestamps=True
        )
    call_s = time.perf_counter() - start
    outs = list(results.values())
    errors = [o.error for o in outs if o.error is not None]
    if len(outs) != len(prompts) or errors:
        raise RuntimeError(
            f"generate_batch returned {len(outs)}/{len(prompts)} results, errors {errors[:3]}"
        )
    t0 = min(o.created_time for o in outs)
    end = max(o.timestamps[-1] for o in outs)
    made = sum(len(o.generated_tokens) for o in outs)
    res = {
        "requests": len(prompts),
        "new_tokens": new_tokens,
        "output_tokens": made,
        "seconds": end - t0,
        "call_seconds": call_s,
        "output_tokens_per_s": made / (end - t0),
        "attn_implementation": f"paged|{attn} (or flash if installed)",
        "first_tokens": [o.generated_tokens[0] for o in outs],
    }
    res.update(
        latency([o.timestamps[0] - o.created_time for o in outs], _gaps(o.timestamps for o in outs))
    )
    del model, results, outs
    _free()
    return res


# -- driver ------------------------------------------------------------------------------


def run_model(name: str, args, rates: tuple, results: dict, save) -> None:
    """Every path on model ``name``, appended to ``results["models"]`` and saved
    after each path; a failing build or path is recorded, not fatal."""
    args.model = name
    workdir = Path(tempfile.mkdtemp(prefix=f"unikv_e2e_{name}_"))
    entry: dict = {"model": name, "config": model_config(name, args.tiny), "paths": {}}
    results["models"].append(entry)
    try:
        start = time.perf_counter()
        save_model(name, workdir, args.device, args.dtype, args.tiny)
        entry["build_s"] = time.perf_counter() - start
        prompts = make_prompts(args.requests, args.prompt_len, entry["config"]["vocab_size"])
        entry["roofline"] = roofline(
            entry["config"], args.dtype, args.requests, args.prompt_len, args.new_tokens, rates
        )
    except Exception as err:  # noqa: BLE001 - recorded; the next model still runs
        entry["error"] = f"build failed: {type(err).__name__}: {err}"
        entry["traceback"] = traceback.format_exc()[-3000:]
        shutil.rmtree(workdir, ignore_errors=True)
        _free()
        return
    try:
        for path in args.paths:
            print(f"[{name}] {path} ...", flush=True)
            start = time.perf_counter()
            entry["paths"][path] = _run_path(path, workdir, prompts, args)
            entry["paths"][path]["path_wall_s"] = time.perf_counter() - start
            _judge(entry, path)
            save()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_path(path: str, workdir: Path, prompts, args) -> dict:
    hf_new = args.hf_new_tokens
    try:
        if path == "unikv":
            return run_unikv(workdir, prompts, args.new_tokens, args)
        if path in ("hf_static", "hf_dynamic"):
            return run_hf_generate(workdir, prompts, hf_new, args, path.removeprefix("hf_"))
        if path == "hf_cb":
            return run_hf_cb(workdir, prompts, hf_new, args)
        raise ValueError(f"unknown path {path!r}; choose from {PATHS}")
    except Exception as err:  # noqa: BLE001 - recorded in the JSON; the other paths still run
        _free()
        return {
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc()[-3000:],
        }


def _judge(entry: dict, path: str) -> None:
    """Roofline fraction of a path, and first-token agreement with unikv."""
    res, roof = entry["paths"][path], entry.get("roofline")
    if "error" in res or roof is None:
        return
    res["fraction_of_roofline"] = res["output_tokens_per_s"] / roof["tokens_per_s"]
    step = res.get("full_batch_decode_step_ms_p50")
    if step:
        res["decode_step_fraction_of_roofline"] = roof["step_ms"] / step
        res["decode_step_x_roofline"] = step / roof["step_ms"]
    ref = entry["paths"].get("unikv", {}).get("first_tokens")
    if path != "unikv" and ref and len(ref) == len(res["first_tokens"]):
        res["first_token_agreement_with_unikv"] = float(
            np.mean([a == b for a, b in zip(ref, res["first_tokens"])])
        )


def summary(results: dict) -> str:
    head = (
        "| model | path | out tok/s | vs best HF | % roofline (run) | decode step x roofline "
        "| TTFT p50/p99 ms | ITL p50/p90/p99 ms |"
    )
    lines = [
        head,
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in results["models"]:
        if "error" in entry:
            lines.append(
                f"| {entry['model']} | (build) | FAILED: {entry['error'][:80]} | | | | | |"
            )
        paths = entry["paths"]
        hf = [
            p["output_tokens_per_s"]
            for k, p in paths.items()
            if k.startswith("hf") and "error" not in p
        ]
        best = max(hf) if hf else None
        for name, p in paths.items():
            if "error" in p:
                lines.append(f"| {entry['model']} | {name} | FAILED: {p['error'][:80]} | | | | | |")
                continue
            ratio = f"{p['output_tokens_per_s'] / best:.1f}x" if best else "-"
            frac = p.get("fraction_of_roofline")
            step_x = p.get("decode_step_x_roofline")
            step_x = f"{step_x:.2f}x" if step_x else "-"
            lines.append(
                f"| {entry['model']} | {name} | {p['output_tokens_per_s']:,.0f} | {ratio} | "
                f"{100 * frac:.1f} % | {step_x} | "
                f"{p.get('ttft_p50_ms', 0):.0f} / {p.get('ttft_p99_ms', 0):.0f} | "
                f"{p.get('itl_p50_ms', 0):.1f} / {p.get('itl_p90_ms', 0):.1f} / {p.get('itl_p99_ms', 0):.1f} |"
                if frac is not None
                else f"| {entry['model']} | {name} | {p['output_tokens_per_s']:,.0f} | {ratio} | - | - | | |"
            )
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="transformers paths generate 64 tokens")
    p.add_argument("--tiny", action="store_true", help="tiny models, 8 requests (CPU smoke test)")
    p.add_argument("--models", default="llama,gpt-oss")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--requests", type=int, default=None)
    p.add_argument(
        "--hf-batch", type=int, default=None, help="transformers generate batch (default: all)"
    )
    p.add_argument(
        "--hf-compile", action="store_true", help="let transformers torch.compile (static cache)"
    )
    p.add_argument("--chunk", type=int, default=None, help="unikv max_num_batched_tokens")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--prefix-caching",
        choices=tuple(CACHING),
        default="auto",
        help="unikv's enable_prefix_caching: auto (LLM's default: on for full attention), on, off",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.models, args.paths = args.models.split(","), args.paths.split(",")
    bad = [m for m in args.models if m not in MODELS] + [x for x in args.paths if x not in PATHS]
    if bad:
        p.error(f"unknown models/paths {bad}; models are {MODELS}, paths are {PATHS}")
    args.requests = args.requests or (8 if args.tiny else 256)
    args.prompt_len, args.new_tokens = (32, 8) if args.tiny else (512, 256)
    args.hf_new_tokens = min(args.new_tokens, 64) if args.quick else args.new_tokens
    args.hf_batch = args.hf_batch or args.requests
    args.chunk = args.chunk or (64 if args.tiny else 8192)
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    name = (
        "e2e_h200.json"
        if args.device == "cuda" and not args.tiny
        else f"e2e_{args.device}_tiny.json"
    )
    args.out = args.out or str(ROOT / "benchmarks/results" / name)
    return args


def main(argv=None) -> dict:
    import transformers

    from benchmarks.bench_breakdown import matmul_rate
    from benchmarks.common import environment

    args = parse_args(argv)
    copy_bps, flops = copy_bandwidth(args.device), matmul_rate(args.device)
    results = {
        "env": {**environment(), "transformers": transformers.__version__, "device": args.device},
        "workload": {
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "hf_new_tokens": args.hf_new_tokens,
            "greedy": True,
            "ignore_eos": True,
            "prompts": "uniform random token ids, seed 0",
        },
        "quick": args.quick,
        "tiny": args.tiny,
        "dtype": str(args.dtype),
        "note": "transformers paths generate hf_new_tokens per request (64 under --quick, else 256)",
        "copy_GBps": copy_bps / 1e9,
        "matmul_TFLOPs": flops / 1e12,
        "models": [],
    }

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))

    for name in args.models:
        run_model(name, args, (copy_bps, flops), results, save)
        save()
    table = summary(results)
    results["summary_markdown"] = table
    save()
    print(f"saved {args.out}\n\n{table}")
    return results


if __name__ == "__main__":
    main()
