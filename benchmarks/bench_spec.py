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
  ``plain`` on the same prompt; ``ngram_pipelined``: the same with verify steps
  planned ahead and derived on the device (``speculative/derive.py``), with the
  steps planned ahead and thrown away (``ahead_steps``, ``ahead_dropped``).

With ``--mtp``: the DeepSeek-V3 shape of bench_families (MLA, 4 layers) with one MTP
layer in the released layout (``model.layers.4.*``: a MoE decoder layer plus enorm,
hnorm, eh_proj and shared_head, random init), two runs: ``plain`` and ``mtp_forced``
(``{"method": "mtp", "num_speculative_tokens": k, "force_accept": true}``: the MTP
layer drafts, every draft is accepted: the draft's chain plus the verify step at
full acceptance).

Without ``--model`` or ``--mtp``: the suite (``main_suite``, one run, sized for
about two minutes on an H100: not yet measured there), saved to ``results/spec_suite.json`` with its ratios:

- Llama (bench_e2e's Llama-3.2-1B shape, all 16 layers): one request, ``plain`` vs
  ``forced`` (n-gram drafts padded to k, every draft accepted) and, on a repetitive
  prompt (``rep``), ``plain`` vs ``ngram`` (real prompt lookup) vs
  ``ngram_pipelined`` (the same, verify steps planned ahead: ``speculative/ahead.py``);
- Qwen3.5 (bench_hybrid's widths, its first ``--qwen-layers`` = 4 layers: three
  Gated DeltaNet and one gated full attention, plus one MTP layer in the released
  ``mtp.*`` layout, random init): one request, ``plain`` vs ``forced`` (as Llama's:
  the verify step at full acceptance, drafting free; ``forced_pipelined``: verify
  steps planned ahead, the state slot chosen on the device) and ``mtp_forced`` (the
  MTP layer drafts, its chain's cost included, every draft accepted; the chain is one
  plan and one CUDA graph per lane count: ``speculative/chain.py``); on a repetitive
  prompt, ``plain`` vs ``ngram`` vs ``ngram_pipelined``;
- the batch-size rule, Llama, ``--batch`` = 64 requests with repetitive prompts
  (n-gram finds drafts, a random model rejects most), N / 2 new tokens each:
  ``plain`` vs ``spec_rule`` (``ngram`` with the default ``disable_by_batch_size``,
  32, or B - 1 for a smaller ``--batch``: no full step speculates) vs
  ``spec_no_rule`` (the limit at the batch: every step speculates); and, past the
  same rule, each draft that runs a forward: ``draft_model_rule`` (the target as its
  own draft) and ``eagle3_rule`` (a random EAGLE-3 head, ``save_eagle3_head``),
  whose drafts are lazy there (no draft forward per step: ``speculative/draft.py``,
  ``speculative/mtp.py``); Qwen3.5 likewise: ``plain_batch`` vs ``mtp_rule``.
  Ratios (``ratios`` in the JSON): ``llama_forced_speedup``,
  ``llama_forced_pipelined_speedup`` (``forced`` with verify steps planned ahead,
  ``speculative/ahead.py``), ``llama_ngram_speedup`` and ``llama_ngram_pipelined_speedup``
  (real acceptance, ``llama_ngram_acceptance_rate``; ``llama_ngram_pipelined_dropped_per_100``:
  steps planned ahead and thrown away per 100 tokens), ``qwen3_5_forced_speedup``,
  ``qwen3_5_forced_pipelined_speedup``, ``qwen3_5_ngram_speedup``,
  ``qwen3_5_ngram_pipelined_speedup`` (``qwen3_5_ngram_acceptance_rate``),
  ``qwen3_5_mtp_forced_speedup`` (target 2.5), ``b64_rule_vs_plain`` (ngram),
  ``b64_draft_model_rule_vs_plain``, ``b64_eagle3_rule_vs_plain``,
  ``qwen3_5_b64_mtp_rule_vs_plain`` (target >= 1.0) and ``b64_no_rule_vs_plain``.

Forced acceptance is a benchmark-only mode: the engines are built inside
``allow_forced_acceptance()`` (``LLM`` refuses it elsewhere).

Decode tokens/s = B (N - 1) / (t(N tokens) - t(1 token)): the prefill cancels.

    python benchmarks/bench_spec.py --device cuda   # GPU, the suite (spec_suite.json)
    python benchmarks/bench_spec.py --model llama   # GPU, the Llama shape, + ngram
    python benchmarks/bench_spec.py --model qwen3_5 # GPU, the Qwen3.5 shape, + ngram
    python benchmarks/bench_spec.py --mtp           # GPU, the DeepSeek-V3 shape, MTP
    python benchmarks/bench_spec.py --tiny --device cpu --new-tokens 32   # smoke

``--rule-only``: the batch-size rule's runs alone (``main_rule``, sized for about two
minutes on an H100), each against the plain engine measured just before and just
after it (plain, X, plain, Y, plain, ...: the ratio is X over the mean of its two
plains, so drift between runs cancels): Llama ``spec_rule`` (ngram),
``draft_model_rule`` and ``eagle3_rule``, Qwen3.5 ``mtp_rule``; saved to
``results/spec_rule.json``:

    python benchmarks/bench_spec.py --device cuda --rule-only --phases --out $OUT/spec_rule.json
    python benchmarks/bench_spec.py --tiny --device cpu --rule-only --new-tokens 16   # smoke

``--phases``: each run also reports the host milliseconds per step spent in each part
of the loop (schedule, drafts, plan, draft_chain, draft_verify_rows, forward, launch,
verify_step, complete_*), from
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
from unikv.engine.speculative.config import DEFAULT_DISABLE_BY_BATCH_SIZE, allow_forced_acceptance

ROOT = Path(__file__).resolve().parents[1]


PHASES = {  # host time per step of each part of the loop (``--phases``)
    "schedule": ("unikv.engine.scheduler", "Scheduler", "schedule"),
    "lookup": ("unikv.engine.speculative.engine", "Speculator", "lookup"),
    "drafts": ("unikv.engine.speculative.engine", "Speculator", "drafts"),
    "plan": ("unikv.engine.plan", "StepPlanner", "plan"),
    "draft_chain": ("unikv.engine.speculative.chain", "DraftChain", "run"),
    "draft_verify_rows": ("unikv.engine.speculative.mtp", "HiddenDraft", "forward_verify"),
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


def decode_rate(llm: LLM, prompt: list, new_tokens: int) -> tuple[float, dict]:
    """(decode tokens/s, the N-token run's speculation counters) of one request
    (``prompt``: its ids), or of a batch (``prompt``: a list of prompts)."""
    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
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
        "preemptions": s.preemptions,  # (a draft's sub-pools take a share of the pool)
        "ahead_steps": s.spec_ahead_steps,  # verify steps planned ahead (pipeline)
        "ahead_dropped": s.spec_ahead_dropped,  # of those, thrown away
        # verify plans advanced in place since start-up (``plan_steady.SteadyVerify``)
        "verify_plans_advanced": llm.runner.planner.upload.steady.advanced,
        # verify steps whose block tables were reused since start-up (``plan_tables``)
        "verify_tables_reused": llm.runner.planner.kept_tables.reused,
    }
    if phases:
        spec["host_ms_per_step"] = phases
    return len(prompts) * (new_tokens - 1) / max(full - one, 1e-9), spec


def model_names(args) -> dict:
    """The JSON's description of the suite's two models."""
    tiny = " tiny" if args.tiny else ""
    return {
        "llama": "llama-3.2-1b shape, 16 layers (random init)" + tiny,
        "qwen3_5": f"qwen3.5 shape of bench_hybrid, first {args.qwen_layers} layers + 1 MTP "
        "layer (random init)" + tiny,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a few-KB model (smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--model",
        default=None,
        choices=["llama", "qwen3_5"],
        help="one shape's plain/forced/ngram runs (default: the suite)",
    )
    p.add_argument("--batch", type=int, default=64, help="the suite's batch-size-rule batch")
    p.add_argument("--qwen-layers", type=int, default=4, help="the suite's Qwen3.5 layers")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--mtp", action="store_true", help="the DeepSeek-V3 shape: plain vs MTP")
    p.add_argument("--phases", action="store_true", help="host ms per step of each loop part")
    p.add_argument(
        "--rule-only", action="store_true", help="the batch-size rule's runs, plain alternated"
    )
    p.add_argument("--out", default=None, help="JSON path (default: results/spec_*.json)")
    return p.parse_args(argv)


def add_tensors(path: Path, tensors: dict, config: dict) -> None:
    """``tensors`` saved beside a checkpoint (another safetensors file, in the index,
    which is made when the checkpoint is one file) and ``config`` merged into its
    config.json."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.loads((path / "config.json").read_text())
    cfg.update(config)
    (path / "config.json").write_text(json.dumps(cfg))
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path / "mtp-extra.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, "mtp-extra.safetensors"))
    index_path.write_text(json.dumps(index))


def add_mtp_layer(path: Path, dtype: torch.dtype) -> None:
    """A checkpoint saved with one layer more than its config will say: that last
    layer becomes MTP layer 0 (released layout), with random enorm, hnorm, eh_proj
    and shared_head.norm beside it (``add_tensors``)."""
    cfg = json.loads((path / "config.json").read_text())
    n = cfg["num_hidden_layers"] - 1
    hidden, g = cfg["hidden_size"], torch.Generator().manual_seed(1)
    extra = {
        "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "eh_proj.weight": 0.02 * torch.randn(hidden, 2 * hidden, generator=g),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
    }
    extra = {f"model.layers.{n}.{k}": v.to(dtype) for k, v in extra.items()}
    add_tensors(path, extra, {"num_hidden_layers": n, "num_nextn_predict_layers": 1})


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
        with allow_forced_acceptance():  # a benchmark: the forced runs' mode
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


def save_qwen_mtp_model(path: Path, device: str, dtype: torch.dtype, tiny: bool, layers: int):
    """bench_hybrid's Qwen3.5 shape cut to its first ``layers`` layers, random init,
    saved with one MTP layer in the released layout: ``mtp.layers.0.*`` a
    transformers full-attention decoder layer's tensors (its own init), ``mtp.fc``
    and the three zero-centred norms (``add_tensors``). Returns the vocabulary size."""
    import transformers as tf
    from bench_hybrid import hf_config

    config = hf_config("qwen3_5", tiny)
    types = list(config.layer_types)[:layers]
    if "full_attention" not in types:
        raise ValueError(f"--qwen-layers {layers}: keep a full-attention layer (4 or more)")
    config.num_hidden_layers, config.layer_types = layers, types
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.save_pretrained(path)
        full = types.index("full_attention")
        block = type(model.model.layers[full])(config, full).to(dtype)
    del model
    hidden, g = config.hidden_size, torch.Generator().manual_seed(1)
    tensors = {f"mtp.layers.0.{k}": v.cpu() for k, v in block.state_dict().items()}
    tensors.update({
        "mtp.fc.weight": 0.02 * torch.randn(hidden, 2 * hidden, generator=g),
        "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(hidden, generator=g),
        "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(hidden, generator=g),
        "mtp.norm.weight": 0.1 * torch.randn(hidden, generator=g),
    })  # fmt: skip
    add_tensors(path, {k: v.to(dtype) for k, v in tensors.items()}, {"mtp_num_hidden_layers": 1})
    return config.vocab_size


def save_eagle3_head(path: Path, target: Path, dtype: torch.dtype, draft_vocab: int) -> None:
    """A random EAGLE-3 head for the checkpoint at ``target`` (its width, heads and
    vocabulary; ``draft_vocab`` draft ids mapped onto a random subset by ``d2t``),
    saved to ``path`` in the released layout (one Llama-shaped midlayer)."""
    from safetensors.torch import save_file

    cfg = json.loads((target / "config.json").read_text())
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, inter, vocab = hidden // heads, cfg["intermediate_size"], cfg["vocab_size"]
    draft_vocab = min(draft_vocab, vocab)
    g = torch.Generator().manual_seed(2)

    def w(*shape):
        return 0.02 * torch.randn(*shape, generator=g)

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    attn = {"q": heads * head_dim, "k": kv * head_dim, "v": kv * head_dim}
    tensors = {
        f"midlayer.self_attn.{n}_proj.weight": w(rows, 2 * hidden) for n, rows in attn.items()
    }
    tensors.update({
        "fc.weight": w(hidden, 3 * hidden), "midlayer.input_layernorm.weight": norm(hidden),
        "midlayer.hidden_norm.weight": norm(hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden), "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter), "norm.weight": norm(hidden),
        "lm_head.weight": w(draft_vocab, hidden),
    })  # fmt: skip
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    tensors.update({"d2t": ids - torch.arange(draft_vocab), "t2d": t2d})
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5), "vocab_size": vocab,
        "draft_vocab_size": draft_vocab, "max_position_embeddings": cfg["max_position_embeddings"],
        "rope_theta": cfg.get("rope_theta", 10000.0), "torch_dtype": str(dtype).split(".")[-1],
    }  # fmt: skip
    layers = cfg["num_hidden_layers"]
    if layers < 6:  # the default taps (2, L/2, L-3) need six layers: a tiny target's own
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [0, (layers - 1) // 2, layers - 2]
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def _suite_runs(path: Path, configs: dict, prompts: dict, kw: dict) -> dict:
    """{run: {prompt label: rate and counters}}: one engine per config (its own
    engine options merged into ``kw``), each over the prompts its entry names
    (``prompts``: label -> (one prompt or a batch, new tokens))."""
    runs = {}
    for name, (spec, labels, extra) in configs.items():
        with allow_forced_acceptance():  # a benchmark: the forced runs' mode
            llm = LLM(str(path), speculative_config=spec, **{**kw, **extra})
        runs[name] = {}
        for label in labels:
            rate, counters = decode_rate(llm, *prompts[label])
            runs[name][label] = {"decode_tokens_per_s": rate, **counters}
            print(f"{name:12s} {label:8s} {rate:10.1f} tok/s  {counters}")
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return runs


# (run, prompt) of each model's one-request speedups over its ``plain`` run, in order
SPEEDUPS = (("forced", "one"), ("forced_pipelined", "one"), ("ngram", "rep"),
            ("ngram_pipelined", "rep"))  # fmt: skip
# (ratio name, Llama run) of the batch-size rule's runs over ``plain`` at the batch
RULE_RUNS = (("rule", "spec_rule"), ("no_rule", "spec_no_rule"),
             ("draft_model_rule", "draft_model_rule"), ("eagle3_rule", "eagle3_rule"))  # fmt: skip


def suite_ratios(runs: dict, n: int, b: int) -> dict[str, float]:
    """The suite's ``ratios`` (module docstring) from its runs by model (``llama``,
    ``qwen3_5``: run -> prompt -> result), ``n`` new tokens, batch ``b``."""

    def speedup(model: str, run: str, prompt: str, base: str = "plain") -> float:
        rate = runs[model][run][prompt]["decode_tokens_per_s"]
        return rate / runs[model][base][prompt]["decode_tokens_per_s"]

    ratios = {}
    for model in ("llama", "qwen3_5"):
        for run, prompt in SPEEDUPS:
            ratios[f"{model}_{run}_speedup"] = speedup(model, run, prompt)
        rep = runs[model]["ngram_pipelined"]["rep"]
        ratios[f"{model}_ngram_acceptance_rate"] = rep["acceptance_rate"]
        if model == "llama":
            ratios["llama_ngram_pipelined_dropped_per_100"] = 100 * rep["ahead_dropped"] / n
    ratios["qwen3_5_mtp_forced_speedup"] = speedup("qwen3_5", "mtp_forced", "one")
    for name, run in RULE_RUNS:
        ratios[f"b{b}_{name}_vs_plain"] = speedup("llama", run, "batch")
    ratios[f"qwen3_5_b{b}_mtp_rule_vs_plain"] = speedup(
        "qwen3_5", "mtp_rule", "batch", "plain_batch"
    )
    return ratios


def main_suite(args, dtype) -> dict:
    """The suite (module docstring): k drafts at forced acceptance on the Llama and
    Qwen3.5 shapes, one request; the batch-size rule at ``--batch`` requests."""
    start, k, n, b = time.perf_counter(), args.k, args.new_tokens, args.batch
    g = torch.Generator().manual_seed(0)
    max_len = args.prompt_len + n + 16
    kw = {"device": args.device, "dtype": dtype, "max_num_seqs": 4, "max_model_len": max_len,
          "kv_cache_bytes": 1 << 30, "max_num_batched_tokens": 512}  # fmt: skip
    big = {"max_num_seqs": b, "kv_cache_bytes": 3 << 30, "max_num_batched_tokens": 2048}
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}  # fmt: skip

    llama = Path(tempfile.mkdtemp(prefix="bench_spec_llama_"))
    save_model("llama", llama, args.device, dtype, args.tiny)
    vocab = 256 if args.tiny else 128256
    one = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
    blocks = torch.randint(0, vocab, (b, max(args.prompt_len // 4, 8)), generator=g).tolist()
    batch = [(block * 4)[: args.prompt_len] for block in blocks]  # repetitive: n-grams hit
    forced = {"method": "ngram", "num_speculative_tokens": k, "force_accept": True}
    rule = min(DEFAULT_DISABLE_BY_BATCH_SIZE, b - 1)  # the default rule, on at this batch
    head = Path(tempfile.mkdtemp(prefix="bench_spec_eagle3_"))
    save_eagle3_head(head, llama, dtype, 32000)
    lazy = {"num_speculative_tokens": k, "disable_by_batch_size": rule}  # past it: lazy drafts
    llama_runs = _suite_runs(llama, {
        "plain": (None, ("one", "rep", "batch"), big),
        "forced": (forced, ("one",), {}),
        "forced_pipelined": ({**forced, "pipeline": True}, ("one",), {}),
        "ngram": (ngram, ("rep",), {}),
        "ngram_pipelined": ({**ngram, "pipeline": True}, ("rep",), {}),
        "spec_rule": ({**ngram, "disable_by_batch_size": rule}, ("batch",), big),
        "spec_no_rule": ({**ngram, "disable_by_batch_size": b}, ("batch",), big),
        "draft_model_rule": ({**lazy, "method": "draft_model", "model": str(llama)}, ("batch",), big),
        "eagle3_rule": ({**lazy, "method": "eagle3", "model": str(head)}, ("batch",), big),
    }, {"one": (one, n), "rep": (batch[0], n), "batch": (batch, max(n // 2, 2))}, kw)  # fmt: skip

    qwen = Path(tempfile.mkdtemp(prefix="bench_spec_qwen_"))
    vocab = save_qwen_mtp_model(qwen, args.device, dtype, args.tiny, args.qwen_layers)
    one = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
    mtp = {"method": "mtp", "num_speculative_tokens": k, "force_accept": True}
    blocks = torch.randint(0, vocab, (b, max(args.prompt_len // 4, 8)), generator=g).tolist()
    batch = [(block * 4)[: args.prompt_len] for block in blocks]
    qwen_runs = _suite_runs(qwen, {
        "plain": (None, ("one", "rep"), {}), "plain_batch": (None, ("batch",), big),
        "forced": (forced, ("one",), {}), "mtp_forced": (mtp, ("one",), {}),
        "forced_pipelined": ({**forced, "pipeline": True}, ("one",), {}),
        "ngram": (ngram, ("rep",), {}),
        "ngram_pipelined": ({**ngram, "pipeline": True}, ("rep",), {}),
        "mtp_rule": ({**lazy, "method": "mtp"}, ("batch",), big),
    }, {"one": (one, n), "rep": (batch[0], n), "batch": (batch, max(n // 2, 2))}, kw)  # fmt: skip

    ratios = suite_ratios({"llama": llama_runs, "qwen3_5": qwen_runs}, n, b)
    result = {
        "environment": environment(),
        "models": model_names(args),
        "k": k, "prompt_len": args.prompt_len, "new_tokens": n, "batch": b,
        "batch_new_tokens": max(n // 2, 2),
        "llama": llama_runs, "qwen3_5": qwen_runs, "ratios": ratios,
        "targets": {"forced_speedup": 2.5, "rule_vs_plain": 1.0},
        "wall_s": time.perf_counter() - start,
    }  # fmt: skip
    for name, value in ratios.items():
        print(f"{name:28s} {value:6.2f}x")
    print(f"suite: {result['wall_s']:.0f} s")
    save_json(args.out or str(ROOT / "benchmarks/results/spec_suite.json"), result)
    return result


def _alternated(path: Path, configs: dict, batch: list, new_tokens: int, kw: dict) -> dict:
    """{run: rate, counters, the plain rates just before and after it and ``vs_plain``
    (its rate over their mean)} for each speculative config in ``configs``, past the
    rule on ``batch``; one plain engine (``kw``) measured between them (plain, X,
    plain, Y, plain, ...), each X's engine built and dropped in turn."""
    plain = LLM(str(path), **kw)
    rate, counters = decode_rate(plain, batch, new_tokens)
    runs = {"plain_batch": {"decode_tokens_per_s": rate, **counters}}
    print(f"{'plain_batch':16s} {rate:10.1f} tok/s")
    before = rate
    for name, spec in configs.items():
        with allow_forced_acceptance():
            llm = LLM(str(path), speculative_config=spec, **kw)
        rate, counters = decode_rate(llm, batch, new_tokens)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        after, plain_counters = decode_rate(plain, batch, new_tokens)
        ratio = rate / ((before + after) / 2)
        runs[name] = {"decode_tokens_per_s": rate, **counters, "plain_before": before,
                      "plain_after": after, "plain_after_counters": plain_counters,
                      "vs_plain": ratio}  # fmt: skip
        print(f"{name:16s} {rate:10.1f} tok/s  plain {before:.1f} / {after:.1f}  {ratio:.3f}x")
        before = after
    return runs


def main_rule(args, dtype) -> dict:
    """The batch-size rule's runs alone (module docstring, ``--rule-only``): ``--batch``
    requests with repetitive prompts, N / 2 new tokens each, the default rule (or
    B - 1 for a smaller batch: no full step speculates), each speculative engine
    against the plain one measured around it."""
    start, k, b = time.perf_counter(), args.k, args.batch
    n = max(args.new_tokens // 2, 2)
    g = torch.Generator().manual_seed(0)
    kw = {"device": args.device, "dtype": dtype, "max_num_seqs": b, "kv_cache_bytes": 3 << 30,
          "max_model_len": args.prompt_len + n + 16, "max_num_batched_tokens": 2048}  # fmt: skip
    rule = min(DEFAULT_DISABLE_BY_BATCH_SIZE, b - 1)
    lazy = {"num_speculative_tokens": k, "disable_by_batch_size": rule}
    ngram = {**lazy, "method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}

    def batch_of(vocab: int) -> list:
        blocks = torch.randint(0, vocab, (b, max(args.prompt_len // 4, 8)), generator=g)
        return [(block * 4)[: args.prompt_len] for block in blocks.tolist()]

    llama = Path(tempfile.mkdtemp(prefix="bench_spec_llama_"))
    save_model("llama", llama, args.device, dtype, args.tiny)
    head = Path(tempfile.mkdtemp(prefix="bench_spec_eagle3_"))
    save_eagle3_head(head, llama, dtype, 32000)
    llama_runs = _alternated(llama, {
        "spec_rule": ngram,
        "draft_model_rule": {**lazy, "method": "draft_model", "model": str(llama)},
        "eagle3_rule": {**lazy, "method": "eagle3", "model": str(head)},
    }, batch_of(256 if args.tiny else 128256), n, kw)  # fmt: skip
    qwen = Path(tempfile.mkdtemp(prefix="bench_spec_qwen_"))
    vocab = save_qwen_mtp_model(qwen, args.device, dtype, args.tiny, args.qwen_layers)
    qwen_runs = _alternated(qwen, {"mtp_rule": {**lazy, "method": "mtp"}}, batch_of(vocab), n, kw)
    ratios = {f"b{b}_{name}_vs_plain": r["vs_plain"] for name, r in llama_runs.items()
              if "vs_plain" in r}  # fmt: skip
    ratios[f"qwen3_5_b{b}_mtp_rule_vs_plain"] = qwen_runs["mtp_rule"]["vs_plain"]
    result = {
        "environment": environment(),
        "models": model_names(args),
        "k": k, "prompt_len": args.prompt_len, "batch": b, "batch_new_tokens": n,
        "disable_by_batch_size": rule, "llama": llama_runs, "qwen3_5": qwen_runs,
        "ratios": ratios, "targets": {"rule_vs_plain": 1.0},
        "wall_s": time.perf_counter() - start,
    }  # fmt: skip
    for name, value in ratios.items():
        print(f"{name:32s} {value:6.3f}x")
    print(f"rule runs: {result['wall_s']:.0f} s")
    save_json(args.out or str(ROOT / "benchmarks/results/spec_rule.json"), result)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    if args.phases:
        time_phases()
    if args.rule_only:
        return main_rule(args, dtype)
    if args.model is None and not args.mtp:
        return main_suite(args, dtype)
    if args.mtp:
        max_len = args.prompt_len + args.new_tokens + 16
        kw = {"device": args.device, "dtype": dtype, "max_num_seqs": 4, "max_model_len": max_len,
              "kv_cache_bytes": 1 << 30, "max_num_batched_tokens": 512}  # fmt: skip
        return main_mtp(args, dtype, kw)
    workdir = Path(tempfile.mkdtemp(prefix="bench_spec_"))
    if args.model == "llama":
        save_model("llama", workdir, args.device, dtype, args.tiny)
        vocab = 256 if args.tiny else 128256
        model_label = "llama-3.2-1b shape (random init)" if not args.tiny else "tiny llama"
    else:  # bench_hybrid's Qwen3.5 shape: k state slots per request besides its own
        from bench_hybrid import build_model, hf_config

        model = build_model("qwen3_5", workdir, args.device, dtype, args.tiny)
        del model  # (saved: the engine loads it)
        vocab = hf_config("qwen3_5", args.tiny).vocab_size
        model_label = "qwen3.5 shape, bench_hybrid (random init)" + (" tiny" if args.tiny else "")
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
    configs["ngram_pipelined"] = {**configs["ngram"], "pipeline": True}
    runs = {}
    for name, spec in configs.items():
        with allow_forced_acceptance():  # a benchmark: the forced runs' mode
            llm = LLM(str(workdir), speculative_config=spec, **kw)
        prompts = {"random": plain_prompt, "repetitive": repetitive}
        runs[name] = {}
        for label, prompt in prompts.items():
            if name != "plain" and (name == "forced") != (label == "random"):
                continue  # forced: the random prompt; ngram (pipelined): the repetitive one
            rate, counters = decode_rate(llm, prompt, args.new_tokens)
            runs[name][label] = {"decode_tokens_per_s": rate, **counters}
            print(f"{name:7s} {label:10s} {rate:9.1f} tok/s  {counters}")
        del llm
        if args.device != "cpu":
            torch.cuda.empty_cache()
    forced = runs["forced"]["random"]["decode_tokens_per_s"]
    base = runs["plain"]["random"]["decode_tokens_per_s"]
    ngram = runs["ngram"]["repetitive"]["decode_tokens_per_s"]
    piped = runs["ngram_pipelined"]["repetitive"]
    base_rep = runs["plain"]["repetitive"]["decode_tokens_per_s"]
    result = {
        "environment": environment(),
        "model": model_label,
        "k": k,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "runs": runs,
        "forced_speedup": forced / base,
        "forced_target": 2.5,
        "forced_meets_target": forced / base >= 2.5,
        "ngram_speedup": ngram / base_rep,
        "ngram_acceptance_rate": runs["ngram"]["repetitive"]["acceptance_rate"],
        "ngram_pipelined_speedup": piped["decode_tokens_per_s"] / base_rep,
        "ngram_pipelined_dropped_per_100": 100 * piped["ahead_dropped"] / args.new_tokens,
    }
    print(f"forced acceptance, k={k}: {forced / base:.2f}x (target 2.5x); "
          f"ngram: {ngram / base_rep:.2f}x at acceptance "
          f"{result['ngram_acceptance_rate']:.2f}, pipelined "
          f"{result['ngram_pipelined_speedup']:.2f}x")  # fmt: skip
    save_json(out, result)
    return result


if __name__ == "__main__":
    main()
