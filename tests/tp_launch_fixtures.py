"""Shared pieces of the launcher's tests (``tests/test_tp_launch*.py``): a tiny
Llama checkpoint (GQA 4/2 heads) with transformers' greedy tokens and a TP-1
``LLM``'s greedy and seeded-sampling outputs for a mixed-length batch, the
engine options (chunked prefill: 16 tokens a step, pages of 4), and a 60 s
timeout for the launched ranks' collectives and start-up."""

from __future__ import annotations

import dataclasses
import os

import torch
from engine_fixtures import VOCAB, hf_greedy, save_tiny_model

from unikv import env
from unikv.engine import LLM, SamplingParams

PROMPT_LENS = [3, 19, 33]
NEW_TOKENS = 8
OPTIONS = {
    "dtype": torch.float32,
    "page_size": 4,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "max_model_len": 64,
}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=20, seed=7, n=2)


def bound_the_ranks(monkeypatch) -> None:
    """Collectives and start-up time out after 60 s (a broken test never hangs CI);
    one intra-op thread (the workers take rank 0's count)."""
    monkeypatch.setattr(env, "FLAGS", dataclasses.replace(env.FLAGS, tp_timeout_s=60.0))
    monkeypatch.setenv("UNIKV_TP_TIMEOUT_S", "60")  # (subprocesses read it at import)
    torch.set_num_threads(1)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def ids(outputs) -> list[list[list[int]]]:
    """Every completion's token ids, per prompt."""
    return [[c.token_ids for c in o.outputs] for o in outputs]


def gone(pid: int) -> bool:
    """No process ``pid`` (exited and reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def build_llama(root) -> tuple:
    """Save the tiny Llama under ``root``: (path, transformers' greedy tokens, TP 1's
    greedy and sampled outputs)."""
    torch.set_num_threads(1)
    path = str(root)
    hf = save_tiny_model("llama", path)
    tp1 = LLM(path, device="cpu", **OPTIONS)
    greedy, sampled = ids(tp1.generate(prompts(), GREEDY)), ids(tp1.generate(prompts(), SAMPLED))
    return path, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()], greedy, sampled
