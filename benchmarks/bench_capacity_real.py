"""Pool capacity with real forwards: what the exact asymmetric rows and the MLA
sub-pool buy at equal bytes, measured through ``LLM.generate``.

``bench_capacity.py`` counts what the pool holds with the real scheduler and
allocator but no model. Here the engine runs a model: a random-init checkpoint with
a real model's attention shapes (every KV head and head width, the preset's ratio of
full to sliding-window layers) but fewer layers and a narrow MLP / MoE, so the
forward is cheap and the KV bytes per layer are the real model's. The byte budget is
``bench_capacity``'s, scaled by the layer fraction, so every scheme holds the pages
the simulation's pool holds; the workload is its ``mixed_workload`` (prompt and
output lengths; random prompt ids, EOS ignored).

Schemes (``capacity_models.MODELS``):

- ``unified``: one pool, moving boundaries, exact rows (the engine's default).
- ``static_split``: ``LLM(static_split=...)`` with SGLang's default shares
  (``capacity_models.static_shares``).
- ``unified_padded`` / ``static_split_padded`` (MiMo-V2-Flash): K and V rows padded
  to 192. The engine stores exact rows only, so a padded pool is run as the pages it
  holds: the exact layout at budget x (exact bytes / padded bytes) per token (every
  sub-pool's ratio is the same, 5,760 / 6,912, or the run refuses), with the padded
  layout's static shares.
- ``expanded_kv`` (DeepSeek-V3): per-head K/V instead of the latent row, run the same
  way at budget x (latent bytes / expanded bytes): the pages a pool with no MLA kind
  would hold.

Recorded per scheme: max / mean running requests per step, preemptions, output
tokens/s, steps, peak pages per sub-pool; ratios against the model's baseline (the
simulation's). ``--tiny``: tiny widths and a short workload (CPU smoke test).

    python benchmarks/bench_capacity_real.py [--device cuda] [--models mimo-v2-flash,deepseek-v3]
        [--requests 128] [--out benchmarks/results/capacity_real_h200.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.capacity_models import MODELS, SCHEME_RULES, mixed_workload, static_shares
from benchmarks.common import environment, save_json
from unikv.hf_config import model_specs_from_hf_config

GIB = 1 << 30
PAGE_SIZE = 16
# Per model: the layers run and the narrow MLP / MoE (attention shapes untouched).
SHRINK = {
    "mimo-v2-flash": {  # the preset's first 16 layers: 3 full, 13 sliding (its 9 : 39)
        "num_hidden_layers": 16,
        "hidden_size": 1024,
        "intermediate_size": 1024,
        "moe_intermediate_size": 256,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
    },
    "deepseek-v3": {
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "moe_intermediate_size": 256,
        "n_routed_experts": 16,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
    },
}
# --tiny: odd small widths of the same structure (CPU), and a short workload.
TINY = {
    "mimo-v2-flash": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "swa_num_attention_heads": 4,
        "num_key_value_heads": 1,
        "swa_num_key_value_heads": 2,
        "head_dim": 24,
        "swa_head_dim": 24,
        "v_head_dim": 16,
        "swa_v_head_dim": 16,
        "sliding_window": 20,
        "sliding_window_size": 20,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "vocab_size": 256,
    },
    "deepseek-v3": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 12,
        "v_head_dim": 16,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "vocab_size": 256,
    },
}
TINY_WORKLOAD = {"short": (4, 40), "long": (60, 120), "out": (4, 12)}


def shrunk_config(name: str, tiny: bool) -> dict:
    """The preset's config.json dict with SHRINK (and TINY) applied."""
    case = next(c for c in MODELS if c.name == name)
    hf = {k: v for k, v in case.hf().items() if not k.startswith("_")}
    hf.update(SHRINK[name])
    if tiny:
        hf.update(TINY[name])
    hf["max_position_embeddings"] = min(hf["max_position_embeddings"], 32768)
    if "hybrid_layer_pattern" in hf:  # transformers reads layer_types; keep both one pattern
        hf["hybrid_layer_pattern"] = hf["hybrid_layer_pattern"][: hf["num_hidden_layers"]]
        names = ("full_attention", "sliding_attention")
        hf["layer_types"] = [names[k] for k in hf["hybrid_layer_pattern"]]
    return hf


def save_model(hf: dict, path: str, dtype: torch.dtype) -> dict:
    """A random-init transformers model of ``hf`` saved to ``path``; its config.json
    as saved (what the engine reads)."""
    import transformers as tf

    config = tf.AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    return json.loads(Path(path, "config.json").read_text())


def entry_bytes(hf: dict, transform, dtype: torch.dtype) -> tuple[dict[str, int], list]:
    """(bytes per token of each sub-pool, the SubPoolConfigs), after the layout
    transform if any."""
    configs = list(model_specs_from_hf_config(hf, page_size=PAGE_SIZE, dtype=dtype).subpools)
    if transform is not None:
        configs = transform(configs, hf)
    return {c.name: c.spec.entry_bytes for c in configs}, configs


def scheme_plan(hf: dict, scheme: str, budget: int, dtype: torch.dtype) -> dict:
    """(kv_cache_bytes, static_split or None, the byte scale) of one scheme: a layout
    transform runs as the exact layout at the budget scaled by exact / transformed
    bytes per token, one ratio for every sub-pool."""
    policy, transform = SCHEME_RULES[scheme]
    exact, exact_configs = entry_bytes(hf, None, dtype)
    scale, configs = 1.0, exact_configs
    if transform is not None:
        moved, configs = entry_bytes(hf, transform, dtype)
        ratios = {name: exact[name] / moved[name] for name in exact}  # names stay
        if len({round(r, 9) for r in ratios.values()}) != 1:
            raise ValueError(f"{scheme}: sub-pools scale differently {ratios}; not emulable")
        scale = next(iter(ratios.values()))
    split = None
    if policy == "static_split":
        split = static_shares(configs)  # the layout's own shares (names are the exact ones)
    elif policy != "unified":
        raise ValueError(f"{scheme}: policy {policy!r} is not run with real forwards")
    return {"kv_cache_bytes": int(budget * scale), "static_split": split, "byte_scale": scale}


def usable_pages(pool) -> dict[str, int]:
    """Pages each sub-pool can hold: its static range, else its grid above the sink."""
    limits = pool.band_limits or {}
    return {
        n: (limits[n][1] - limits[n][0]) if n in limits else s.num_pages - s.first_page
        for n, s in pool.subpools.items()
    }


def run_scheme(path: str, plan: dict, workload, args) -> dict:
    """``LLM.generate`` over the workload under one scheme's pool; its counters."""
    from unikv.engine import LLM, SamplingParams

    max_len = max(p + o for p, o in workload) + PAGE_SIZE
    llm = LLM(
        path,
        device=args.device,
        dtype=args.dtype,
        kv_cache_bytes=plan["kv_cache_bytes"],
        static_split=plan["static_split"],
        page_size=PAGE_SIZE,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.chunk,
        max_model_len=max_len,
        enable_prefix_caching=False,
    )
    rng = np.random.default_rng(0)
    vocab = llm.model.config.vocab_size
    prompts = [rng.integers(0, vocab, p).tolist() for p, _ in workload]
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in workload]
    running: list[int] = []

    def on_step(llm_, batch, logits) -> None:
        running.append(len(llm_.scheduler.running))

    llm.generate(
        prompts[:2], [SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)] * 2
    )  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, on_step=on_step)
    seconds = time.perf_counter() - start
    stats = llm.stats
    made = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert made == sum(o for _, o in workload), "every request ran to its max_tokens"
    row = {
        "kv_cache_bytes": plan["kv_cache_bytes"],
        "byte_scale": plan["byte_scale"],
        "static_split": plan["static_split"],
        "pages": usable_pages(llm.pool),
        "max_concurrent": max(running),
        "mean_concurrent": float(np.mean(running)),
        "preemptions": stats.preemptions,
        "steps": stats.steps,
        "output_tokens": made,
        "seconds": seconds,
        "output_tokens_per_s": made / seconds,
        "peak_pages": dict(stats.peak_pages),
    }
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def tiny_budget(hf: dict, workload, schemes, dtype) -> int:
    """A fifth of the workload's tokens in exact rows, raised where a scheme's pool
    (or static region) could not hold the longest request alone (1.5-2x that floor,
    the sink page included)."""
    exact, _ = entry_bytes(hf, None, dtype)
    budget = sum(exact.values()) * sum(p + o for p, o in workload) / 5
    longest = -(-(max(p + o for p, o in workload) + PAGE_SIZE) // PAGE_SIZE) * PAGE_SIZE
    for scheme in schemes:
        policy, transform = SCHEME_RULES[scheme]
        moved, configs = entry_bytes(hf, transform, dtype)
        budget = max(budget, 2 * longest * sum(moved.values()))
        if policy == "static_split":
            for sub, share in static_shares(configs).items():
                budget = max(budget, 1.5 * longest * moved[sub] / share)
    return int(budget)


def run_model(name: str, args, tmp: str, save=lambda partial: None) -> dict:
    case = next(c for c in MODELS if c.name == name)
    hf = shrunk_config(name, args.tiny)
    layers = hf["num_hidden_layers"] / case.hf()["num_hidden_layers"]
    budget = int(case.budget_gib * GIB * layers)
    wl = {**case.workload, **(TINY_WORKLOAD if args.tiny else {})}
    workload = mixed_workload(args.requests, **wl)
    path = os.path.join(tmp, name)
    hf = save_model(hf, path, args.dtype)
    if args.tiny:
        budget = tiny_budget(hf, workload, case.schemes, args.dtype)
    result = {"model": name, "layers": hf["num_hidden_layers"], "budget_bytes": budget,
              "baseline": case.baseline, "workload": wl, "schemes": {}}  # fmt: skip
    for scheme in case.schemes:
        plan = scheme_plan(hf, scheme, budget, args.dtype)
        row = run_scheme(path, plan, workload, args)
        result["schemes"][scheme] = row
        save(result)  # a run cut short keeps the schemes done
        print(f"{name:13s} {scheme:19s} max_conc {row['max_concurrent']:4d} mean_conc "
              f"{row['mean_concurrent']:7.1f} preempt {row['preemptions']:4d} steps "
              f"{row['steps']:5d} tok/s {row['output_tokens_per_s']:9.1f}", flush=True)  # fmt: skip
    base = result["schemes"][case.baseline]
    for row in result["schemes"].values():
        for key in ("mean_concurrent", "max_concurrent", "output_tokens_per_s"):
            row[f"{key}_vs_baseline"] = row[key] / base[key]
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="mimo-v2-flash,deepseek-v3")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="tiny widths, short workload (CPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    payload = {"env": environment(), "device": args.device, "tiny": args.tiny,
               "requests": args.requests, "models": []}  # fmt: skip
    out = args.out or f"benchmarks/results/capacity_real_{args.device}.json"

    def save(partial: dict | None = None) -> None:
        models = payload["models"] + ([partial] if partial is not None else [])
        for path in [out] + ([os.path.join(os.environ["OUT"], Path(out).name)]
                             if os.environ.get("OUT") else []):  # fmt: skip
            save_json(path, {**payload, "models": models})

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            payload["models"].append(run_model(name, args, tmp, save))
    save()
    return payload


if __name__ == "__main__":
    main()
