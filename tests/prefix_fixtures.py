"""Shared pieces of the engine-level prefix-cache tests (full attention, sliding
window, recurrent hybrids): prompts that share whole and partial pages, an LLM
with the cache on or off, and the run every family repeats first: the same
prompts without the cache, then twice with it, each checked against transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from engine_fixtures import VOCAB, hf_greedy

from unikv.engine import LLM, SamplingParams


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
    return LLM(path, device="cpu", max_num_seqs=4, page_size=ps,
               enable_prefix_caching=caching, debug=True, **kw)  # fmt: skip


@dataclass
class CachedRuns:
    llm: LLM  # the LLM with the cache, after both runs
    prompts: list[list[int]]
    params: SamplingParams
    want: list[list[int]]  # transformers' greedy tokens
    plain: list  # RequestOutputs without the cache
    again: list  # RequestOutputs of the second run with the cache


def run_without_and_with_cache(path, hf, ps: int, new_tokens: int, seed: int) -> CachedRuns:
    """The prompts without the cache, then twice with it (the first run's later
    admissions may hit; in the second every prompt's whole pages are cached):
    every run's greedy tokens equal transformers'."""
    prompts = shared_prompts(ps, seed)
    params = SamplingParams(max_tokens=new_tokens)
    want = [hf_greedy(hf, p, new_tokens) for p in prompts]
    plain = prefix_llm(path, ps, False).generate(prompts, params)
    assert [o.output_ids for o in plain] == want
    llm = prefix_llm(path, ps, True)
    first = llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    assert [o.output_ids for o in first] == want
    assert [o.output_ids for o in again] == want
    return CachedRuns(llm, prompts, params, want, plain, again)
