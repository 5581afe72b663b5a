"""The shared decoder (``models/decoder.py``) under every family.

- every family's model class is a ``DecoderLM``, and ``class Backbone`` is defined
  once, in ``decoder.py``;
- ``forward(greedy=True)`` of each family returns the logits of a plain forward and
  their argmax, and resolves a placeholder id -(1 + lane) from the step's feedback
  buffer, into which it writes its tokens (the engine's decode graphs use both);
- the families whose math differs opt out of the fused pieces they say they do:
  Gemma (scaled embedding, final soft-cap), Falcon-H1 and Granite-4.0-H (multipliers)
  take the embedding unfused and their argmax after the head, Zamba2 (its shared
  blocks read the embeddings) the embedding unfused; Llama and Bamba take both fused.

Each family's tiny checkpoint and dense step object come from the model tests'
fixtures; the logits of the model itself are the reference here (each family's
logits against transformers' are its own test file's).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    DenseAttention,
    DenseMamba2Step,
    DenseStepFn,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_deepseek,
    save_tiny_falcon_h1,
    save_tiny_gemma,
    save_tiny_hybrid,
    save_tiny_model,
    save_tiny_nemotron_h,
)
from mamba_hybrid_fixtures import bamba_config, granite_config, save_hf, zamba2_config

from unikv.models import load_model
from unikv.models.decoder import Block, DecoderLM, chain
from unikv.models.family import FAMILIES
from unikv.models.layers import RMSNorm

pytestmark = pytest.mark.usefixtures("one_thread")


class _AbsorbedMLA:
    """DeepSeek's dense MLA step, absorbed form (test_models_deepseek's)."""

    def __new__(cls):
        from test_models_deepseek import AbsorbedStep

        return AbsorbedStep()


def _dense(model):
    return DenseAttention(model.config.windows, model.config.sm_scale)


def _hybrid(model):
    return DenseStepFn(model.config.windows, model.config.sm_scale)


def _mamba(model):
    return DenseMamba2Step(model.config.sm_scale)


# family case -> (save the tiny checkpoint into a path, a fresh step object for a model)
CASES = {
    "llama": (lambda p: save_tiny_model("llama", p), _dense),
    "gpt_oss": (lambda p: save_tiny_model("gpt_oss", p), _dense),
    "qwen3_5": (lambda p: save_tiny_hybrid("qwen3_5", p), _hybrid),
    "qwen3_next": (lambda p: save_tiny_hybrid("qwen3_next", p), _hybrid),
    "nemotron_h": (lambda p: save_tiny_nemotron_h(p, "ME*M-E"), _mamba),
    "falcon_h1": (lambda p: save_tiny_falcon_h1(p), _mamba),
    "gemma2": (lambda p: save_tiny_gemma("gemma2", p), _dense),
    "deepseek_v3": (lambda p: save_tiny_deepseek(3, p), lambda m: _AbsorbedMLA()),
    "bamba": (lambda p: save_hf(bamba_config(), p), _mamba),
    "granitemoehybrid": (lambda p: save_hf(granite_config(), p), _mamba),
    "zamba2": (lambda p: save_hf(zamba2_config(), p), _mamba),
}


class _WithFeedback:
    """A step object with the planner's feedback buffer beside it."""

    def __init__(self, step, feedback: torch.Tensor) -> None:
        self._step, self.feedback = step, feedback

    def __call__(self, *args, **kwargs):
        return self._step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._step, name)


def test_every_family_runs_on_the_decoder():
    for family in FAMILIES:
        if family.model is not None:
            assert issubclass(family.model_class(), DecoderLM), family.name
    models = pathlib.Path(__file__).parents[2] / "unikv" / "models"
    defined = [p.name for p in models.rglob("*.py") if "class Backbone" in p.read_text()]
    assert defined == ["decoder.py"]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_forward_reads_and_writes_the_feedback_buffer(case, tmp_path):
    save, make_step = CASES[case]
    save(str(tmp_path))
    model = load_model(str(tmp_path))
    tokens = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(tokens.numel())
    rows = torch.tensor([4, 8])
    with torch.no_grad():
        want = model(tokens, positions, make_step(model), rows)
        ids = tokens.clone()
        ids[8] = -2  # lane 1's token, from the buffer
        feedback = torch.tensor([0, int(tokens[8]), 0])
        step = _WithFeedback(make_step(model), feedback)
        logits, greedy = model(ids, positions, step, rows, greedy=True)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(feedback[:2], greedy)  # the step's tokens, where it reads them


def test_fused_pieces_are_decided_once_per_family(tmp_path):
    """Llama: embedding inside its first GEMM, argmax inside its head; Gemma and
    Falcon-H1 opt out of both (scaled embeddings, finished logits); Qwen3.5 takes
    every pre-norm inside a GEMM (the Gated DeltaNet's one input GEMM, the gated
    attention's q|k|v, the MLP's gate|up), so its embedding too."""
    built = {}
    for case in ("llama", "gemma2", "falcon_h1", "qwen3_5"):
        CASES[case][0](str(tmp_path / case))
        built[case] = load_model(str(tmp_path / case))
    assert built["llama"].embeds_in_gemm and not built["llama"].finishes_logits
    for case in ("gemma2", "falcon_h1"):
        model = built[case]
        assert model.scales_embedding and model.finishes_logits and not model.embeds_in_gemm
    qwen = built["qwen3_5"]
    assert qwen.embeds_in_gemm and not qwen.finishes_logits
    kinds = {type(layer.blocks[0].body).__name__ for layer in qwen.model.layers}
    assert kinds == {"GatedDeltaNet", "GatedAttention"}
    assert all(b.linear is not None for layer in qwen.model.layers for b in layer.blocks)


def test_mamba_hybrids_fuse_what_their_math_allows(tmp_path):
    """Bamba takes every fused piece (its first layer's in_proj takes the embedding);
    Granite-4.0-H scales its embedding and logits (unfused both ends) but keeps each
    pre-norm inside its block's GEMM; Zamba2 keeps its embeddings for the shared
    blocks (unfused) and its argmax inside the head."""
    built = {}
    for case in ("bamba", "granitemoehybrid", "zamba2"):
        CASES[case][0](str(tmp_path / case))
        built[case] = load_model(str(tmp_path / case))
    bamba, granite, zamba2 = built.values()
    assert bamba.embeds_in_gemm and not bamba.finishes_logits
    assert all(b.linear is not None for layer in bamba.model.layers for b in layer.blocks)
    assert granite.finishes_logits and not granite.embeds_in_gemm
    assert all(layer.blocks[0].linear is not None for layer in granite.model.layers)
    assert not zamba2.embeds_in_gemm and not zamba2.finishes_logits


@pytest.mark.parametrize("case", ["qwen3_5", "nemotron_h", "gemma2"])
def test_triton_ops_on_the_decoder_match_the_torch_ops(case, tmp_path):
    """A family's model built with the Triton backend's ops (CPU interpreter): the
    residual adds fused into zero-centred norms (Qwen3.5, Gemma; offset 1, fp32
    weight), the pre-norms inside GEMMs, Gemma's post-norms, the rope, gives the
    logits of the same checkpoint on the torch references (which match transformers:
    each family's model tests), with the same dense step object."""
    save, make_step = CASES[case]
    save(str(tmp_path))
    tokens = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(6))
    logits = {}
    for name in ("torch", "triton"):
        model = load_model(str(tmp_path), kernels=name)
        assert model.ops.name == name and model.stack.layers[0].blocks[0].norm.ops.name == name
        with torch.no_grad():
            logits[name] = model(tokens, torch.arange(tokens.numel()), make_step(model))
    assert (logits["triton"] - logits["torch"]).abs().max() < 1e-4


def test_chain_moves_only_post_norms_the_next_pre_norm_takes():
    """``chain`` links a block's post-norm into the next block's pre-norm where that
    norm's kind, eps and width match (Gemma's), not a post of another kind (Granite's
    scale), another eps, or a block used twice (Zamba2's shared block); the blocks
    run as the same blocks unlinked (the torch backend: each post, then the add and
    the pre-norm)."""

    def norm(eps=1e-6, width=8):
        out = RMSNorm(width, eps, weight_in_fp32=True, offset=1.0)
        out.weight.data.normal_(generator=torch.Generator().manual_seed(int(eps * 1e7) + width))
        return out

    def block(pre, post):
        return Block(pre, torch.nn.Linear(8, 8), mixes=False, post=post)

    torch.manual_seed(0)
    shared = block(norm(), norm())
    blocks = [block(norm(), norm()), block(norm(), norm()), block(norm(), lambda x: 2 * x),
              block(norm(), norm()), block(norm(eps=1e-5), norm()), shared, block(norm(), None),
              shared]  # fmt: skip
    h0 = torch.randn(3, 8)

    def run():
        h, residual = h0, None
        with torch.no_grad():
            for b in blocks:
                h, residual = b(h, residual, None, None)
        return h, residual

    want = run()
    chain(blocks)
    assert [b.defers for b in blocks] == [True, True, False, False, False, False, False, False]
    assert [b.before for b in blocks] == [None, blocks[0].post, blocks[1].post] + [None] * 5
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
