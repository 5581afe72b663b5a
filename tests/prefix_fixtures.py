"""Shared pieces of the engine-level prefix-cache, host-tier and swap tests (full
attention, sliding window, recurrent hybrids): the tiny models, prompts that share
whole and partial pages, tight-pool prompts and budgets, an LLM with the cache on
or off, and the run every family repeats first: the same prompts without the
cache, then twice with it, each checked against transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from engine_fixtures import VOCAB, hf_greedy, save_tiny_hybrid, save_tiny_model

from unikv.engine import LLM, SamplingParams
from unikv.pool import SubPoolConfig, pool_bytes_for


def save_tiny_models(tmp_path_factory) -> dict[str, tuple[str, object]]:
    """arch -> (checkpoint path, transformers model): tiny llama, gpt-oss (full and
    sliding window) and Qwen3.5 (Gated DeltaNet + full attention); the body of
    the host-tier and swap tests' module-scoped ``models`` fixtures."""
    out = {}
    for arch in ("llama", "gpt_oss"):
        path = str(tmp_path_factory.mktemp(arch))
        out[arch] = (path, save_tiny_model(arch, path))
    path = str(tmp_path_factory.mktemp("qwen3_5"))
    out["qwen3_5"] = (path, save_tiny_hybrid("qwen3_5", path))
    return out


def tight_pool_prompts(seed: int) -> list[list[int]]:
    """Four prompts over a 17-token system prompt (2, 9, 4 and 13 more tokens) and
    two unrelated 20-token prompts: hits, evictions and preemptions in a tight pool."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, VOCAB, (17,), generator=g).tolist()
    prompts = [system + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (2, 9, 4, 13)]
    return prompts + [torch.randint(0, VOCAB, (20,), generator=g).tolist() for _ in range(2)]


def pool_budget(configs: list[SubPoolConfig], pages: int, state_slots: int = 5) -> int:
    """Pool bytes for ``pages`` pages of every token sub-pool and ``state_slots``
    slots of a Mamba sub-pool."""
    return pool_bytes_for(
        configs, {c.name: pages if c.spec.kind != "mamba" else state_slots for c in configs}
    )


def distinct_prompts(ps: int, seed: int, count: int = 4) -> list[list[int]]:
    """``count`` prompts of 2.5 to 3.5 pages that share nothing, and a repeat of the first."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3 * ps + 2, 2 * ps + 3)
    ]
    prompts += [
        torch.randint(0, VOCAB, (3 * ps + ps // 2,), generator=g).tolist() for _ in range(count - 2)
    ]
    return prompts + [prompts[0]]


def host_tier_bytes(configs: list[SubPoolConfig], ps: int, pages: int, slots: int = 0) -> int:
    """Prefix host-tier bytes for ``pages`` whole nodes (one page of every token
    sub-pool each) and ``slots`` state checkpoints (with a Mamba sub-pool)."""
    token = sum(c.spec.page_bytes(ps) for c in configs if c.spec.kind != "mamba")
    state = [c.spec.page_bytes(1) for c in configs if c.spec.kind == "mamba"]
    return pages * token + (slots * state[0] if state else 0)


def chat_turns(llm, ps: int, check, turns: int = 3, seed: int = 11) -> list[int]:
    """``turns`` chat turns on ``llm`` (each prompt = the previous prompt + answer + a
    ``ps + 2``-token message, ``2 ps + 3`` new tokens): ``check(prompt, outputs)``
    judges each turn's tokens, and every later turn must hit the whole pages of the
    previous prompt and answer. Returns the last prompt + answer."""
    g = torch.Generator().manual_seed(seed)
    history, params = [], SamplingParams(max_tokens=2 * ps + 3, temperature=0.0)
    for turn in range(turns):
        prompt = history + torch.randint(0, VOCAB, (ps + 2,), generator=g).tolist()
        outputs = llm.generate([prompt], params)
        check(prompt, outputs)
        assert outputs[0].num_cached_tokens == ((len(history) - 1) // ps * ps if turn else 0)
        history = prompt + outputs[0].output_ids
    return history


def shared_prompts(ps: int, seed: int) -> list[list[int]]:
    """Five prompts over a 3.5-page system prompt: two extensions, the system
    prompt alone, one sharing only half of page 2, and a repeat of the first."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, VOCAB, (3 * ps + 2,), generator=g).tolist()
    part = system[: 2 * ps + ps // 2] + [7, 8, 9]  # shares half of page 2 only
    return [system + [1, 2], system + [5], system, part, system + [1, 2]]


def prefix_llm(path: str, ps: int, caching: bool, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_model_len", 96)
    kw.setdefault("debug", True)
    kw.setdefault("dtype", torch.float32)  # CUDA's default is bf16; the oracle is fp32
    device = kw.pop("device", "cpu")
    if device == "cuda" and "kv_cache_bytes" not in kw:  # CUDA's default: 90 % of free memory
        from gpu_fixtures import roomy_bytes  # (the CPU's pool: 4 worst-case requests)

        kw["kv_cache_bytes"] = roomy_bytes(
            path, page_size=ps, dtype=kw["dtype"], max_num_seqs=4,
            max_model_len=kw["max_model_len"], chunk=kw["max_num_batched_tokens"],
        )  # fmt: skip
    return LLM(path, device=device, max_num_seqs=4, page_size=ps,
               enable_prefix_caching=caching, **kw)  # fmt: skip


@dataclass
class CachedRuns:
    llm: LLM  # the LLM with the cache, after both runs
    prompts: list[list[int]]
    params: SamplingParams
    want: list[list[int]]  # transformers' greedy tokens
    plain: list  # RequestOutputs without the cache
    again: list  # RequestOutputs of the second run with the cache
    whole_pages: list[int]  # each prompt's tokens in whole pages (its last token aside)


def run_without_and_with_cache(path, hf, ps: int, new_tokens: int, seed: int) -> CachedRuns:
    """The prompts without the cache, then twice with it (the first run's later
    admissions may hit; in the second every prompt's whole pages are cached):
    every run's greedy tokens equal transformers', and the second run's hits
    cover each prompt's whole pages."""
    prompts = shared_prompts(ps, seed)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    want = [hf_greedy(hf, p, new_tokens) for p in prompts]
    plain = prefix_llm(path, ps, False).generate(prompts, params)
    assert [o.output_ids for o in plain] == want
    llm = prefix_llm(path, ps, True)
    first = llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    assert [o.output_ids for o in first] == want
    assert [o.output_ids for o in again] == want
    whole_pages = [(len(p) - 1) // ps * ps for p in prompts]
    assert [o.num_cached_tokens for o in again] == whole_pages
    return CachedRuns(llm, prompts, params, want, plain, again, whole_pages)


def partial_hit(path: str, ps: int, run: CachedRuns):
    """A fresh cached LLM that served prompt 0, then prompt 3 (it shares half of
    page 2 only): (that LLM, prompt 3's RequestOutput)."""
    fresh = prefix_llm(path, ps, True)
    fresh.generate(run.prompts[:1], run.params)
    (part,) = fresh.generate(run.prompts[3:4], run.params)
    return fresh, part


def tight_prompts(seed: int = 5) -> list[list[int]]:
    """Six prompts of 19-30 tokens: the swap tests' preempting load."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (19, 26, 21, 30, 20, 20)]


def tight_llm(path: str, ps: int, pages: int, preemption: str, caching=False, **kw) -> LLM:
    """An fp32 LLM of ``pages`` token pages (5 state slots) that preempts by
    ``preemption``, a 4 MB swap tier unless recomputing; CPU unless ``device``."""
    from unikv.hf_config import specs_from_hf_config

    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    budget = pool_budget(configs, pages)
    kw.setdefault("swap_host_bytes", 0 if preemption == "recompute" else 1 << 22)
    return LLM(
        path, device=kw.pop("device", "cpu"), max_num_seqs=4, page_size=ps, kv_cache_bytes=budget,
        max_model_len=48, max_num_batched_tokens=kw.pop("chunk", 16),
        enable_prefix_caching=caching, preemption=preemption,
        **{"debug": True, "dtype": torch.float32, **kw},
    )  # fmt: skip
