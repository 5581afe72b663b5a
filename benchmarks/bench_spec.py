"""Speculative decoding: one request's decode tokens/s with and without it (issue 42).

Three runs on the same random-init model (``--model llama``: bench_e2e's Llama-3.2-1B
shape; ``--model qwen3_5``: bench_hybrid's Qwen3.5 shape, Gated DeltaNet + gated
attention, whose verify steps write per-draft-position state slots), greedy, one
request, ``--new-tokens`` tokens after a ``--prompt-len`` prompt:

- ``plain``: no speculation (CUDA graphs, the overlapped loop);
- ``forced``: ``{"method": "ngram", "num_speculative_tokens": k, "force_accept": true}``
  (every draft accepted: the verify step's cost at full acceptance; the tokens are
  not the model's). Target: >= 2.5x ``plain`` at k = 3;
- ``ngram``: real prompt lookup on a repetitive prompt (a block of code-like tokens
  repeated, as in code editing), with its acceptance rate and speed-up over
  ``plain`` on the same prompt.

Decode tokens/s = (N - 1) / (t(N tokens) - t(1 token)): the prefill cancels.

    python benchmarks/bench_spec.py                 # GPU, the Llama shape
    python benchmarks/bench_spec.py --model qwen3_5 # GPU, the Qwen3.5 shape
    python benchmarks/bench_spec.py --tiny --device cpu --new-tokens 32   # smoke
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_e2e import save_model
from common import environment, save_json

from unikv.engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


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
    s = llm.stats
    spec = {
        "acceptance_rate": s.spec_acceptance_rate,
        "mean_accepted_length": s.spec_mean_accepted_length,
        "draft_time_share": s.spec_draft_time_share,
        "verify_steps": s.spec_verify_steps,
        "steps": s.steps,
    }
    return (new_tokens - 1) / max(full - one, 1e-9), spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a few-KB model (smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="llama", choices=["llama", "qwen3_5"])
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--out", default=None, help="default: results/spec_decode[_MODEL].json")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    workdir = Path(tempfile.mkdtemp(prefix="bench_spec_"))
    if args.model == "llama":
        save_model("llama", workdir, args.device, dtype, args.tiny)
        vocab = 256 if args.tiny else 128256
        label = "llama-3.2-1b shape (random init)" if not args.tiny else "tiny llama"
    else:  # bench_hybrid's Qwen3.5 shape: k state slots per request besides its own
        from bench_hybrid import build_model, hf_config

        model = build_model("qwen3_5", workdir, args.device, dtype, args.tiny)
        del model  # (saved: the engine loads it)
        vocab = hf_config("qwen3_5", args.tiny).vocab_size
        label = "qwen3.5 shape, bench_hybrid (random init)" + (" tiny" if args.tiny else "")
    suffix = "" if args.model == "llama" else f"_{args.model}"
    out = args.out or str(ROOT / f"benchmarks/results/spec_decode{suffix}.json")
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
        "model": label,
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
    save_json(out, result)
    return result


if __name__ == "__main__":
    main()
