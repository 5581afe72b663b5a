"""unikv's NemotronH (Mamba-2 / attention / MLP / MoE hybrid) against transformers'
own model on the same weights, without the pool.

A tiny random-init ``NemotronHForCausalLM`` is saved with ``save_pretrained`` and
loaded by unikv; a whole-sequence forward through unikv's layers, with a dense
step object (``engine_fixtures.DenseMamba2Step``: attention, causal conv and the
Mamba-2 scan written from their definitions, one token at a time) must give
transformers' logits (eager attention, torch Mamba path: no mamba_ssm /
causal_conv1d kernels are installed). Shapes are deliberately odd: attention
head_dim 24, mamba head_dim 12, 6 mamba heads in 2 groups, state size 10.
Tolerance: fp32, max abs error 1e-4 on logits of std ~1.
"""

from __future__ import annotations

import json
import re
import types

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    DenseMamba2Step,
    hf_logits,
    one_thread,  # noqa: F401  (a fixture)
)
from engine_fixtures import save_tiny_nemotron_h as save_nemotron

from unikv.kernels.moe import ref as moe_ref
from unikv.models import load_model, load_model_config

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
PATTERNS = {"hybrid": "M*M-M*-", "moe": "ME*M-E"}


def _tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", sorted(PATTERNS))
def test_logits_match_transformers(kind, tmp_path):
    hf = save_nemotron(str(tmp_path), PATTERNS[kind])
    model = load_model(str(tmp_path))
    tokens = _tokens(37)  # > chunk_size 16: transformers' chunked scan crosses chunks
    step = DenseMamba2Step(model.config.sm_scale)
    ours = model(torch.tensor(tokens), torch.arange(len(tokens)), step)
    ref = hf_logits(hf, tokens)
    assert ref.std() > 0.3  # not near-uniform
    assert (ours - ref).abs().max() < ATOL
    # the step-size clamp at time_step_min (0.001) binds on some tokens here, so
    # the comparison also checks that it is applied
    assert step.min_dt < hf.config.time_step_min


def test_sparse_expert_loop_matches(tmp_path, monkeypatch):
    """The prefill (sparse) expert loop gives transformers' logits too."""

    hf = save_nemotron(str(tmp_path), PATTERNS["moe"])
    model = load_model(str(tmp_path))
    monkeypatch.setattr(moe_ref, "DENSE_MAX_TOKENS", 0)  # the rule dense_rows reads
    tokens = _tokens(24, seed=2)
    step = DenseMamba2Step(model.config.sm_scale)
    ours = model(torch.tensor(tokens), torch.arange(len(tokens)), step)
    assert (ours - hf_logits(hf, tokens)).abs().max() < ATOL


def test_config_reads_nemotron_fields(tmp_path):
    """The pattern, the odd sizes and the eps reach ModelConfig (read from the
    saved config.json through transformers' own config class)."""
    save_nemotron(str(tmp_path), PATTERNS["moe"], layer_norm_epsilon=1e-4)
    config, hf_config = load_model_config(str(tmp_path))
    assert config.family == "nemotron_h"
    assert config.extra["layer_types"] == tuple(hf_config.layers_block_type)
    assert config.extra["layer_types"][1] == "moe"
    assert config.windows == (None,) * 6 and config.head_dim == 24
    assert config.extra["layer_norm_epsilon"] == 1e-4 == config.rms_norm_eps


def _hf_name(name: str) -> str:
    """transformers' in-memory name of a checkpoint tensor (``backbone.`` is
    ``model.``; experts are stacked: ``experts.e.up_proj.weight`` -> ``experts.up_proj``);
    our attention's one q|k|v GEMM (``qkv_proj``) stands for its first part, ``q_proj``."""
    name = re.sub(r"^backbone\.", "model.", name).replace(".qkv_proj.", ".q_proj.")
    return re.sub(r"experts\.\d+\.(up|down)_proj\.weight$", r"experts.\1_proj", name)


def test_bf16_parameter_dtypes_follow_transformers(tmp_path):
    """Loaded in bf16, every parameter has the dtype transformers' own
    ``from_pretrained`` gives it (the router's correction bias stays fp32)."""
    import transformers as tf

    save_nemotron(str(tmp_path), PATTERNS["moe"])
    ours = dict(load_model(str(tmp_path), dtype=torch.bfloat16).named_parameters())
    hf = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    theirs = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    assert {n: p.dtype for n, p in ours.items()} == {n: theirs[_hf_name(n)].dtype for n in ours}
    assert any(p.dtype == torch.float32 for p in ours.values())


def _edit_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def test_bad_configs_raise(tmp_path):
    from unikv.models.nemotron_h import NemotronHForCausalLM

    save_nemotron(str(tmp_path), PATTERNS["hybrid"])
    config, _ = load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="tensor parallelism of 4.*mamba_num_heads"):
        NemotronHForCausalLM(config, 64, tp=types.SimpleNamespace(size=4, rank=0))
    _edit_config(tmp_path, mlp_hidden_act="gelu")
    with pytest.raises(ValueError, match="mlp_hidden_act"):
        load_model(str(tmp_path))
    _edit_config(tmp_path, mlp_hidden_act="relu2", mamba_hidden_act="relu")
    with pytest.raises(ValueError, match="activation"):
        load_model(str(tmp_path))
    save_nemotron(str(tmp_path), PATTERNS["moe"])
    _edit_config(tmp_path, n_group=4)  # 6 experts do not split into 4 routing groups
    with pytest.raises(ValueError, match="n_group"):
        load_model(str(tmp_path))
