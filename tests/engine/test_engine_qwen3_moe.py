"""Qwen3-MoE through ``unikv.engine.LLM`` (fp32 CPU, torch reference kernels and the
torch reference of the fused MoE) against transformers' eager ``Qwen3MoeForCausalLM``
on the same weights. The tiny random config has 7 experts, top-2, renormalised
weights, hidden 48, q/k norm with head dim 16, experts' intermediate 24 and three
layers: layer 1 is in ``mlp_only_layers`` (a dense SwiGLU of intermediate 40), so
both MLP kinds run.

- greedy tokens identical to transformers' ``generate`` for 24 new tokens over a
  batch of prompts of 5, 13, 30 and 47 tokens, at page sizes 1 and 16, and every
  sampled logit row within 1e-4 of transformers' teacher-forced logits;
- ``norm_topk_prob`` off and ``decoder_sparse_step`` 2 (layers 1 sparse, 0 and 2
  dense): the same, at page size 16;
- a model-level forward on the sparse MoE loop (the bound lowered) gives
  transformers' logits.
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


def save_tiny_qwen3_moe(path: str, seed: int = 0, **overrides):
    """A tiny random ``Qwen3MoeForCausalLM`` (fp32, eager attention) saved to ``path``."""
    kw = dict(TINY)
    kw.update(
        hidden_size=48,
        intermediate_size=40,
        moe_intermediate_size=24,
        head_dim=16,
        num_hidden_layers=3,
        num_experts=7,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        attn_implementation="eager",
    )
    kw.update(overrides)
    return save_random_model(tf.Qwen3MoeConfig(**kw), path, seed)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    return GreedyReference(save_tiny_qwen3_moe(path), path, PROMPT_LENS, NEW_TOKENS)


def _generate_and_check(ref: GreedyReference, page_size: int) -> None:
    llm = LLM(ref.path, device="cpu", max_num_seqs=8, max_model_len=96, page_size=page_size)
    assert sorted(llm.pool.subpools) == ["full"]
    check_greedy_run(ref, llm)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_transformers(ref, page_size):
    _generate_and_check(ref, page_size)


def test_unnormalised_every_second_layer(tmp_path):
    hf = save_tiny_qwen3_moe(
        str(tmp_path), seed=1, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[]
    )
    _generate_and_check(GreedyReference(hf, str(tmp_path), PROMPT_LENS, NEW_TOKENS), 16)


def test_sparse_loop_matches_transformers(ref, monkeypatch):
    monkeypatch.setattr(moe_ref, "DENSE_MAX_TOKENS", 16)
    assert model_forward_error(ref) < 1e-4
