"""`unikv generate` and `unikv demo` (dispatched by ``unikv/cli.py``).

unikv generate --model DIR --prompt "..." [--prompt ...] [--chat] [--max-tokens N]
               [--temperature T --top-k K --top-p P --min-p P --seed S -n N]
               [--stop STR ...] [--page-size 16] [--kv-cache-bytes 4GiB] [--max-num-seqs 64]
               [--max-num-batched-tokens 512] [--device cuda] [--dtype bf16] [-tp N]
               (every EngineConfig field is a flag: unikv generate --help)
unikv demo [--model llama|gpt-oss|qwen3.5|all] [--seed 0]

``add_engine_args`` / ``llm_from_args`` are shared with ``unikv serve``.
"""

from __future__ import annotations

import argparse
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The options that build an engine (generate and serve): one flag per
    ``EngineConfig`` field, named as the field (``--max-num-seqs``), with vLLM's
    and unikv's older names as aliases (``config.CLI_ALIASES``)."""
    g = p.add_argument_group("engine (EngineConfig)")
    g.add_argument(
        "--model",
        required=True,
        help="checkpoint directory (config.json + safetensors), or a Hugging Face repo id "
        "(org/name) already in the local HF cache (HF_HUB_CACHE or $HF_HOME/hub)",
    )
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if present)")
    g.add_argument("--dtype", default=None, help="weights and compute dtype: bf16, fp16 or fp32")
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (= --dtype), or fp8 (= fp8_e4m3) / fp8_e5m2: attention K/V stored as fp8 "
        "(scale 1; twice bf16's tokens); MLA models refuse it",
    )
    g.add_argument("--page-size", "--block-size", type=int, default=16,
                   help="tokens per page (vLLM's --block-size; default 16)")  # fmt: skip
    g.add_argument("--kv-cache-bytes", "--kv-cache", default=None,
                   help="pool bytes, e.g. 4GiB (default: from free memory)")  # fmt: skip
    g.add_argument("--kv-cache-max-bytes", default=None,
                   help="an elastic pool that may grow to this many bytes, e.g. 8GiB")  # fmt: skip
    g.add_argument("--kv-cache-margin-bytes", default=None,
                   help="CUDA: size the pool after capture, leaving this many bytes free")  # fmt: skip
    g.add_argument(
        "--memory-fraction", "--gpu-memory-utilization", type=float, default=0.9,
        help="share of the memory free after the weights the pool may take (default 0.9; "
        "unlike vLLM's flag of that name, not a share of the whole GPU)",
    )  # fmt: skip
    g.add_argument("--max-num-seqs", type=int, default=64, help="running requests at most")
    g.add_argument("--max-num-batched-tokens", "--chunk", type=int, default=512,
                   help="tokens per step at most: the prefill chunk (default 512)")  # fmt: skip
    g.add_argument(
        "--max-prefill-tokens-decoding", type=int, default=None,
        help="prefill tokens per step at most while requests decode: an arriving prompt's "
        "prefill is spread over several steps (default: --max-num-batched-tokens less the "
        "decode rows)",
    )  # fmt: skip
    g.add_argument(
        "--admission-window-ms", type=float, default=0.0,
        help="unikv serve: when nothing runs and requests arrive, wait up to this long for "
        "more before the first step, so a burst is planned as few prefill steps (default 0: "
        "off)",
    )  # fmt: skip
    g.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode under CUDA graphs (default: on with CUDA)")  # fmt: skip
    g.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=False,
                   help="extend (prefill) steps under piecewise CUDA graphs, attention and "
                   "recurrent ops eager between the pieces (default: off)")  # fmt: skip
    g.add_argument("--prefill-graph-tokens", type=int, default=None,
                   help="with --prefill-graphs: the largest captured token count; longer extend "
                   "steps run eagerly (default: --max-num-batched-tokens)")  # fmt: skip
    g.add_argument("--backend", choices=("torch", "triton"), default=None,
                   help="kernel backend (default: triton on CUDA, torch on the CPU)")  # fmt: skip
    g.add_argument(
        "--engine-seed", type=int, default=0,
        help="seeds requests that give no seed (the config's seed; default 0)",
    )  # fmt: skip
    g.add_argument("--debug", action="store_true", help="allocator debug mode (slow)")
    g.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="ranks the model is split over (default 1): this process is rank 0 and starts "
        "the others (one GPU each from --device's on, or gloo on the CPU)",
    )  # fmt: skip
    g.add_argument(
        "--static-split", default=None,
        help='fixed sub-pool shares, a JSON object, e.g. \'{"mamba": 0.47, "full": 0.53}\'',
    )  # fmt: skip
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share KV pages of common prompt prefixes (default: on for full-attention and "
        "MLA models; off for sliding-window and recurrent ones, where it costs memory)",
    )
    g.add_argument(
        "--prefix-host-bytes",
        default=None,
        help="host bytes behind the prefix cache, e.g. 8GiB: evicted cached pages spill "
        "there and reload on a hit (default 0: off)",
    )
    g.add_argument(
        "--swap-host-bytes",
        default=None,
        help="host bytes preempted requests swap into, e.g. 4GiB (default 0: recompute)",
    )
    g.add_argument(
        "--preemption",
        choices=("auto", "swap", "recompute"),
        default="auto",
        help="auto: swap when the copies cost less than recomputing (default), swap, recompute",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3}\' (methods: ngram, draft_model, mtp, eagle3)',
    )
    g.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="speculative decoding turns off for a step with more decoding requests than "
        "this (vLLM's flag; default: the speculative config's disable_by_batch_size, 32)",
    )


def llm_from_args(args):
    """The LLM of ``add_engine_args``'s options (ValueError on bad values)."""
    from unikv.engine.config import EngineConfig
    from unikv.engine.llm import LLM

    return LLM(EngineConfig.from_cli(args))


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="unikv generate", description="Generate with a local Hugging Face checkpoint."
    )
    add_engine_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument(
        "--token-ids",
        action="append",
        default=[],
        help="a prompt as comma-separated token ids (repeatable)",
    )
    p.add_argument(
        "--chat", action="store_true", help="each --prompt is a user message (chat template)"
    )
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    p.add_argument("--min-tokens", type=int, default=0, help="no stop before this many tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off")
    p.add_argument("-n", type=int, default=1, help="completions per prompt")
    p.add_argument("--seed", type=int, default=None, help="seed of every request")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    return p


def _prompts(args, llm) -> list:
    prompts: list = []
    for text in args.prompt:
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": text})
            prompts.append(llm.prompts.chat(messages)[1])
        else:
            prompts.append(text)
    for text in args.token_ids:
        try:
            prompts.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError as err:
            raise ValueError(f"--token-ids takes comma-separated integers, got {text!r}") from err
    return prompts


def _params(args):
    from unikv.engine.sampling import SamplingParams

    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )


def _summary(llm) -> list[str]:
    from unikv.inspect import human

    s = llm.stats
    lines = [
        (
            f"{s.num_requests} requests, {s.prompt_tokens} prompt + {s.output_tokens} output "
            f"tokens in {s.seconds:.2f} s: {s.output_tokens_per_s:.1f} output tokens/s, {s.steps} steps "
            f"({s.decode_steps} decode), preemptions {s.preemptions}"
        ),
        f"pool {human(llm.pool.total_bytes)}, peak use per sub-pool:",
    ]
    for name, sub in llm.pool.subpools.items():
        peak = s.peak_pages.get(name, 0)
        share = 100 * peak * sub.page_bytes / llm.pool.total_bytes
        lines.append(
            f"  {name:5s} {peak:6d} / {sub.usable_pages} pages ({peak * sub.page_size} tokens, "
            f"{human(peak * sub.page_bytes)}, {share:.1f}% of the pool)"
        )
    return lines


class _PeakPicture:
    """Step hook: the picture of the pool at its fullest step."""

    def __init__(self) -> None:
        self.bytes, self.picture = -1, ""

    def __call__(self, llm, batch, logits) -> None:
        from unikv.engine.picture import pool_picture, pool_usage

        used = sum(u["bytes"] for u in pool_usage(llm.pool, llm.alloc).values())
        if used > self.bytes:
            self.bytes, self.picture = used, pool_picture(llm.pool, llm.alloc)


def generate_main(argv: list[str]) -> int:
    args = _generate_parser().parse_args(argv)
    try:
        if not args.prompt and not args.token_ids:
            raise ValueError("give at least one --prompt or --token-ids")
        if args.chat and not args.prompt:
            raise ValueError("--chat takes its messages from --prompt")
        params = _params(args)  # bad sampling values fail before the model loads
        llm = llm_from_args(args)
        peak = _PeakPicture()
        try:
            outputs = llm.generate(_prompts(args, llm), params, use_tqdm=True, on_step=peak)
        finally:
            llm.close()  # tensor-parallel workers stop (the summary reads the host side)
    except (ValueError, TypeError) as err:
        print(f"unikv generate: error: {err}", file=sys.stderr)
        return 2
    for i, out in enumerate(outputs):
        for c in out.outputs:
            shown = c.text if c.text is not None else c.token_ids
            tag = f"[{i}]" if len(out.outputs) == 1 else f"[{i}.{c.index}]"
            print(f"{tag} ({len(out.prompt_ids)} prompt tokens, {c.finish_reason}) {shown!r}")
    print("\n".join(_summary(llm)))
    print(f"pool at its fullest (# sink, F/S... live pages, . hole): {peak.picture}")
    return 0


def demo_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="unikv demo",
        description="Tiny random-init Llama, gpt-oss-style and Qwen3.5-style hybrid models "
        "served over the unified pool and checked token for token against transformers "
        "(no download, CPU).",
    )
    p.add_argument("--model", choices=["llama", "gpt-oss", "qwen3.5", "all"], default="all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=4)
    args = p.parse_args(argv)
    import torch

    from unikv.engine.demo import DEMOS, run_demo

    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared CPU
    names = list(DEMOS) if args.model == "all" else [args.model]
    ok = True
    for name in names:
        ok &= run_demo(name, seed=args.seed, max_tokens=args.max_tokens, page_size=args.page_size)
    print("\nunikv demo: " + ("all outputs identical to transformers" if ok else "MISMATCH"))
    return 0 if ok else 1
