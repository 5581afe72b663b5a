"""unikv's model implementations against transformers' own models (no pool).

Each tiny random-init transformers model is saved with ``save_pretrained`` and
loaded by unikv; a whole-sequence forward through unikv's layers (with a plain
contiguous attention written from the definition in ``engine_fixtures``) must
give transformers' logits. Tolerance: fp32, max abs error 1e-4 on logits of
std ~0.8 (observed ~2e-6).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    DenseAttention,
    hf_logits,
    one_thread,  # noqa: F401  (a fixture)
    pack_gpt_oss_experts,
    save_tiny_model,
    tiny_hf_config,
)

from unikv.kernels.moe import ref as moe_ref
from unikv.models import load_model, load_model_config
from unikv.models.rope import rope_inv_freq

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gpt_oss"]
ATOL = 1e-4


def _unikv_logits(model, tokens):
    attn = DenseAttention(model.config.windows, model.config.sm_scale)
    return model(torch.tensor(tokens), torch.arange(len(tokens)), attn)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tmp_path):
    hf = save_tiny_model(arch, str(tmp_path))
    model = load_model(str(tmp_path))
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, tokens)
    assert (_unikv_logits(model, tokens) - ref).abs().max() < ATOL


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_triton_elementwise_ops_match_transformers(arch, tmp_path):
    """The model built with the Triton elementwise ops (fused add+norm, in-place
    rope on the q|k|v GEMM's views, silu_mul; CPU interpreter) gives
    transformers' logits too: llama (llama3 rope), qwen3 (q/k norms on strided
    heads), gpt-oss (fp32-weight norms, sinks)."""
    hf = save_tiny_model(arch, str(tmp_path))
    model = load_model(str(tmp_path), kernels="triton")
    assert model.model.norm.ops.name == "triton" and model.model.rotary.ops.name == "triton"
    tokens = torch.randint(0, VOCAB, (17,), generator=torch.Generator().manual_seed(5)).tolist()
    assert (_unikv_logits(model, tokens) - hf_logits(hf, tokens)).abs().max() < ATOL


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_projections_hold_the_checkpoint_tensors(arch, tmp_path):
    """qkv_proj / gate_up_proj are the checkpoint's q, k, v (gate, up) tensors
    stacked on the output dim, biases included (qwen2 has q/k/v biases)."""
    from safetensors.torch import load_file

    save_tiny_model(arch, str(tmp_path), **({"mlp_bias": True} if arch == "llama" else {}))
    ckpt = load_file(str(tmp_path / "model.safetensors"))
    params = dict(load_model(str(tmp_path)).named_parameters())
    kinds = ["weight", "bias"]
    for layer in range(2):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        for kind in kinds:
            if attn + f"q_proj.{kind}" in ckpt:
                want = torch.cat([ckpt[attn + f"{p}_proj.{kind}"] for p in "qkv"])
                assert torch.equal(params[attn + f"qkv_proj.{kind}"], want)
            if mlp + f"gate_proj.{kind}" in ckpt:
                want = torch.cat([ckpt[mlp + f"{p}_proj.{kind}"] for p in ("gate", "up")])
                assert torch.equal(params[mlp + f"gate_up_proj.{kind}"], want)
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in params)
    assert ("model.layers.0.self_attn.qkv_proj.bias" in params) == (arch == "qwen2")


def test_missing_part_of_a_fused_projection_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_model("llama", str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.k_proj.weight'\]"):
        load_model(str(tmp_path))


def test_gpt_oss_sparse_expert_loop_matches(tmp_path, monkeypatch):
    """The prefill (sparse) expert loop gives transformers' logits too."""
    hf = save_tiny_model("gpt_oss", str(tmp_path))
    model = load_model(str(tmp_path))
    monkeypatch.setattr(moe_ref, "DENSE_MAX_TOKENS", 0)  # the rule dense_rows reads
    tokens = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    assert (_unikv_logits(model, tokens) - hf_logits(hf, tokens)).abs().max() < ATOL


def test_gpt_oss_dense_experts_reach_the_kernel_k_contiguous(tmp_path):
    """The fused MoE's (E, N, K) weight views of dense gpt-oss experts run along K in
    memory (whole K runs a tile row, not a stride-2 gather of interleaved gate/up
    columns), and hold the checkpoint's values: element [e, n, k] of the view is the
    checkpoint tensor's [e, k, n]."""
    from safetensors.torch import load_file

    save_tiny_model("gpt_oss", str(tmp_path))
    model = load_model(str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    experts = model.model.layers[0].mlp.experts
    ops = experts.operands()
    for view, name in ((ops["w1"], "gate_up_proj"), (ops["w2"], "down_proj")):
        assert view.stride(-1) == 1 and view.is_contiguous(), (name, view.stride())
        torch.testing.assert_close(view, saved[f"model.layers.0.mlp.experts.{name}"].mT)


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    hf = save_tiny_model("llama", str(tmp_path / "one"))
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    a, b = load_model(str(tmp_path / "one")), load_model(str(tmp_path / "sharded"))
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_hf_config("llama", rope_parameters=rope, max_position_embeddings=8192)
    ref, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    ours, scale = rope_inv_freq(config.rope_parameters, 16, 8192)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0) and scale == pytest.approx(ref_scale)


def test_mxfp4_dequantisation_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from unikv.kernels.moe.mxfp4_ref import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 136, (3, 10, 2), dtype=torch.uint8, generator=g)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales), ref)


def test_missing_files_raise(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))
    save_tiny_model("llama", str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(tmp_path))


def test_unsupported_architecture_raises(tmp_path):
    save_tiny_model("llama", str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model_config(str(tmp_path))


def test_mismatched_weights_raise(tmp_path):
    save_tiny_model("llama", str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing"):
        load_model(str(tmp_path))


def test_mxfp4_checkpoint_loads_dequantised_experts(tmp_path):
    """A gpt-oss checkpoint whose experts are stored as MXFP4 pairs (as released
    gpt-oss checkpoints are) loads to transformers' dequantisation of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    save_tiny_model("gpt_oss", str(tmp_path))
    tensors = pack_gpt_oss_experts(str(tmp_path), seed=3)
    expected = {}
    for name in [n[: -len("_blocks")] for n in tensors if n.endswith("_blocks")]:
        blocks, scales = tensors[name + "_blocks"], tensors[name + "_scales"]
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    params = dict(load_model(str(tmp_path)).named_parameters())
    assert len(expected) == 8  # 4 layers x (gate_up, down)
    for name, want in expected.items():
        assert torch.equal(params[name], want), name


def test_mxfp4_checkpoint_with_quantization_config_keeps_experts_packed(tmp_path):
    """A released gpt-oss checkpoint says ``quant_method: mxfp4``: its experts then
    load packed (the uint8 blocks and scales are the model's parameters, byte for
    byte) and give the logits of the same bytes loaded dequantised."""
    import shutil

    dense_dir, packed_dir = tmp_path / "dense", tmp_path / "packed"
    save_tiny_model("gpt_oss", str(dense_dir))
    tensors = pack_gpt_oss_experts(str(dense_dir), seed=4)
    g = torch.Generator().manual_seed(4)
    shutil.copytree(dense_dir, packed_dir)
    config = json.loads((packed_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed_dir / "config.json").write_text(json.dumps(config))
    dense, packed = load_model(str(dense_dir)), load_model(str(packed_dir))
    params = dict(packed.named_parameters())
    blocks = [n for n in tensors if n.endswith(("_blocks", "_scales"))]
    assert len(blocks) == 16 and not any(n.endswith("experts.down_proj") for n in params)
    for name in blocks:
        assert params[name].dtype == torch.uint8 and torch.equal(params[name], tensors[name]), name
    tokens = torch.randint(0, VOCAB, (13,), generator=g).tolist()
    diff = (_unikv_logits(packed, tokens) - _unikv_logits(dense, tokens)).abs().max()
    assert diff < 1e-5, diff
