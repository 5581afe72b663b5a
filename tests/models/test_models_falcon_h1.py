"""unikv's Falcon-H1 (attention and Mamba-2 side by side in every layer, muP
multipliers) against transformers' own model on the same weights, without the pool.

A tiny random-init ``FalconH1ForCausalLM`` (every multiplier away from 1) is saved
with ``save_pretrained`` and loaded by unikv; a whole-sequence forward through
unikv's layers with the dense step object of the NemotronH tests (attention, causal
conv and Mamba-2 scan from their definitions) must give transformers' logits
(eager attention, torch Mamba path). Variants: no Mamba norm (y * silu(z)), the
gated RMSNorm gating before normalising with tied embeddings, and a step-size
clamp that binds. Tolerance: fp32, max abs error 1e-4.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    DenseMamba2Step,
    hf_logits,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_falcon_h1,
)

from unikv.models import load_model, load_model_config

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
VARIANTS = {
    "plain": {},
    "norm_tied": {
        "mamba_rms_norm": True,
        "mamba_norm_before_gate": False,
        "tie_word_embeddings": True,
    },
    "norm_clamped": {"mamba_rms_norm": True, "time_step_limit": (0.0, 0.5)},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    hf = save_tiny_falcon_h1(str(tmp_path), **VARIANTS[variant])
    model = load_model(str(tmp_path))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (37,), generator=g).tolist()  # > chunk size 16
    step = DenseMamba2Step(model.config.sm_scale)
    ours = model(torch.tensor(tokens), torch.arange(len(tokens)), step)
    ref = hf_logits(hf, tokens)
    assert ref.std() > 0.5  # not near-uniform
    assert (ours - ref).abs().max() < ATOL
    assert sorted(step.conv) == sorted(step.ssm) == list(range(3))  # a mixer in every layer


def test_bf16_parameter_dtypes_follow_transformers(tmp_path):
    """Loaded in bf16, every parameter has transformers' dtype (none is kept fp32)
    and the rebuilt mup_vector equals transformers' own (it is not in the checkpoint)."""
    import transformers as tf

    save_tiny_falcon_h1(str(tmp_path))
    ours = load_model(str(tmp_path), dtype=torch.bfloat16)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    theirs = dict(hf.named_parameters())
    names = {}  # ours -> transformers' (a packed GEMM: each of the tensors it packs)
    for prefix, module in ours.named_modules():
        for packed, parts in getattr(module, "packed", {}).items():
            for kind in ("weight", "bias"):
                if getattr(getattr(module, packed), kind, None) is not None:
                    names[f"{prefix}.{packed}.{kind}"] = [f"{prefix}.{p}.{kind}" for p in parts]
    ours_dtypes = {n: p.dtype for n, p in ours.named_parameters()}
    assert ours_dtypes == {n: theirs[names.get(n, [n])[0]].dtype for n in ours_dtypes}
    for n, parts in names.items():  # the packed tensors' sources share one dtype
        assert {theirs[p].dtype for p in parts} == {ours_dtypes[n]}
    for a, b in zip(ours.model.layers, hf.model.layers):
        assert torch.equal(a.mamba.mup_vector, b.mamba.mup_vector.flatten())


def test_bad_configs_raise(tmp_path):
    from unikv.models.falcon_h1 import FalconH1ForCausalLM

    save_tiny_falcon_h1(str(tmp_path))
    config, _ = load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="tensor parallelism of 4.*num_key_value_heads"):
        FalconH1ForCausalLM(config, 64, tp=types.SimpleNamespace(size=4, rank=0))
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act"):
        load_model(str(tmp_path))
