"""Gemma-2 and Gemma-3 (text) on unikv's layers against transformers' own models
(no pool).

Tiny random-init transformers models (``engine_fixtures.tiny_gemma_config``:
head_dim 24, window 7, query_pre_attn_scalar 16, Gemma-2 attention cap 5 and
final cap 3, Gemma-3's 5:1 pattern over 7 layers with per-type rope, norm
weights away from zero) are saved and loaded by ``unikv.models.load_model``; a
whole-sequence forward through unikv's layers, with a contiguous attention
written here from the definition (scale, soft-cap, window), must give
transformers' EAGER logits (max abs error 1e-4; logits std ~0.8).

Each feature is shown to matter on these configs: switching it off in unikv
(the soft caps, the softmax scale, the windows, the per-type rope, the
``(1 + w)`` norms, the embedding scale) moves the logits far from transformers'.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    hf_logits,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_gemma,
)

from unikv import env
from unikv.models import load_model, load_model_config

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["gemma2", "gemma3"]
ATOL = 1e-4
FAR = 1e-2  # a switched-off feature moves the logits by more than this


class CappedAttention:
    """An ``AttentionFn`` for one whole sequence: causal (windowed) attention with
    softmax scale ``scale`` and logit soft-cap ``cap`` (0 = off), as transformers'
    eager attention computes it. q: (T, Hq, D), k/v: (T, H, D) -> (T, Hq, D)."""

    def __init__(self, windows, scale: float, cap: float) -> None:
        self.windows, self.scale, self.cap = windows, scale, cap

    def __call__(self, layer, q, k, v, sinks=None):
        assert sinks is None
        t, hq, _ = q.shape
        group = hq // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        logits = torch.einsum("thd,shd->hts", q, k) * self.scale
        if self.cap > 0:
            logits = torch.tanh(logits / self.cap) * self.cap
        pos = torch.arange(t)
        mask = pos[None, :] <= pos[:, None]
        if self.windows[layer] is not None:
            mask &= pos[None, :] > pos[:, None] - self.windows[layer]
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("hts,shd->thd", probs, v)


def _logits(model, tokens, **change):
    extra = model.config.extra
    windows = change.get("windows", model.config.windows)
    scale = change.get("scale", extra["sm_scale"])
    attn = CappedAttention(windows, scale, change.get("cap", extra["attn_soft_cap"]))
    return model(torch.tensor(tokens), torch.arange(len(tokens)), attn)


def _tokens(n: int = 40, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory) -> dict:
    """arch -> (path, transformers model), saved once per module."""
    out = {}
    for arch in ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        out[arch] = (path, save_tiny_gemma(arch, path))
    return out


@pytest.fixture(params=ARCHS)
def saved(request, saved_models):
    return (request.param, *saved_models[request.param])


def test_logits_match_transformers(saved):
    arch, path, hf = saved
    model = load_model(path)
    assert model.config.family == "gemma"
    types = hf.config.layer_types
    assert model.config.windows == tuple(7 if t == "sliding_attention" else None for t in types)
    if arch == "gemma3":
        assert types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    tokens = _tokens()
    err = (_logits(model, tokens) - hf_logits(hf, tokens)).abs().max().item()
    assert err < ATOL, err


def _no_window(model):
    return {"windows": (None,) * model.config.num_layers}


def _swap_rope(model):
    """Sliding layers get the full layers' rope table and back."""
    rotary = model.model.rotary
    for layer in model.model.layers:
        attn = layer.self_attn
        other = (
            "full_attention"
            if attn.rotary[0] is rotary["sliding_attention"]
            else "sliding_attention"
        )
        attn.rotary = [rotary[other]]


def _plain_norms(model):
    """``w * x_hat`` instead of ``(1 + w) * x_hat``: subtract 1 from every norm weight."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.sub_(1.0)


ABLATIONS = {
    "attn_soft_cap": (["gemma2"], lambda m: {"cap": 0.0}),
    "final_soft_cap": (ARCHS, lambda m: setattr(m, "final_soft_cap", 0.0)),
    "sm_scale": (ARCHS, lambda m: {"scale": m.config.head_dim**-0.5}),
    "windows": (ARCHS, _no_window),
    "rope_by_type": (["gemma3"], _swap_rope),
    "one_plus_w_norms": (ARCHS, _plain_norms),
    "embed_scale": (ARCHS, lambda m: setattr(m, "embed_scale", torch.tensor(1.0))),
}


@pytest.mark.parametrize(
    "arch, feature", [(a, f) for f, (archs, _) in sorted(ABLATIONS.items()) for a in archs]
)
def test_each_feature_matters(saved_models, arch, feature):
    """Without ``feature`` unikv's logits are far from transformers': the tiny
    configs exercise it, so the exact match above checks it."""
    path, hf = saved_models[arch]
    model = load_model(path)
    change = ABLATIONS[feature][1](model) or {}
    tokens = _tokens()
    err = (_logits(model, tokens, **change) - hf_logits(hf, tokens)).abs().max().item()
    assert err > FAR, f"{feature}: logits moved by only {err}"


def test_gemma3_legacy_rope_fields_load_per_layer_type(tmp_path):
    """A Hub-style Gemma-3 config.json (``rope_theta``, ``rope_local_base_freq``,
    ``rope_scaling``, no ``rope_parameters``) loads to the same per-type rope."""
    hf = save_tiny_gemma("gemma3", str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=10000.0, rope_local_base_freq=100.0)
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ropes = load_model_config(str(tmp_path))[0].extra["rope_by_type"]
    assert ropes["sliding_attention"]["rope_theta"] == 100.0
    assert ropes["full_attention"]["rope_type"] == "linear"
    tokens = _tokens(24, seed=3)
    assert (_logits(load_model(str(tmp_path)), tokens) - hf_logits(hf, tokens)).abs().max() < ATOL


def test_gemma3_ignores_attn_softcapping_like_transformers(tmp_path):
    """transformers 5.17's Gemma-3 never passes ``attn_logit_softcapping`` to its
    attention; unikv follows (no cap), so the logits still match."""
    hf = save_tiny_gemma("gemma3", str(tmp_path), attn_logit_softcapping=1.0)
    model = load_model(str(tmp_path))
    assert model.config.extra["attn_soft_cap"] == 0.0
    tokens = _tokens(24, seed=4)
    assert (_logits(model, tokens) - hf_logits(hf, tokens)).abs().max() < ATOL


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("use_bidirectional_attention", True, "bidirectional"),
        ("hidden_activation", "gelu", "hidden_activation"),
        ("final_logit_softcapping", -1.0, "final_logit_softcapping"),
    ],
)
def test_bad_config_raises(tmp_path, field, value, match):
    save_tiny_gemma("gemma2", str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_model_config(str(tmp_path))


def test_post_norms_run_in_the_next_pre_norm(saved_models, monkeypatch):
    """Each block's post-norm runs inside the next block's pre-norm (``decoder.chain``:
    one ``sandwich_rms_norm``), across layers too; the last block keeps its own.
    ``UNIKV_SANDWICH_NORM=0`` links none, and still gives transformers' logits."""
    path, hf = saved_models["gemma3"]
    model = load_model(path)
    blocks = [b for layer in model.model.layers for b in layer.blocks]
    assert [b.defers for b in blocks] == [True] * (len(blocks) - 1) + [False]
    assert [b.before for b in blocks] == [None] + [b.post for b in blocks[:-1]]
    monkeypatch.setattr(env, "FLAGS", dataclasses.replace(env.FLAGS, sandwich_norm=False))
    model = load_model(path)
    blocks = [b for layer in model.model.layers for b in layer.blocks]
    assert not any(b.defers or b.before is not None for b in blocks)
    tokens = _tokens()
    with torch.no_grad():
        assert (_logits(model, tokens) - hf_logits(hf, tokens)).abs().max().item() < ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_hidden_states_are_transformers(saved_models, arch):
    """The residual stream entering each layer (an EAGLE-3 head's input), exported
    while every layer's post-MLP norm runs in the next layer's first block: equal to
    transformers' ``hidden_states[i]``."""
    path, hf = saved_models[arch]
    model = load_model(path)
    n = model.config.num_layers
    layers = tuple(range(1, n))
    tokens = _tokens(12, seed=3)
    out = model.export_hidden(len(tokens), layers)
    with torch.no_grad():
        _logits(model, tokens)
        want = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    h = model.config.hidden_size
    for j, i in enumerate(layers):
        got = out[:, j * h : (j + 1) * h]
        torch.testing.assert_close(got, want[i][0], rtol=0, atol=1e-4, msg=f"layer {i}")
