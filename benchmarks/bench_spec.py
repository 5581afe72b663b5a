"""Speculative decoding: one request's decode tokens/s with and without it (issue 42).

Three runs on the same random-init model (bench_e2e's Llama-3.2-1B shape), greedy,
one request, ``--new-tokens`` tokens after a ``--prompt-len`` prompt:

- ``plain``: no speculation (CUDA graphs, the overlapped loop);
- ``forced``: ``{"method": "ngram", "num_speculative_tokens": k, "force_accept": true}``
  (every draft accepted: the verify step's cost at full acceptance; the tokens are
  not the model's). Target: >= 2.5x ``plain`` at k = 3;
- ``ngram``: real prompt lookup on a repetitive prompt (a block of code-like tokens
  repeated, as in code editing), with its acceptance rate and speed-up over
  ``plain`` on the same prompt.

With ``--mtp``: the DeepSeek-V3 shape of bench_families (MLA, 4 layers) with one MTP
layer in the released layout (``model.layers.4.*``: a MoE decoder layer plus enorm,
hnorm, eh_proj and shared_head, random init), two runs: ``plain`` and ``mtp_forced``
(``{"method": "mtp", "num_speculative_tokens": k, "force_accept": true}``: the MTP
layer drafts, every draft is accepted: the draft's chain plus the verify step at
full acceptance).

Decode tokens/s = (N - 1) / (t(N tokens) - t(1 token)): the prefill cancels.

    python benchmarks/bench_spec.py                 # GPU, the Llama shape
    python benchmarks/bench_spec.py --mtp           # GPU, the DeepSeek-V3 shape, MTP
    python benchmarks/bench_spec.py --tiny --device cpu --new-tokens 32   # smoke

``--phases``: each run also reports the host milliseconds per step spent in each part
of the loop (schedule, drafts, plan, forward, launch, verify_step, complete_*), from
one more timed run (the timers cost a little: the rates come from the untimed runs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import bench_e2e
import torch
from bench_e2e import save_model
from common import environment, save_json

from unikv.engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


PHASES = {  # host time per step of each part of the loop (``--phases``)
    "schedule": ("unikv.engine.scheduler", "Scheduler", "schedule"),
    "drafts": ("unikv.engine.speculative.engine", "Speculator", "drafts"),
    "plan": ("unikv.engine.plan", "StepPlanner", "plan"),
    "forward": ("unikv.engine.runner", "ModelRunner", "forward"),
    "launch": ("unikv.engine.runner", "ModelRunner", "launch"),
    "verify_step": ("unikv.engine.runner", None, "verify_step"),
    "complete_verify": ("unikv.engine.scheduler", "Scheduler", "complete_verify"),
    "complete_ahead": ("unikv.engine.scheduler", "Scheduler", "complete_ahead"),
    "resolve": ("unikv.engine.scheduler", "Scheduler", "resolve"),
    "step": ("unikv.engine.online", "EngineLoop", "step"),
}
_SPENT: dict[str, float] = {}


def time_phases() -> None:
    """Wrap each ``PHASES`` function with a host timer (into ``_SPENT``). ``launch``
    includes the verify step's readback, so on CUDA launch - forward - verify_step is
    mostly the wait for the device; ``step`` is the loop's whole step."""
    import functools
    import importlib

    for label, (module, cls, name) in PHASES.items():
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        inner = getattr(owner, name)

        def timed(*a, _inner=inner, _label=label, **k):
            start = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                _SPENT[_label] = _SPENT.get(_label, 0.0) + time.perf_counter() - start

        setattr(owner, name, functools.wraps(inner)(timed))


def decode_rate(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[float, dict]:
    """(decode tokens/s, the N-token run's speculation counters) of one request."""

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - start

    run(8)  # warm-up (compiles, graphs)
    one = min(run(1) for _ in range(2))
    full = min(run(new_tokens) for _ in range(2))
    _SPENT.clear()
    run(new_tokens)  # the phases of one more run (only where ``time_phases`` wrapped them)
    phases = {k: v / max(llm.stats.steps, 1) * 1e3 for k, v in _SPENT.items()}
    s = llm.stats
    spec = {
        "acceptance_rate": s.spec_acceptance_rate,
        "mean_accepted_length": s.spec_mean_accepted_length,
        "draft_time_share": s.spec_draft_time_share,
        "verify_steps": s.spec_verify_steps,
        "steps": s.steps,
    }
    if phases:
        spec["host_ms_per_step"] = phases
    return (new_tokens - 1) / max(full - one, 1e-9), spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a few-KB model (smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--mtp", action="store_true", help="the DeepSeek-V3 shape: plain vs MTP")
    p.add_argument("--phases", action="store_true", help="host ms per step of each loop part")
    p.add_argument("--out", default=None, help="JSON path (default: results/spec_*.json)")
    return p.parse_args(argv)


def add_mtp_layer(path: Path, dtype: torch.dtype) -> None:
    """A checkpoint saved with one layer more than its config will say: that last
    layer becomes MTP layer 0 (released layout), with random enorm, hnorm, eh_proj
    and shared_head.norm beside it (another safetensors file, in the index)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.loads((path / "config.json").read_text())
    n = cfg["num_hidden_layers"] - 1
    cfg.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(cfg))
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    hidden, g = cfg["hidden_size"], torch.Generator().manual_seed(1)
    extra = {
        "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "eh_proj.weight": 0.02 * torch.randn(hidden, 2 * hidden, generator=g),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
    }
    extra = {f"model.layers.{n}.{k}": v.to(dtype).contiguous() for k, v in extra.items()}
    save_file(extra, str(path / "mtp-extra.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(extra, "mtp-extra.safetensors"))
    index_path.write_text(json.dumps(index))


def save_mtp_model(path: Path, device: str, dtype: torch.dtype, tiny: bool) -> None:
    """bench_families' DeepSeek-V3 shape, saved with one MTP layer (``add_mtp_layer``)."""
    import bench_families

    cfg = bench_families.model_config("deepseek_v3", tiny)
    cfg["num_hidden_layers"] += 1  # the MTP layer's decoder layer, saved as the last
    bench_e2e.save_model("deepseek_v3", path, device, dtype, tiny, cfg=cfg)
    add_mtp_layer(path, dtype)


def main_mtp(args, dtype, kw) -> dict:
    """Plain decoding vs MTP drafts at forced acceptance, the DeepSeek-V3 shape."""
    workdir = Path(tempfile.mkdtemp(prefix="bench_spec_mtp_"))
    save_mtp_model(workdir, args.device, dtype, args.tiny)
    vocab = json.loads((workdir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
    k = args.k
    configs = {
        "plain": None,
        "mtp_forced": {"method": "mtp", "num_speculative_tokens": k, "force_accept": True},
    }
    runs = {}
    for name, spec in configs.items():
        llm = LLM(str(workdir), speculative_config=spec, **kw)
        rate, counters = decode_rate(llm, prompt, args.new_tokens)
        runs[name] = {"decode_tokens_per_s": rate, **counters}
        print(f"{name:10s} {rate:9.1f} tok/s  {counters}")
        del llm
        if args.device != "cpu":
            torch.cuda.empty_cache()
    speedup = runs["mtp_forced"]["decode_tokens_per_s"] / runs["plain"]["decode_tokens_per_s"]
    result = {
        "environment": environment(),
        "model": "deepseek-v3 shape, 4 layers + 1 MTP layer (random init)"
        if not args.tiny else "tiny deepseek-v3 + MTP",
        "k": k, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "runs": runs,
        "mtp_forced_speedup": speedup, "target": 2.5, "meets_target": speedup >= 2.5,
    }  # fmt: skip
    print(f"MTP at forced acceptance, k={k}: {speedup:.2f}x (target 2.5x)")
    save_json(args.out or str(ROOT / "benchmarks/results/spec_decode_mtp.json"), result)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    if args.phases:
        time_phases()
    if args.mtp:
        max_len = args.prompt_len + args.new_tokens + 16
        kw = {"device": args.device, "dtype": dtype, "max_num_seqs": 4, "max_model_len": max_len,
              "kv_cache_bytes": 1 << 30, "max_num_batched_tokens": 512}  # fmt: skip
        return main_mtp(args, dtype, kw)
    workdir = Path(tempfile.mkdtemp(prefix="bench_spec_"))
    save_model("llama", workdir, args.device, dtype, args.tiny)
    vocab = 256 if args.tiny else 128256
    g = torch.Generator().manual_seed(0)
    plain_prompt = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
    block = torch.randint(0, vocab, (max(args.prompt_len // 4, 8),), generator=g).tolist()
    repetitive = (block * 4)[: args.prompt_len]
    max_len = args.prompt_len + args.new_tokens + 16
    kw = {"device": args.device, "dtype": dtype, "max_num_seqs": 4, "max_model_len": max_len,
          "kv_cache_bytes": 1 << 30, "max_num_batched_tokens": 512}  # fmt: skip
    k = args.k
    configs = {
        "plain": None,
        "forced": {"method": "ngram", "num_speculative_tokens": k, "force_accept": True},
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4},
    }  # fmt: skip
    runs = {}
    for name, spec in configs.items():
        llm = LLM(str(workdir), speculative_config=spec, **kw)
        prompts = {"random": plain_prompt, "repetitive": repetitive}
        runs[name] = {}
        for label, prompt in prompts.items():
            if name != "plain" and (name == "forced") != (label == "random"):
                continue  # forced: the random prompt; ngram: the repetitive one
            rate, counters = decode_rate(llm, prompt, args.new_tokens)
            runs[name][label] = {"decode_tokens_per_s": rate, **counters}
            print(f"{name:7s} {label:10s} {rate:9.1f} tok/s  {counters}")
        del llm
        if args.device != "cpu":
            torch.cuda.empty_cache()
    forced = runs["forced"]["random"]["decode_tokens_per_s"]
    base = runs["plain"]["random"]["decode_tokens_per_s"]
    ngram = runs["ngram"]["repetitive"]["decode_tokens_per_s"]
    base_rep = runs["plain"]["repetitive"]["decode_tokens_per_s"]
    result = {
        "environment": environment(),
        "model": "llama-3.2-1b shape (random init)" if not args.tiny else "tiny llama",
        "k": k,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "runs": runs,
        "forced_speedup": forced / base,
        "forced_target": 2.5,
        "forced_meets_target": forced / base >= 2.5,
        "ngram_speedup": ngram / base_rep,
        "ngram_acceptance_rate": runs["ngram"]["repetitive"]["acceptance_rate"],
    }
    print(f"forced acceptance, k={k}: {forced / base:.2f}x (target 2.5x); "
          f"ngram: {ngram / base_rep:.2f}x at acceptance "
          f"{result['ngram_acceptance_rate']:.2f}")  # fmt: skip
    save_json(args.out or str(ROOT / "benchmarks/results/spec_decode.json"), result)
    return result


if __name__ == "__main__":
    main()
