"""Qwen3.5 (text) and Qwen3-Next on unikv's layers against transformers' own
models (no pool).

Tiny random-init transformers models (``engine_fixtures.tiny_hybrid_config``:
head dim 24 with partial rotary 0.25 / 0.5, linear key/value head dims 12/20,
Hv = 2 Hk, conv kernel 4, layers [linear, linear, full, linear, full]; Qwen3-Next
with 4 experts, top 2, a shared expert and one dense layer) are saved with
``save_pretrained`` and loaded by unikv. The step object is
``engine_fixtures.DenseStepFn``: dense attention, causal conv and gated delta
rule per token, written from their definitions (not unikv's kernels).

Tolerance: fp32, max abs error 1e-4 on logits of std ~0.8. transformers runs
its chunked delta rule on a prompt and its recurrent one on decode; the two
differ from each other by ~3e-5 here, and unikv (token by token) from either
by up to ~3e-5.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    DenseStepFn,
    hf_logits,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_hybrid,
    tiny_hybrid_config,
)

from unikv.kernels.moe import ref as moe_ref
from unikv.models import load_model, model_config_from_hf
from unikv.models.qwen3_5 import Qwen3_5ForCausalLM
from unikv.models.rope import rope_inv_freq

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["qwen3_5", "qwen3_next"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def saved(request, tmp_path_factory):
    """(arch, transformers model, unikv model) on the same weights."""
    path = str(tmp_path_factory.mktemp(request.param))
    hf = save_tiny_hybrid(request.param, path)
    return request.param, hf, load_model(path)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _step_fn(model) -> DenseStepFn:
    return DenseStepFn(model.config.windows, model.config.sm_scale)


def _forward(model, step, tokens: list[int], start: int) -> torch.Tensor:
    positions = torch.arange(start, start + len(tokens))
    return model(torch.tensor(tokens), positions, step)


def test_logits_match_transformers(saved):
    _, hf, model = saved
    tokens = _tokens(40, 1)
    err = (_forward(model, _step_fn(model), tokens, 0) - hf_logits(hf, tokens)).abs().max()
    assert err < ATOL


def test_tied_embeddings_load_and_match(tmp_path):
    """Small Qwen3.5 checkpoints tie lm_head to the embeddings (no lm_head tensor)."""
    hf = save_tiny_hybrid("qwen3_5", str(tmp_path), seed=1, tie_word_embeddings=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert "lm_head.weight" not in names
    model = load_model(str(tmp_path))
    tokens = _tokens(20, 5)
    err = (_forward(model, _step_fn(model), tokens, 0) - hf_logits(hf, tokens)).abs().max()
    assert err < ATOL


def test_qwen3_next_sparse_expert_loop_matches(tmp_path, monkeypatch):
    """The prefill (sparse) expert loop gives transformers' logits too."""
    hf = save_tiny_hybrid("qwen3_next", str(tmp_path), seed=2)
    model = load_model(str(tmp_path))
    monkeypatch.setattr(moe_ref, "DENSE_MAX_TOKENS", 0)  # the rule dense_rows reads
    tokens = _tokens(24, 2)
    err = (_forward(model, _step_fn(model), tokens, 0) - hf_logits(hf, tokens)).abs().max()
    assert err < ATOL


def test_stepwise_forward_carries_state(saved):
    """A sequence fed in chunks (7, 13 tokens) then one token at a time: every
    step's logits equal transformers' whole-sequence logits at those positions,
    so the conv window and the delta-rule state carry over between steps."""
    _, hf, model = saved
    tokens = _tokens(30, 3)
    ref = hf_logits(hf, tokens)
    step = _step_fn(model)
    cuts = [0, 7, 20, *range(21, 31)]
    for a, b in itertools.pairwise(cuts):
        err = (_forward(model, step, tokens[a:b], a) - ref[a:b]).abs().max()
        assert err < ATOL, f"tokens [{a}, {b}): logits differ by {err}"


@pytest.mark.parametrize("length", [2, 30])
def test_states_match_transformers_cache(saved, length):
    """After a prompt (shorter or longer than the conv kernel), the conv window
    (C, K) and the delta-rule state (Hv, Dk, Dv) that unikv's model left in the
    step object equal those in transformers' own cache after the same prompt."""
    _, hf, model = saved
    tokens = _tokens(length, 4)
    step = _step_fn(model)
    _forward(model, step, tokens, 0)
    with torch.no_grad():
        cache = hf(torch.tensor([tokens]), use_cache=True).past_key_values
    linear = [i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention"]
    assert sorted(step.conv) == sorted(step.ssm) == linear
    for i in linear:
        conv, ssm = cache.layers[i].conv_states[0][0], cache.layers[i].recurrent_states[0][0]
        assert conv.shape == step.conv[i].shape and conv.dtype == torch.float32
        assert ssm.shape == step.ssm[i].shape and ssm.dtype == torch.float32
        assert torch.allclose(step.conv[i], conv, atol=ATOL, rtol=0), f"layer {i} conv"
        assert torch.allclose(step.ssm[i], ssm, atol=ATOL, rtol=0), f"layer {i} recurrent"


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5},
        {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "partial_rotary_factor": 0.5,
        },
    ],
)
def test_partial_rotary_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

    config = tiny_hybrid_config("qwen3_next", rope_parameters=rope)
    if rope["rope_type"] == "default":
        ref, ref_scale = Qwen3NextRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    ours, scale = rope_inv_freq(config.rope_parameters, 24, config.max_position_embeddings)
    assert ours.shape == ref.shape and torch.allclose(ours, ref, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_odd_rotary_dim_raises():
    config = tiny_hybrid_config("qwen3_5")
    config.rope_parameters["partial_rotary_factor"] = 0.3  # int(24 * 0.3) = 7 dims
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_inv_freq(config.rope_parameters, 24, 64)


def test_tensor_parallel_size_the_heads_do_not_split_is_refused():
    """Qwen3.5 shards (``tests/models/test_tp_recurrent.py``); a size its 4 value heads do not
    split is refused at construction, naming the field."""
    config = model_config_from_hf(
        tiny_hybrid_config("qwen3_5", architectures=["Qwen3_5ForCausalLM"])
    )
    with pytest.raises(ValueError, match="tensor parallelism of 3.*linear_num_value_heads"):
        Qwen3_5ForCausalLM(config, 64, tp=types.SimpleNamespace(size=3, rank=0))


def test_value_heads_not_a_multiple_of_key_heads_raise():
    config = tiny_hybrid_config("qwen3_5", architectures=["Qwen3_5ForCausalLM"])
    config.linear_num_value_heads = 3
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        model_config_from_hf(config)
