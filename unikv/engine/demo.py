"""`unikv demo`: the unified pool inside real inference, on a fresh machine.

For each bundled tiny config (a Llama-3-style model, a gpt-oss-style model
with sliding + full layers, sinks and MoE, and a Qwen3.5-style hybrid of Gated
DeltaNet and full-attention layers):

1. transformers builds the model with random weights (fixed seed) and saves it
   to a temporary directory; unikv loads it from there, like any checkpoint;
2. unikv serves a batch whose prompt + output tokens exceed what the pool holds
   at once, so pages are recycled, requests may be preempted, (gpt-oss)
   sliding-window pages leave the pool while the full-attention band grows, and
   (Qwen3.5) the Mamba band of state slots, one per running request, grows and
   shrinks against the full-attention band as requests come and go;
3. transformers' ``generate`` runs every prompt on the same weights, and the
   greedy tokens are compared;
4. the results and pictures of the pool at a few moments are printed.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from unikv.engine.picture import legend, pool_picture, pool_usage

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
DEMOS = {"llama": "demo-llama.json", "gpt-oss": "demo-gpt-oss.json", "qwen3.5": "demo-qwen3.5.json"}
MAMBA_SLOTS = 4  # the hybrid's pool: room for this many state slots beside its pages


def build_demo_model(name: str, path: str, seed: int = 0):
    """Random-init transformers model of demo ``name``, saved to ``path``;
    returns the (fp32, eval) transformers model."""
    import transformers as tf

    config = json.loads((PRESET_DIR / DEMOS[name]).read_text())
    config.pop("_source", None)
    Path(path, "config.json").write_text(json.dumps(config))
    hf_config = tf.AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


def demo_prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    """``num`` random prompts of varied lengths (12 to ~60 tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [12 + (i * 17) % 49 for i in range(num)]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' ``generate`` (greedy, dynamic cache) for one prompt: the
    reference the demo and the tests compare against."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def run_demo(
    name: str,
    *,
    num_prompts: int = 8,
    max_tokens: int = 32,
    page_size: int = 4,
    pool_tokens: int = 160,
    seed: int = 0,
    device: str = "cpu",
    out=print,
) -> bool:
    """Serve one demo model and compare with transformers; True when all match."""
    from unikv.engine.llm import LLM
    from unikv.engine.sampling import SamplingParams
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    with tempfile.TemporaryDirectory(prefix=f"unikv-demo-{name}-") as path:
        hf = build_demo_model(name, path, seed)
        configs = specs_from_hf_config(path, page_size=page_size, dtype=torch.float32)
        pages = {c.name: pool_tokens // page_size for c in configs if c.spec.kind != "mamba"}
        pages |= {c.name: MAMBA_SLOTS for c in configs if c.spec.kind == "mamba"}  # slots
        budget = pool_bytes_for(configs, pages)
        llm = LLM(
            path,
            device=device,
            dtype=torch.float32,
            page_size=page_size,
            kv_cache_bytes=budget,
            max_num_seqs=num_prompts,
            max_num_batched_tokens=64,
            max_model_len=128,
            cuda_graphs=False,
        )
        prompts = demo_prompts(num_prompts, llm.config.vocab_size, seed)
        frames = _Frames(llm)
        outputs = llm.generate(
            prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), on_step=frames
        )
        expected = [hf_greedy(hf, p, max_tokens) for p in prompts]
    _report(name, llm, prompts, outputs, expected, frames, out)
    return all(o.output_ids == e for o, e in zip(outputs, expected))


def _unit(sub, count: int) -> str:
    word = "slot" if sub.spec.kind == "mamba" else "page"
    return word if count == 1 else word + "s"


class _Frames:
    """Step hook: a picture of the pool after every step (a few are printed)."""

    def __init__(self, llm) -> None:
        self.frames: list[str] = []

    def __call__(self, llm, batch, logits) -> None:
        usage = pool_usage(llm.pool, llm.alloc)
        live = ", ".join(
            f"{n} {u['pages']:3d} {_unit(llm.pool[n], u['pages'])}" for n, u in usage.items()
        )
        self.frames.append(f"{pool_picture(llm.pool, llm.alloc)}  {live}")

    def some(self, count: int = 10) -> list[str]:
        """``count`` frames evenly spaced over the run, the last included."""
        n = len(self.frames)
        picks = sorted({round(i * (n - 1) / max(count - 1, 1)) for i in range(count)})
        return [f"step {i + 1:3d} {self.frames[i]}" for i in picks]


def _capacity(pool) -> str:
    """What the pool holds at once: tokens if every token sits in every attention
    sub-pool, and request slots of a Mamba sub-pool (whose slot may be the sink)."""
    subs = pool.subpools.values()
    entry = sum(s.spec.entry_bytes for s in subs if s.spec.kind != "mamba")
    text = f"it holds {pool.total_bytes // entry} tokens at once if every token sits in every "
    text += "attention sub-pool"
    for s in subs:
        if s.spec.kind == "mamba":
            text += (
                f"; {s.name} holds {s.usable_pages} request slots of {s.page_bytes} bytes "
                f"({s.page_bytes // entry} tokens' worth) alone, and the sink is "
                f"{s.first_page} slot{'s' if s.first_page > 1 else ''}"
            )
    return text


def _report(name, llm, prompts, outputs, expected, frames, out) -> None:
    stats = llm.stats
    tokens = sum(len(p) for p in prompts) + sum(len(o.output_ids) for o in outputs)
    page_size = max(s.page_size for s in llm.pool.subpools.values())  # Mamba's is 1
    out(
        f"\n== {name}: {llm.config.architecture}, {llm.config.num_layers} layers, windows "
        f"{list(llm.config.windows)}, page_size {page_size}"
    )
    out(
        f"pool: {llm.pool.total_bytes} bytes, sub-pools {list(llm.pool.subpools)}; "
        f"{_capacity(llm.pool)}; the batch has {tokens} prompt + output tokens"
    )
    for i, (o, e) in enumerate(zip(outputs, expected)):
        mark = "match" if o.output_ids == e else "MISMATCH"
        out(
            f"  req {i}: prompt {len(o.prompt_ids):3d} tok -> {o.output_ids[:10]}... "
            f"[{mark} vs transformers, preempted {o.num_preemptions}x]"
        )
    out(
        f"steps {stats.steps} ({stats.decode_steps} decode), preemptions {stats.preemptions}, "
        f"peak pages {stats.peak_pages}"
    )
    out(f"the pool over time ({legend(llm.pool)}):")
    for frame in frames.some():
        out("  " + frame)
    ok = all(o.output_ids == e for o, e in zip(outputs, expected))
    out(
        f"greedy output {'IDENTICAL to' if ok else 'DIFFERS from'} transformers for all "
        f"{len(outputs)} requests"
        if ok
        else "greedy output DIFFERS from transformers"
    )
