"""Every family's decode step beside its roofline, on the shared decoder (issue 38).

For each model shape (random-init, bf16, real widths and few layers; no download):

- ``llama``: bench_e2e's Llama-3.2-1B shape (16 layers);
- ``qwen3_5`` / ``nemotron_h``: bench_hybrid's real-width Qwen3.5 and NemotronH shapes
  (8 and 13 layers);
- ``deepseek_v3``: the DeepSeek-V3 preset's widths (MLA, 128 heads, shared expert),
  4 layers (3 dense + 1 MoE, as the release starts), 64 routed experts top-8 instead
  of 256 (say so: the weights of one layer of 256 experts alone are 22.5 GB);
- ``mimo_v2_flash``: the MiMo-V2-Flash preset's widths, its first 4 layers (full,
  then sliding with sinks; MoE as its pattern says), 64 routed experts top-8;
- ``gemma3_27b``: Gemma-3-27B's text widths, 6 layers (5 sliding + 1 full).

Two runs per model: ``--requests`` prompts of ``--prompt-len`` random tokens decoded
at full batch (CUDA graphs), and one request. Each profiles ``--steps`` decode steps
after ``--warm`` (bench_breakdown's ``profile_steps``): the wall ms per step, the
device ms per op class, against the step's roofline.

The roofline is read from the loaded unikv model and its pool, so it holds for any
family: per class max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both
measured in this run, summed:

- ``weights``: every parameter but the experts (the input embedding only where it
  is the head's own tensor), read once; FLOPs 2 x batch x those of the linears;
- ``experts``: the routed experts a batch hits, E (1 - (1 - k/E)^B) of E per layer;
- ``kv``: per attention sub-pool, its bytes per token (all its layers) x the tokens
  a request reads there (min(context, window)) x batch;
- ``state``: each recurrent slot read and written once per request.

One request's figure is the fraction of (weights + experts + kv + state) bytes at
copy bandwidth that its step reaches (issue 38's >= 70 % target).

    python benchmarks/bench_families.py --device cuda [--models llama,qwen3_5,...]
    python benchmarks/bench_families.py --device cpu --tiny   # the plumbing only

JSON to ``benchmarks/results/families_<device>.json`` (and ``$OUT`` when set).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODELS = ("llama", "qwen3_5", "nemotron_h", "deepseek_v3", "mimo_v2_flash", "gemma3_27b")
PRESETS = ROOT / "unikv/presets"
RECURRENT = ("_gdn", "gated_delta", "_ssd", "_conv_", "causal_conv", "chunk_")
COMMON = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": 0}


# -- shapes ------------------------------------------------------------------------------


def _preset(name: str) -> dict:
    cfg = json.loads((PRESETS / f"{name}.json").read_text())
    for key in ("_source", "quantization_config", "auto_map"):
        cfg.pop(key, None)
    return cfg


def model_config(name: str, tiny: bool) -> dict:
    """config.json of shape ``name`` (``tiny``: a few-KB twin for the CPU smoke)."""
    import bench_e2e
    import bench_hybrid

    if name == "llama":
        return bench_e2e.model_config("llama", tiny)
    if name in ("qwen3_5", "nemotron_h"):
        cfg = bench_hybrid.hf_config(name, tiny).to_dict()
        cfg["architectures"] = [
            "Qwen3_5ForCausalLM" if name == "qwen3_5" else "NemotronHForCausalLM"
        ]
        return cfg
    if name == "deepseek_v3":
        cfg = _preset("deepseek-v3")
        cfg.update(num_hidden_layers=4, n_routed_experts=64, num_nextn_predict_layers=0)
        if tiny:
            cfg.update(
                hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                vocab_size=512, first_k_dense_replace=1,
            )  # fmt: skip
    elif name == "mimo_v2_flash":
        cfg = _preset("mimo-v2-flash")
        layers = 2 if tiny else 4
        cfg.update(
            num_hidden_layers=layers,
            hybrid_layer_pattern=cfg["hybrid_layer_pattern"][:layers],
            moe_layer_freq=cfg["moe_layer_freq"][:layers],
            n_routed_experts=64,
        )
        if tiny:
            cfg.update(
                hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_attention_heads=4, num_key_value_heads=2, swa_num_attention_heads=4,
                swa_num_key_value_heads=4, head_dim=16, swa_head_dim=16, v_head_dim=16,
                swa_v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, vocab_size=512,
            )  # fmt: skip
    elif name == "gemma3_27b":
        cfg = dict(_preset("gemma-3-27b")["text_config"])
        cfg.update(architectures=["Gemma3ForCausalLM"], num_hidden_layers=2 if tiny else 6)
        if tiny:
            cfg.update(
                hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512, sliding_window=16,
                sliding_window_pattern=2, query_pre_attn_scalar=16,
            )  # fmt: skip
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    cfg.update(COMMON, torch_dtype="bfloat16")
    if tiny:
        cfg["max_position_embeddings"] = 4096
    return cfg


def save_model(name: str, path: Path, device: str, dtype: torch.dtype, tiny: bool) -> dict:
    """Random-init transformers model of shape ``name`` (seed 0) saved to ``path``."""
    import bench_e2e

    cfg = model_config(name, tiny)
    bench_e2e.save_model(name, path, device, dtype, tiny, cfg=cfg)
    return cfg


# -- the roofline --------------------------------------------------------------------------


def _experts(cfg: dict) -> tuple[int, int]:
    """(routed experts per MoE layer, experts per token); (0, 0) for dense models."""
    e = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    k = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0
    return int(e or 0), int(k)


def work(llm, cfg: dict, batch: int, context: float) -> dict:
    """{class: (bytes, FLOPs)} one decode step of ``batch`` requests at mean
    ``context`` must move and do, from the loaded model and its pool (module doc)."""
    model = llm.model
    head = getattr(model, "lm_head", None)
    head_ptr = head.weight.data_ptr() if head is not None else None
    dense_bytes = expert_bytes = linear_params = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name or name.endswith(".experts"):
            expert_bytes += nbytes
        elif "embed_tokens" in name and p.data_ptr() != head_ptr:
            continue  # a lookup of B rows (the head reads its own copy of a tied table)
        else:
            dense_bytes += nbytes
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Linear) and w is not None:
            linear_params += w.numel()
    e, k = _experts(cfg)
    hit = (1 - (1 - k / e) ** batch) if e else 0.0
    out = {
        "weights": (dense_bytes, 2 * batch * linear_params),
        "experts": (expert_bytes * hit, 2 * batch * (expert_bytes / 2) * (k / e) if e else 0),
    }
    kv = state = 0.0
    for sub in llm.pool.subpools.values():
        spec = sub.spec
        if spec.kind == "mamba":
            state += 2 * batch * spec.entry_bytes
        else:
            per_token = sub.page_bytes / sub.page_size
            window = getattr(spec, "sliding_window", None)
            kv += batch * per_token * (min(context, window) if window else context)
    out["kv"] = (kv, 0)
    out["state"] = (state, 0)
    return out


def roofline(llm, cfg: dict, batch: int, context: float, rates: tuple) -> dict:
    """bench_breakdown's per-class roofline over ``work``, with the step's bytes and
    their time at copy bandwidth."""
    import bench_breakdown as bd

    copy_bps, flops = rates
    roof = bd.step_roofline(cfg, batch, context, 0, copy_bps, flops, work(llm, cfg, batch, context))
    total_bytes = sum(c["bytes"] for c in roof["classes"].values())
    return {**roof, "bytes": total_bytes, "bytes_ms": total_bytes / copy_bps * 1e3}


# -- the runs ------------------------------------------------------------------------------


def _classify(name: str) -> str:
    import bench_breakdown as bd

    low = name.lower()
    if any(s in low for s in RECURRENT) and "gemm" not in low:
        return "recurrent"
    return bd.classify(name)


def run_batch(path: Path, cfg: dict, batch: int, args, rates: tuple) -> dict:
    """One profile of full-batch decode steps at ``batch`` requests."""
    import bench_breakdown as bd
    import bench_e2e as e2e

    prompts = e2e.make_prompts(batch, args.prompt_len, cfg["vocab_size"], seed=batch)
    lag = -(-batch * args.prompt_len // args.chunk) + 1
    max_len = args.prompt_len + args.warm + args.steps + bd.SPARE_TOKENS + lag + 8
    llm = e2e._unikv_llm(path, batch, max_len, args)
    try:
        llm.generate(prompts[:2], bd.e2e_params(4))  # compile every kernel before timing
        kernels, wall_ms, _ = bd.profile_steps(llm, prompts, args)
        context = args.prompt_len + args.warm + args.steps / 2
        roof = roofline(llm, cfg, batch, context, rates)
        device: dict[str, float] = {}
        for name, us in kernels:
            cls = _classify(name)
            device[cls] = device.get(cls, 0.0) + us / args.steps / 1e3
        device_ms = sum(device.values())
        top: dict[str, float] = {}
        for name, us in kernels:
            if _classify(name) in ("other", "recurrent"):
                top[name[:100]] = top.get(name[:100], 0.0) + us / args.steps / 1e3
        return {
            "batch": batch,
            "mean_context": context,
            "cuda_graphs": llm.runner.graphs is not None,
            "step_wall_ms": wall_ms,
            "step_device_ms": device_ms,
            "kernels_per_step": len(kernels) / args.steps,
            "roofline_step_ms": roof["step_ms"],
            "step_x_roofline": wall_ms / roof["step_ms"],
            "device_x_roofline": device_ms / roof["step_ms"],
            "bytes_at_copy_fraction": roof["bytes_ms"] / wall_ms,
            "roofline": roof,
            "device_ms_by_class": dict(sorted(device.items(), key=lambda kv: -kv[1])),
            "top_other_and_recurrent_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:12]),
        }
    finally:
        del llm
        e2e._free()


def run_model(name: str, args, rates: tuple) -> dict:
    entry: dict = {"model": name}
    workdir = Path(tempfile.mkdtemp(prefix=f"unikv_families_{name}_"))
    try:
        cfg = save_model(name, workdir, args.device, args.dtype, args.tiny)
        entry["config"] = {k: v for k, v in cfg.items() if not isinstance(v, (list, dict))}
        for batch in (args.requests, 1):
            key = "one_request" if batch == 1 else "full_batch"
            try:
                entry[key] = run_batch(workdir, cfg, batch, args, rates)
            except Exception as err:  # noqa: BLE001 - recorded; the next run still goes
                entry[key] = {"error": f"{type(err).__name__}: {err}"}
                entry[key]["traceback"] = traceback.format_exc()[-3000:]
            print(name, key, _line(entry[key]), flush=True)
    except Exception as err:  # noqa: BLE001
        entry["error"] = f"{type(err).__name__}: {err}"
        entry["traceback"] = traceback.format_exc()[-3000:]
        print(name, "error", entry["error"], flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return entry


def _line(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return (
        f"B {r['batch']}: {r['step_wall_ms']:.3f} ms/step, {r['step_x_roofline']:.2f}x roofline "
        f"(device {r['device_x_roofline']:.2f}x), bytes at copy {100 * r['bytes_at_copy_fraction']:.1f} %"
    )


def table(results: dict) -> str:
    rows = [
        "| model | B | step ms | x roofline | device x roofline | one request: bytes at copy |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in results["models"].items():
        fb, one = e.get("full_batch", {}), e.get("one_request", {})
        if "step_wall_ms" not in fb:
            rows.append(f"| {name} | - | {e.get('error') or fb.get('error')} | | | |")
            continue
        frac = one.get("bytes_at_copy_fraction")
        rows.append(
            f"| {name} | {fb['batch']} | {fb['step_wall_ms']:.3f} | {fb['step_x_roofline']:.2f} "
            f"| {fb['device_x_roofline']:.2f} | {'-' if frac is None else f'{100 * frac:.1f} %'} |"
        )
    return "\n".join(rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny twins (CPU smoke of the plumbing)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--warm", type=int, default=6)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    # device-only profile on CUDA (CPU op records would slow the host and the wall time)
    args.phase, args.gaps, args.prefix_caching = "decode", args.device == "cuda", "off"
    if args.tiny:
        args.requests, args.prompt_len, args.chunk = min(args.requests, 4), 32, 64
    return args


def main(argv=None) -> dict:
    import bench_breakdown as bd
    import bench_e2e as e2e

    args = parse_args(argv)
    rates = (e2e.copy_bandwidth(args.device), bd.matmul_rate(args.device))
    results = {
        "commit": os.environ.get("UNIKV_GIT_COMMIT"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "copy_GBps": rates[0] / 1e9,
        "matmul_TFLOPs": rates[1] / 1e12,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "models": {},
    }
    out = Path(args.out or ROOT / f"benchmarks/results/families_{args.device}.json")
    for name in args.models.split(","):
        results["models"][name] = run_model(name, args, rates)
        results["table"] = table(results)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1, default=str))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], out.name).write_text(out.read_text())
    print(results["table"])
    return results


if __name__ == "__main__":
    main()
