"""Hybrid models under one byte budget: unified pool vs SGLang's static split, real forwards.

Models (random-init, built with transformers' config classes, ``save_pretrained``
into a temp dir; bf16 on CUDA, fp32 on CPU):
- ``qwen3_5``: Qwen3.5-shaped, 8 layers (3 Gated DeltaNet + 1 gated full attention,
  twice): hidden 4096, GDN 16 key heads x 128, 32 value heads x 128, conv 4; full
  attention 16 q heads / 8 KV heads x 256; vocab 248,320.
- ``nemotron_h``: Nemotron-H-8B's mixer shapes, 13 layers ``M-M-M-M-M-M*-`` (attention
  is every 7th mixer): hidden 4096, Mamba-2 128 heads x 64, state 128, 8 groups, conv
  4; attention 32 / 8 KV heads x 128; relu2 MLP 21,504; vocab 131,072.

Workload (seeded): 80 % short prompts (32-1k tokens), 20 % long (4k-16k), random ids,
64-128 new tokens each (greedy, EOS ignored), all submitted at t0. ONE byte budget
per model, ``--budget-fraction`` of the bytes the whole workload would hold at once
(its state slots plus every token's KV), so memory is the constraint.

Schemes, one ``LLM`` each, in this process: ``unified`` (boundaries move) and
``static`` (``static_split``: Mamba bytes = 0.9 x full-attention bytes, SGLang's
``mamba_full_memory_ratio``). Per scheme: mean / max running requests (sampled
every step through ``on_step``), preemptions, output tokens/s, and greedy tokens
compared between the schemes; where they differ, the top-1 / top-2 logit margin at
the first difference (a near-tie under bf16 batch-shape rounding, or a bug).

Also: transformers ``generate`` (batched, greedy) on a subset of the short prompts
cut to a common length, against unikv on the same subset; and the decode step at
full batch against its roofline: per op class the max of bytes over the copy
bandwidth and FLOPs over the bf16 matmul rate (both measured in this run), summed
(GEMM weights and FLOPs, other weights, KV read, state read + write).

Usage: ``python benchmarks/bench_hybrid.py [--device cuda] [--models qwen3_5,nemotron_h]``
-> ``benchmarks/results/hybrid_h200.json``; ``--quick`` (or ``--device cpu``): tiny
models and workload (a smoke test). ``--merge A.json B.json --out C.json`` joins runs.

``--replay`` (CPU, no weights, no forwards; real shapes unless ``--quick``): the same
workload and budget through the engine's ``Scheduler`` and ``PoolAllocator``, every
sampled token a dummy. With EOS ignored the tokens do not steer the schedule, so the
running counts are the timed run's step for step (the H200 run's mean concurrency,
16.05 / 11.19 on NemotronH, to every digit). It adds the accounting: bytes per
request by part, the bytes held while requests wait, the concurrency a perfect
packing of the unified pool would hold at the same bytes per request (the oracle),
and the unified pool given the sink's bytes too (what the sink costs).
-> ``benchmarks/results/hybrid_replay.json`` (not committed).
"""

from __future__ import annotations

import argparse
import gc
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_capacity import MAMBA_FULL_MEMORY_RATIO

from unikv.inspect import human

MODELS = ("qwen3_5", "nemotron_h")
SGLANG_SPLIT = {
    "mamba": MAMBA_FULL_MEMORY_RATIO / (1 + MAMBA_FULL_MEMORY_RATIO),
    "full": 1 / (1 + MAMBA_FULL_MEMORY_RATIO),
}
SCHEMES = {"unified": None, "static": SGLANG_SPLIT}
PROGRESS_STEPS = 250  # print a progress line every this many steps


# -- models and workload -------------------------------------------------------------------


def hf_config(name: str, tiny: bool):
    """The transformers config of benchmark model ``name`` (``tiny``: a few-KB twin)."""
    import transformers as tf

    common = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": 0}
    if name == "qwen3_5":
        kw = {
            "num_hidden_layers": 8,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
            "vocab_size": 248320,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_key_head_dim": 128,
            "linear_num_value_heads": 32,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "max_position_embeddings": 32768,
        }
        tiny_kw = {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_num_value_heads": 4,
            "linear_value_head_dim": 16,
        }
        cls = tf.Qwen3_5TextConfig
    elif name == "nemotron_h":
        kw = {
            "hybrid_override_pattern": "M-M-M-M-M-M*-",
            "vocab_size": 131072,
            "hidden_size": 4096,
            "intermediate_size": 21504,
            "mamba_num_heads": 128,
            "mamba_head_dim": 64,
            "n_groups": 8,
            "ssm_state_size": 128,
            "conv_kernel": 4,
            "chunk_size": 128,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 32768,
        }
        tiny_kw = {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "ssm_state_size": 16,
            "chunk_size": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
        }
        cls = tf.NemotronHConfig
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    if tiny:  # peaked logits: greedy ties do not hinge on rounding (as in the tests)
        kw.update(tiny_kw, initializer_range=0.1, max_position_embeddings=4096)
    return cls(**common, **kw)


def build_model(name: str, path: Path, device: str, dtype: torch.dtype, tiny: bool):
    """Random-init transformers model ``name`` (seed 0) on ``device``, saved to
    ``path``; returns it (eval), sdpa attention where transformers has it."""
    import transformers as tf

    config = hf_config(name, tiny)
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = tf.AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="sdpa"
            )
        except (ValueError, ImportError):
            model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(device).eval()
    model.save_pretrained(path)
    return model


def make_workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (a ``long_fraction`` share of long ones, shuffled) and their
    new-token counts."""
    rng = np.random.default_rng(args.seed)
    n = args.requests
    is_long = rng.permutation(np.arange(n) < round(args.long_fraction * n))
    lens = np.where(is_long, rng.integers(*args.long, n), rng.integers(*args.short, n))
    max_tokens = rng.integers(*args.new_tokens, n).tolist()
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, vocab, (int(length),), generator=g).tolist() for length in lens]
    return prompts, max_tokens


def pool_budget(path: Path, prompts, max_tokens, max_len: int, split, args) -> tuple[int, dict]:
    """The byte budget: ``args.budget_fraction`` of what the whole workload holds at
    once (a state slot and every token's KV per request), raised if need be so that
    the static split holds one worst-case request (and two slots)."""
    from unikv.hf_config import specs_from_hf_config

    configs = {
        c.name: c for c in specs_from_hf_config(path, page_size=args.page_size, dtype=args.dtype)
    }
    full, mamba = configs["full"], configs["mamba"]
    ps = args.page_size
    page, slot = full.spec.entry_bytes * ps, mamba.spec.entry_bytes
    demand = sum(slot + -(-(len(p) + o) // ps) * page for p, o in zip(prompts, max_tokens))
    minimum = max(page, slot) + int(
        1.02 * max((-(-max_len // ps) + 1) * page / split["full"], 2 * slot / split["mamba"])
    )
    budget = max(int(args.budget_fraction * demand), minimum)
    info = {
        "budget_bytes": budget,
        "demand_bytes": demand,
        "budget_fraction_of_demand": budget / demand,
        "raised_to_static_minimum": budget == minimum,
        "full_entry_bytes": full.spec.entry_bytes,
        "state_slot_bytes": slot,
        "prompt_tokens": sum(len(p) for p in prompts),
        "max_model_len": max_len,
    }
    return budget, info


# -- ceilings and roofline ---------------------------------------------------------------


def measure_rates(device: str, dtype: torch.dtype) -> dict:
    """Device copy bandwidth (bytes read + written) and the matmul rate, measured now."""
    from bench_e2e import copy_bandwidth

    copy = copy_bandwidth(device)
    n = 8192 if device == "cuda" else 512
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    if device == "cuda":
        from common import bench_us

        seconds = bench_us(lambda: a @ b, 10, 50) * 1e-6
    else:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
    return {"copy_GBps": copy / 1e9, "matmul_TFLOPs": 2 * n**3 / seconds / 1e12, "matmul_n": n}


def weight_params(model) -> dict:
    """Parameter counts: ``linear`` (every nn.Linear weight, lm_head included: the
    decode GEMMs), ``other`` (norms, conv, biases, A/D...; read once a step), the
    input embedding (a lookup of B rows, not counted), and the itemsize."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    other = total - linear - (0 if tied else embed)
    itemsize = next(model.parameters()).element_size()
    return {"linear": linear, "other": other, "embedding": embed, "itemsize": itemsize}


def step_roofline(batch: int, context: int, entry: dict, rates: dict) -> dict:
    """Seconds per op class of one decode step of ``batch`` requests reading
    ``context`` cached tokens in all: max(bytes / copy, FLOPs / matmul) each."""
    w, work = entry["weights"], entry["workload"]
    bw, mm = rates["copy_GBps"] * 1e9, rates["matmul_TFLOPs"] * 1e12
    return {
        "gemm": max(w["linear"] * w["itemsize"] / bw, 2 * batch * w["linear"] / mm),
        "other_weights": w["other"] * w["itemsize"] / bw,
        "kv_read": work["full_entry_bytes"] * context / bw,
        "state_read_write": 2 * batch * work["state_slot_bytes"] / bw,
    }


def decode_roofline(steps: dict, entry: dict, rates: dict) -> dict | None:
    """Median measured time of the full-batch decode steps (the largest decode
    batch of the run; >= 90 % of it if fewer than 3 steps) against the median
    roofline of the same steps."""
    dec = [i for i, d in enumerate(steps["is_decode"]) if d]
    if not dec:
        return None
    top = max(steps["batch"][i] for i in dec)
    full = [i for i in dec if steps["batch"][i] == top]
    if len(full) < 3:
        full = [i for i in dec if steps["batch"][i] >= 0.9 * top]
    parts = [step_roofline(steps["batch"][i], steps["context"][i], entry, rates) for i in full]
    roof = [sum(p.values()) for p in parts]
    mid = int(np.argsort(roof)[len(roof) // 2])
    measured = float(np.median([steps["seconds"][i] for i in full]))
    return {
        "batch": top,
        "steps": len(full),
        "mean_context": float(np.mean([steps["context"][i] / steps["batch"][i] for i in full])),
        "measured_ms": measured * 1e3,
        "roofline_ms": roof[mid] * 1e3,
        "fraction": roof[mid] / measured,
        "parts_ms": {k: v * 1e3 for k, v in parts[mid].items()},
    }


def step_split(res: dict) -> dict:
    """A scheme's step time split by kind (its ``steps_log``): decode-only steps and
    the steps with prefill rows, in seconds and counts. Both schemes prefill the
    same prompts, so the prefill steps' seconds are work the pool's capacity does not
    shorten: they bound the throughput ratio (issue 38's miss breakdown)."""
    log = res["steps_log"]
    decode = np.asarray(log["is_decode"], bool)
    seconds = np.asarray(log["seconds"], float)
    return {
        "decode_s": float(seconds[decode].sum()),
        "prefill_step_s": float(seconds[~decode].sum()),
        "decode_steps": int(decode.sum()),
        "prefill_steps": int((~decode).sum()),
    }


def compare_schemes(entry: dict, tokens: dict, margins: dict) -> dict:
    """Unified against static: token identity (with the top-1 / top-2 logit margins
    where they first differ), concurrency and throughput ratios."""
    u, s = tokens["unified"], tokens["static"]
    same = [a == b for a, b in zip(u, s)]
    equal = sum(x == y for a, b in zip(u, s) for x, y in zip(a, b))
    first = []
    for i, (a, b) in enumerate(zip(u, s)):
        if a != b:
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mu, ms = margins["unified"].get((i, j)), margins["static"].get((i, j))
            first.append({"request": i, "index": j, "margin_unified": mu, "margin_static": ms})
    ru, rs = entry["schemes"]["unified"], entry["schemes"]["static"]
    ratio = ru["mean_concurrent"] / rs["mean_concurrent"]
    speed = ru["output_tokens_per_s"] / rs["output_tokens_per_s"]
    known = [min(d["margin_unified"], d["margin_static"]) for d in first if None not in d.values()]
    split = {"unified": step_split(ru), "static": step_split(rs)}
    return {
        "step_split": split,
        # static's decode-only seconds over unified's: the ratio with prefill left out
        "decode_seconds_ratio": split["static"]["decode_s"]
        / max(split["unified"]["decode_s"], 1e-9),
        "prefill_share_unified": split["unified"]["prefill_step_s"] / max(ru["seconds"], 1e-9),
        "requests_identical": f"{sum(same)}/{len(same)}",
        "tokens_identical_fraction": equal / max(1, sum(len(a) for a in u)),
        "first_differences": first[:16],
        "max_margin_at_first_difference": max(known) if known else None,
        "median_margin": float(np.median(list(margins["unified"].values()))),
        "mean_concurrent_ratio": ratio,
        "max_concurrent_ratio": ru["max_concurrent"] / rs["max_concurrent"],
        "throughput_ratio": speed,
        "target_concurrency_1_5x_met": ratio >= 1.5,
        "throughput_ahead": speed > 1.0,
    }


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class StepLog:
    """``on_step`` hook: per step its time, kind, batch size, running requests, the
    context its decodes read, live bytes per sub-pool, and the top-2 logits of the
    lanes that sampled (kept on the device until the end: no host sync). Step N's
    hook runs after step N-1's tokens came back, so step i lasted ``t[i+1] - t[i]``."""

    def __init__(self, llm) -> None:
        self.t: list[float] = []
        self.rows: list[tuple[bool, int, int, int]] = []  # decode?, batch, running, context
        self.live: dict[str, list[int]] = {n: [] for n in llm.pool.subpools}
        self.tops: list[torch.Tensor] = []
        self.lanes: list[tuple[int, int]] = []  # (request id, output index) per top row

    def __call__(self, llm, batch, logits) -> None:
        self.t.append(time.perf_counter())
        if len(self.t) % PROGRESS_STEPS == 0:
            print(f"  step {len(self.t)}: {len(llm.scheduler.running)} running, "
                  f"{len(llm.scheduler.waiting)} waiting, {self.t[-1] - self.t[0]:.1f} s", flush=True)  # fmt: skip
        reqs = batch.requests
        context = sum(r.num_cached for r in reqs) if batch.is_decode else 0
        self.rows.append((batch.is_decode, len(reqs), len(llm.scheduler.running), context))
        for name, live in self.live.items():
            sub = llm.alloc.parts.books[name]
            live.append(sub.num_live * sub.page_bytes)
        lanes = [i for i, r in enumerate(reqs) if r.num_pending == 1]  # sampled this step
        if lanes:
            self.tops.append(logits[lanes].topk(2, dim=-1).values)
            self.lanes += [(reqs[i].request_id, len(reqs[i].output_ids) - 1) for i in lanes]

    def margins(self) -> dict[tuple[int, int], float]:
        """(request index, output index) -> top-1 minus top-2 logit. Request ids of
        one ``generate`` call are consecutive, in prompt order."""
        if not self.tops:
            return {}
        top = torch.cat(self.tops).float().cpu()
        gaps = (top[:, 0] - top[:, 1]).tolist()
        first = min(rid for rid, _ in self.lanes)
        return {(rid - first, j): g for (rid, j), g in zip(self.lanes, gaps)}


def make_llm(path: Path, split, budget: int, max_len: int, args):
    from unikv.engine import LLM

    return LLM(
        str(path),
        device=args.device,
        dtype=args.dtype,
        kv_cache_bytes=budget,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.chunk,
        max_model_len=max_len,
        static_split=split,
    )


def run_scheme(llm, prompts, max_tokens, args) -> tuple[dict, list, dict]:
    """One timed ``generate`` of the whole workload, after an untimed run of the
    same workload: every kernel specialisation, fla autotune and the page-copy
    kernel of compaction compile there, not inside the timed run (a first H200
    run without it had 1.3 s and 0.5 s compile steps in the unified scheme only,
    which compacts). Returns (result, outputs, margins)."""
    from unikv.engine import SamplingParams

    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for o in max_tokens]
    llm.generate(prompts, params)  # warm-up (untimed)
    log = StepLog(llm)
    _sync(args.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, on_step=log)
    _sync(args.device)
    wall = time.perf_counter() - start
    log.t.append(time.perf_counter())
    made = sum(len(o.output_ids) for o in outputs)
    running = [row[2] for row in log.rows]
    table = _step_table(log)
    res = {
        "seconds": wall,
        "output_tokens": made,
        "output_tokens_per_s": made / wall,
        "steps": llm.stats.steps,
        "decode_steps": llm.stats.decode_steps,
        "preemptions": llm.stats.preemptions,
        "mean_concurrent": float(np.mean(running)),  # per step, as sampled
        "mean_concurrent_time_weighted": float(np.average(running, weights=table["seconds"])),
        "max_concurrent": int(max(running)),
        "peak_pages": llm.stats.peak_pages,
        "band_limits": llm.pool.band_limits,
        "steps_log": table,
        "live_bytes": {n: v[:: max(1, len(v) // 400)] for n, v in log.live.items()},
    }
    return res, [o.output_ids for o in outputs], log.margins()


def _step_table(log: StepLog) -> dict:
    """Per step (decode?, batch, running, decode context, seconds)."""
    seconds = np.diff(np.asarray(log.t)).tolist()
    keys = ("is_decode", "batch", "running", "context")
    table = {k: [row[i] for row in log.rows] for i, k in enumerate(keys)}
    table["seconds"] = seconds
    return table


def run_subset(llm, prompts, new_tokens: int, args) -> tuple[dict, list]:
    """unikv on the transformers subset (equal-length prompts, all at t0)."""
    from unikv.engine import SamplingParams

    _sync(args.device)
    start = time.perf_counter()
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    )
    _sync(args.device)
    wall = time.perf_counter() - start
    made = sum(len(o.output_ids) for o in outs)
    return {"seconds": wall, "output_tokens_per_s": made / wall}, [o.output_ids for o in outs]


def run_hf(model, prompts, new_tokens: int, args) -> tuple[dict, list]:
    """transformers ``generate``: one batch of equal-length prompts, greedy."""
    ids = torch.tensor(prompts, device=args.device)
    kw = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        model.generate(ids[:1, :8], max_new_tokens=2, **{**kw, "attention_mask": None})
        _sync(args.device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        _sync(args.device)
    wall = time.perf_counter() - start
    tokens = out[:, ids.shape[1] :].tolist()
    res = {
        "requests": len(prompts),
        "prompt_len": ids.shape[1],
        "new_tokens": new_tokens,
        "seconds": wall,
        "output_tokens_per_s": len(prompts) * new_tokens / wall,
        "attn_implementation": model.config._attn_implementation,
    }
    return res, tokens


def hf_subset(prompts, args) -> list[list[int]]:
    """The first ``args.hf_requests`` short prompts, cut to their shortest length."""
    short = [p for p in prompts if len(p) < args.long[0]][: args.hf_requests]
    length = min(len(p) for p in short)
    return [p[:length] for p in short]


def prepare(name: str, workdir: Path, args, entry: dict):
    """Build and save model ``name``; the workload and its budget. Returns
    (transformers model, prompts, max_tokens, max_len, budget)."""
    t0 = time.perf_counter()
    model = build_model(name, workdir, args.device, args.dtype, args.tiny)
    entry["build_s"] = time.perf_counter() - t0
    entry["config"] = json.loads((workdir / "config.json").read_text())
    entry["weights"] = weight_params(model)
    prompts, max_tokens = make_workload(args, entry["config"]["vocab_size"])
    max_len = max(len(p) + o for p, o in zip(prompts, max_tokens)) + 1
    budget, info = pool_budget(workdir, prompts, max_tokens, max_len, SGLANG_SPLIT, args)
    entry["workload"] = {
        "requests": len(prompts),
        "prompt_lens": [len(p) for p in prompts],
        "max_tokens": max_tokens,
        **info,
    }
    print(f"[{name}] built in {entry['build_s']:.0f} s; budget {human(budget)} "
          f"({info['budget_fraction_of_demand']:.2f} of the workload's demand)", flush=True)  # fmt: skip
    return model, prompts, max_tokens, max_len, budget


def run_model(name: str, args, rates: dict, entry: dict, save) -> None:
    """Both schemes on model ``name`` (unikv on the transformers subset after the
    unified run), then transformers on the subset; saved after each part. The
    transformers model stays on the device meanwhile (it is only memory)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"unikv_hybrid_{name}_"))
    try:
        model, prompts, max_tokens, max_len, budget = prepare(name, workdir, args, entry)
        subset = hf_subset(prompts, args)
        tokens, margins = {}, {}
        for scheme, split in SCHEMES.items():
            print(f"[{name}] unikv {scheme} ...", flush=True)
            t0 = time.perf_counter()
            llm = make_llm(workdir, split, budget, max_len, args)
            init_s = time.perf_counter() - t0
            res, tokens[scheme], margins[scheme] = run_scheme(llm, prompts, max_tokens, args)
            res["init_s"] = init_s
            res["decode_roofline"] = decode_roofline(res["steps_log"], entry, rates)
            entry["schemes"][scheme] = res
            print(f"[{name}] {scheme}: {res['output_tokens_per_s']:,.0f} out tok/s, mean/max "
                  f"running {res['mean_concurrent']:.1f}/{res['max_concurrent']}, preemptions "
                  f"{res['preemptions']}, {res['seconds']:.1f} s", flush=True)  # fmt: skip
            if scheme == "unified":
                entry["unikv_subset"], tokens["subset"] = run_subset(
                    llm, subset, args.hf_new_tokens, args
                )
            del llm
            _free()
            save()
        entry["comparison"] = compare_schemes(entry, tokens, margins)
        save()
        print(
            f"[{name}] transformers generate: {len(subset)} x {len(subset[0])} tokens", flush=True
        )
        entry["hf_generate"], hf_tokens = _guard(run_hf, model, subset, args.hf_new_tokens, args)
        if hf_tokens is not None:
            same = [a == b for a, b in zip(tokens["subset"], hf_tokens)]
            entry["unikv_subset"]["requests_identical_to_hf"] = f"{sum(same)}/{len(same)}"
            hf = entry["hf_generate"]["output_tokens_per_s"]
            entry["unikv_subset"]["speedup_vs_hf"] = (
                entry["unikv_subset"]["output_tokens_per_s"] / hf
            )
    except Exception as err:  # noqa: BLE001 - recorded; the next model still runs
        entry["error"] = f"{type(err).__name__}: {err}"
        entry["traceback"] = traceback.format_exc()[-4000:]
        print(f"[{name}] FAILED: {entry['error']}\n{entry['traceback']}", flush=True)
    finally:
        model = None
        shutil.rmtree(workdir, ignore_errors=True)
        _free()
        save()


def _guard(fn, *a):
    """``fn(*a)`` -> (result, tokens), or ({"error": ...}, None) without stopping the run."""
    try:
        return fn(*a)
    except Exception as err:  # noqa: BLE001
        _free()
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}, None


def summary(results: dict) -> str:
    head = (
        "| model | path | mean / max running | preempt | out tok/s | decode step ms (B) | "
        "roofline ms | % roofline |"
    )
    lines = [
        head,
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in results["models"]:
        if "error" in e:
            lines.append(f"| {e['model']} | FAILED: {e['error'][:90]} | | | | | | |")
        for scheme, r in e.get("schemes", {}).items():
            d = r.get("decode_roofline") or {}
            step = f"{d['measured_ms']:.2f} ({d['batch']})" if d else "-"
            roof = f"{d['roofline_ms']:.2f}" if d else "-"
            frac = f"{100 * d['fraction']:.0f} %" if d else "-"
            lines.append(
                f"| {e['model']} | unikv {scheme} | {r['mean_concurrent']:.1f} / "
                f"{r['max_concurrent']} | {r['preemptions']} | {r['output_tokens_per_s']:,.0f} | "
                f"{step} | {roof} | {frac} |"
            )
        for key in ("hf_generate", "unikv_subset"):
            r = e.get(key)
            if r and "error" not in r:
                note = f"{r['speedup_vs_hf']:.1f}x hf" if "speedup_vs_hf" in r else ""
                note += f", same tokens {r['requests_identical_to_hf']}" if note else ""
                lines.append(
                    f"| {e['model']} | {key} (subset) | | | {r['output_tokens_per_s']:,.0f} | "
                    f"{note} | | |"
                )
            elif r:
                lines.append(f"| {e['model']} | {key} | FAILED: {r['error'][:80]} | | | | | |")
        c = e.get("comparison")
        if c:
            lines.append(
                f"| {e['model']} | unified / static | {c['mean_concurrent_ratio']:.2f}x "
                f"(target 1.5x) | | {c['throughput_ratio']:.2f}x | tokens identical "
                f"{c['requests_identical']} | | |"
            )
            if "decode_seconds_ratio" in c:
                lines.append(
                    f"| {e['model']} | decode steps alone | | | "
                    f"{c['decode_seconds_ratio']:.2f}x | prefill steps "
                    f"{100 * c['prefill_share_unified']:.0f} % of unified's time | | |"
                )
    return "\n".join(lines)


# -- replay: the same schedule without forwards --------------------------------------------


def replay_scheme(
    path: Path, budget: int, split, prompts, max_tokens, max_len, args, on_step=None
) -> dict:
    """The workload through the engine's ``Scheduler`` and ``PoolAllocator`` over a
    pool of the model's sub-pools (``path``'s config; no weights, no forward: every
    sampled token is a dummy). With EOS ignored the tokens do not steer the schedule,
    so its per-step running counts are those of the timed run with the same budget,
    workload, page size, chunk and ``max_num_seqs``. ``on_step(sched, alloc)`` runs
    after every step (tests check the accounting there)."""
    from unikv.allocator import PoolAllocator
    from unikv.engine.request import Request
    from unikv.engine.sampling import SamplingParams
    from unikv.engine.scheduler import Scheduler
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import UnifiedPool

    configs = specs_from_hf_config(path, page_size=args.page_size, dtype=args.dtype)
    pool = UnifiedPool(
        configs,
        budget,
        "cpu",
        max_request_tokens=max_len,
        chunk_tokens=args.chunk,
        static_split=split,
    )
    alloc = PoolAllocator(pool, max_requests=args.max_num_seqs, max_context=max_len)
    sched = Scheduler(
        alloc,
        pool.subpools.values(),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.chunk,
    )
    for i, (p, o) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0)
        sched.add(Request(i, list(p), params, 0, frozenset(), max_len))
    names = list(pool.subpools)
    rows = []  # per step after it: running, waiting, live pages per sub-pool
    while sched.has_work():
        batch = sched.schedule()
        sched.complete(batch, [1] * len(batch.requests))
        rows.append(
            (len(sched.running), len(sched.waiting), *(alloc.view.live_pages(n) for n in names))
        )
        if on_step is not None:
            on_step(sched, alloc)
    subs = pool.subpools
    page = {n: s.page_bytes for n, s in subs.items()}
    top = {n: s.num_pages * s.page_bytes for n, s in subs.items()}
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 2 + len(names))
    running, waiting = table[:, 0], table[:, 1]
    held = sum(table[:, 2 + i] * page[n] for i, n in enumerate(names))
    busy = waiting > 0  # steps after which requests still wait: the pool is the limit
    usable = max(top.values()) - pool.sink_bytes  # every byte above the sink a band may take
    per_request = held[busy] / np.maximum(running[busy], 1)
    # the requests a perfect packing of all usable bytes would hold at each step's mix
    oracle = usable / np.maximum(per_request, 1)
    return {
        "steps": len(rows),
        "mean_concurrent": float(running.mean()),
        "max_concurrent": int(running.max()),
        "preemptions": sched.num_preemptions,
        "band_limits": pool.band_limits,
        "sink_bytes": pool.sink_bytes,
        "usable_bytes": usable,
        "steps_waiting": int(busy.sum()),
        "mean_concurrent_waiting": float(running[busy].mean()) if busy.any() else None,
        "mean_concurrent_drain": float(running[~busy].mean()) if (~busy).any() else None,
        "held_fraction_waiting": float((held[busy] / usable).mean()) if busy.any() else None,
        "bytes_per_running_request_waiting": float(per_request.mean()) if busy.any() else None,
        "oracle_concurrent_waiting": float(oracle.mean()) if busy.any() else None,
        "running": running.tolist(),
    }


def slot_accounting(path: Path, prompts, max_tokens, args) -> dict:
    """Bytes a request holds at its peak, by part: its state slot (each part over
    every layer, and the alignment padding) and its KV pages (the tokens' bytes and
    the rounding up to whole pages); workload means."""
    from unikv.hf_config import specs_from_hf_config

    configs = {
        c.name: c for c in specs_from_hf_config(path, page_size=args.page_size, dtype=args.dtype)
    }
    mamba, full = configs["mamba"].spec, configs["full"].spec
    parts = {
        name: mamba.num_layers * p.layer_bytes for name, p in zip(mamba.parts, mamba.state_parts)
    }
    parts["alignment"] = mamba.entry_bytes - sum(parts.values())
    tokens = np.asarray([len(p) + o for p, o in zip(prompts, max_tokens)])
    ps = args.page_size
    rounded = -(-tokens // ps) * ps
    return {
        "state_slot_bytes": mamba.entry_bytes,
        "state_slot_parts": parts,
        "kv_bytes_per_token": full.entry_bytes,
        "mean_peak_kv_bytes": float(tokens.mean() * full.entry_bytes),
        "mean_page_rounding_bytes": float((rounded - tokens).mean() * full.entry_bytes),
        "mean_peak_request_bytes": float(mamba.entry_bytes + rounded.mean() * full.entry_bytes),
    }


def replay_model(name: str, args) -> dict:
    """``--replay``: both schemes' schedules (and the unified pool given the sink's
    bytes too: what the sink costs), the accounting, and the oracle: the running
    requests a perfect packing of the unified pool's usable bytes would hold at each
    step's bytes per running request, averaged over the steps with requests waiting."""
    workdir = Path(tempfile.mkdtemp(prefix=f"unikv_replay_{name}_"))
    try:
        config = hf_config(name, args.tiny)
        config.save_pretrained(workdir)
        prompts, max_tokens = make_workload(args, config.vocab_size)
        max_len = max(len(p) + o for p, o in zip(prompts, max_tokens)) + 1
        budget, info = pool_budget(workdir, prompts, max_tokens, max_len, SGLANG_SPLIT, args)
        entry = {
            "model": name,
            "workload": info,
            "accounting": slot_accounting(workdir, prompts, max_tokens, args),
        }
        runs = {
            s: replay_scheme(workdir, budget, sp, prompts, max_tokens, max_len, args)
            for s, sp in SCHEMES.items()
        }
        sink = runs["unified"]["sink_bytes"]
        runs["unified_sink_reclaimed"] = replay_scheme(
            workdir, budget + sink, None, prompts, max_tokens, max_len, args
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    u, s = runs["unified"], runs["static"]
    entry["schemes"] = runs
    entry["oracle_concurrent_waiting"] = u["oracle_concurrent_waiting"]
    entry["mean_concurrent_ratio"] = u["mean_concurrent"] / s["mean_concurrent"]
    entry["mean_concurrent_waiting_ratio"] = (
        u["mean_concurrent_waiting"] / s["mean_concurrent_waiting"]
    )
    entry["sink_reclaimed_ratio"] = (
        runs["unified_sink_reclaimed"]["mean_concurrent"] / s["mean_concurrent"]
    )
    for k, r in runs.items():
        print(
            f"[{name}] replay {k}: mean/max running {r['mean_concurrent']:.2f}/{r['max_concurrent']}, "
            f"while waiting {r['mean_concurrent_waiting']:.2f} ({r['steps_waiting']} of {r['steps']} "
            f"steps, {100 * r['held_fraction_waiting']:.1f} % of usable bytes held), "
            f"preemptions {r['preemptions']}",
            flush=True,
        )
    print(
        f"[{name}] unified / static {entry['mean_concurrent_ratio']:.3f}x (while waiting "
        f"{entry['mean_concurrent_waiting_ratio']:.3f}x; sink reclaimed "
        f"{entry['sink_reclaimed_ratio']:.3f}x); oracle while waiting "
        f"{entry['oracle_concurrent_waiting']:.2f}",
        flush=True,
    )
    return entry


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny models and workload (CPU smoke)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--budget-fraction", type=float, default=0.2)
    p.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--merge", nargs="+", default=None, help="join result files into --out")
    p.add_argument(
        "--replay",
        action="store_true",
        help="no forwards: the schedules and the byte accounting on CPU (real shapes unless --quick)",
    )
    args = p.parse_args(argv)
    args.tiny = args.quick or (args.device == "cpu" and not args.replay)
    args.models = args.models.split(",")
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"unknown models {bad}; choose from {MODELS}")
    args.requests = args.requests or (16 if args.tiny else 96)
    args.short, args.long = ((8, 48), (96, 200)) if args.tiny else ((32, 1024), (4096, 16384))
    args.new_tokens = (4, 9) if args.tiny else (64, 129)
    args.long_fraction = 0.2
    args.hf_requests, args.hf_new_tokens = (4, 8) if args.tiny else (16, 64)
    args.chunk = args.chunk or (64 if args.tiny else 4096)
    args.max_num_seqs = min(args.requests, 128)
    replay_bf16 = args.replay and not args.tiny  # the bytes of the bf16 GPU run
    args.dtype = torch.bfloat16 if args.device == "cuda" or replay_bf16 else torch.float32
    name = "hybrid_h200.json" if not args.tiny else f"hybrid_{args.device}_tiny.json"
    if args.replay:
        name = "hybrid_replay.json" if not args.tiny else "hybrid_replay_tiny.json"
    args.out = args.out or str(ROOT / "benchmarks/results" / name)
    return args


def merge(paths: list[str], out: str) -> dict:
    runs = [json.loads(Path(p).read_text()) for p in paths if Path(p).exists()]
    if not runs:
        raise SystemExit(f"--merge: none of {paths} exists")
    results = {**runs[0], "models": [m for r in runs for m in r["models"]]}
    results["summary_markdown"] = summary(results)
    Path(out).write_text(json.dumps(results, indent=1, default=str))
    print(f"saved {out}\n\n{results['summary_markdown']}")
    return results


def main(argv=None) -> dict:
    import transformers
    from common import environment

    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.replay:
        replayed = {"replay": True, "tiny": args.tiny, "dtype": str(args.dtype), "models": []}
        replayed["engine"] = {
            "page_size": args.page_size,
            "chunk": args.chunk,
            "max_num_seqs": args.max_num_seqs,
        }
        for name in args.models:
            replayed["models"].append(replay_model(name, args))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(replayed, indent=1, default=str))
        print(f"saved {args.out}")
        return replayed
    rates = measure_rates(args.device, args.dtype)
    print(f"copy {rates['copy_GBps']:.0f} GB/s, matmul {rates['matmul_TFLOPs']:.1f} TFLOP/s")
    results = {
        "env": {**environment(), "transformers": transformers.__version__, "device": args.device},
        "tiny": args.tiny,
        "dtype": str(args.dtype),
        "static_split": SGLANG_SPLIT,
        "rates": rates,
        "engine": {"page_size": args.page_size, "chunk": args.chunk, "max_num_seqs": args.max_num_seqs},
        "models": [],
    }  # fmt: skip

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))

    for name in args.models:
        entry = {"model": name, "schemes": {}}
        results["models"].append(entry)
        run_model(name, args, rates, entry, save)
    results["summary_markdown"] = summary(results)
    save()
    print(f"saved {args.out}\n\n{results['summary_markdown']}")
    return results


if __name__ == "__main__":
    main()
