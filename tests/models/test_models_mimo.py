"""MiMo-V2-Flash on unikv's layers against transformers' own model (no pool), and
its config handling.

The tiny model (``test_engine_mimo.tiny_mimo_config``) is saved and loaded by
``unikv.models.load_model``; a whole-sequence forward through unikv's layers, with
a contiguous attention written from the definition (``engine_fixtures.
dense_attention``: window, sinks, scale), must give transformers' eager logits
(max abs error 1e-4). Each feature is shown to matter on this config: switching
it off in unikv (the value scale, the sinks, the windows, the per-type rope, the
partial rope, the router's correction bias) moves the logits far from transformers'.

Config errors are ValueErrors that name the field: a sliding-layer KV head count
other than transformers' rule, an unsupported activation, malformed layer types,
tensor parallelism.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_fixtures import VOCAB, DenseAttention, hf_logits, one_thread  # noqa: F401
from test_engine_mimo import SWA_LAYERS, save_tiny_mimo

from unikv.models import load_model, load_model_config
from unikv.models.rope import Rotary

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
FAR = 1e-2  # a switched-off feature moves the logits by more than this


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mimo_model"))
    hf = save_tiny_mimo(path)
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    return path, hf, tokens, hf_logits(hf, tokens)


def _logits(model, tokens, windows=None) -> torch.Tensor:
    attn = DenseAttention(windows or model.config.windows, model.config.sm_scale)
    ids = torch.tensor(tokens)
    with torch.no_grad():
        return model(ids, torch.arange(len(tokens)), attn)


def test_logits_match_transformers(saved):
    path, _, tokens, expected = saved
    model = load_model(path)
    assert model.config.windows == tuple(7 if i in SWA_LAYERS else None for i in range(7))
    assert model.config.sm_scale == 36**-0.5
    err = (_logits(model, tokens) - expected).abs().max().item()
    assert err < ATOL, f"logits differ by {err}"


def _no_value_scale(model):
    for layer in model.model.layers:
        layer.self_attn.v_scale = 1.0


def _no_sinks(model):
    for layer in model.model.layers:
        layer.self_attn.attention_sink_bias = None


def _one_rope(model):
    full = model.model.rotary["full_attention"]
    for layer in model.model.layers:
        layer.self_attn.rotary = [full]


def _whole_rope(model):
    params = dict(model.config.extra["rope_by_type"]["sliding_attention"])
    params["partial_rotary_factor"] = 1.0
    whole = Rotary(params, model.config.head_dim, 64)
    for i in SWA_LAYERS:
        model.model.layers[i].self_attn.rotary = [whole]


def _no_router_bias(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.zero_()


@pytest.mark.parametrize(
    "switch_off",
    [_no_value_scale, _no_sinks, _one_rope, _whole_rope, _no_router_bias, "windows"],
)
def test_each_feature_matters(saved, switch_off):
    path, _, tokens, expected = saved
    model = load_model(path)
    windows = None
    if switch_off == "windows":
        windows = (None,) * model.config.num_layers
    else:
        switch_off(model)
    err = (_logits(model, tokens, windows) - expected).abs().max().item()
    assert err > FAR, f"switching off {switch_off} left the logits within {err}"


def test_sinks_and_router_bias_load_as_fp32(saved):
    """In a bf16 model the sinks (fed to the kernels) and the routers' correction
    bias (transformers keeps it fp32) stay fp32, with the checkpoint's values."""
    path, hf, _, _ = saved
    model = load_model(path, dtype=torch.bfloat16)
    attn = model.model.layers[1].self_attn
    assert attn.attention_sink_bias.dtype == torch.float32
    assert torch.equal(attn.attention_sink_bias, hf.model.layers[1].self_attn.sinks.float())
    assert model.model.layers[0].self_attn.attention_sink_bias is None  # a full layer
    gate = model.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert attn.q_proj.weight.dtype == torch.bfloat16


def _config_dir(tmp_path, saved, **changes) -> str:
    path = saved[0]
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    config.update(changes)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    return str(tmp_path)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"swa_num_key_value_heads": 3}, "swa_num_key_value_heads 3"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_layer_types": ["dense"] + ["moe"] * 6}, "mlp_layer_types"),  # transformers says
        ({"n_group": 3}, "n_group"),
    ],
)
def test_bad_config_is_refused(tmp_path, saved, changes, match):
    with pytest.raises(ValueError, match=match):
        load_model_config(_config_dir(tmp_path, saved, **changes))


def test_tensor_parallel_refuses_indivisible_kv_heads(saved):
    """TP shards MiMo's heads (``test_tp_families.py`` runs it); the tiny model's one
    full-layer KV head cannot be split in two, and the error names the field."""
    from unikv.models.parallel import check_tp_config

    config, _ = load_model_config(saved[0])
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tp_config(config, 2)
