"""Mixtral through ``unikv.engine.LLM`` (fp32 CPU, torch reference kernels and the
torch reference of the fused MoE) against transformers' eager ``MixtralForCausalLM``
on the same weights (a tiny random config: 5 experts, top-2, hidden 48, experts'
intermediate 40, window 9 on every layer so the pool is one "swa" sub-pool).

- greedy tokens identical to transformers' ``generate`` for 24 new tokens over a
  batch of prompts of 5, 13, 30 and 47 tokens, at page sizes 1 and 16, and every
  sampled logit row within 1e-4 of transformers' teacher-forced logits;
- a model-level forward (no pool) of 40 tokens on the reference's sparse loop
  (``DENSE_MAX_TOKENS`` lowered to 16) gives transformers' logits within 1e-4.
"""

from __future__ import annotations

import pytest
import transformers as tf
from engine_fixtures import (
    TINY,
    GreedyReference,
    check_greedy_run,
    model_forward_error,
    one_thread,  # noqa: F401  (a fixture)
    save_random_model,
)

from unikv.engine import LLM
from unikv.kernels.moe import ref as moe_ref

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = [5, 13, 30, 47]
NEW_TOKENS = 24


def save_tiny_mixtral(path: str, seed: int = 0, **overrides):
    """A tiny random ``MixtralForCausalLM`` (fp32, eager attention) saved to ``path``."""
    kw = dict(TINY)
    kw.update(
        hidden_size=48,
        intermediate_size=40,
        num_local_experts=5,
        num_experts_per_tok=2,
        sliding_window=9,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return save_random_model(tf.MixtralConfig(**kw), path, seed)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp("mixtral"))
    return GreedyReference(save_tiny_mixtral(path), path, PROMPT_LENS, NEW_TOKENS)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_transformers(ref, page_size):
    llm = LLM(ref.path, device="cpu", max_num_seqs=8, max_model_len=96, page_size=page_size)
    assert sorted(llm.pool.subpools) == ["swa"]
    check_greedy_run(ref, llm)


def test_sparse_loop_matches_transformers(ref, monkeypatch):
    monkeypatch.setattr(moe_ref, "DENSE_MAX_TOKENS", 16)
    assert model_forward_error(ref) < 1e-4
