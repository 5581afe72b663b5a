"""Granite-4.0-H (``granitemoehybrid``: Bamba's Mamba-2 + attention layers with
Granite's embedding / attention / residual / logits multipliers and a MoE MLP) in
unikv against transformers on the same weights (fp32 CPU, torch reference ops).

Four tiny variants, every multiplier away from 1:
- "moe": 4 experts (top 2) beside a shared MLP, rope attention;
- "dense": no experts (the shared MLP alone), attention without positional embedding;
- "moe_only": experts without a shared MLP (``shared_intermediate_size`` 0), no rope;
- "attention_only": every layer attention with rope, dense (Granite-4.0-1B's layout).

Each: the model alone gives transformers' logits (1e-4) and the engine transformers'
greedy tokens for a batch of mixed lengths. On "moe", the engine runs page sizes 1,
4 and 16, 7-token chunks cutting prompts mid-way, preemption, and the byte oracle
(state slot and K/V rows after prefill equal transformers' cache).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from engine_fixtures import DenseMamba2Step, hf_logits, one_thread  # noqa: F401  (a fixture)
from mamba_hybrid_fixtures import (
    check_chunks,
    check_greedy,
    check_preemption,
    check_prefill_bytes,
    granite_config,
    reference,
    save_hf,
)

from unikv.models import load_model, load_model_config

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # transformers builds a zero-width shared MLP for "moe_only"
    pytest.mark.filterwarnings("ignore:Initializing zero-element tensors"),
]

VARIANTS = {
    "moe": {},
    "dense": {"num_local_experts": 0, "position_embedding_type": None},
    "moe_only": {"shared_intermediate_size": 0, "position_embedding_type": None},
    # Granite-4.0-1B / 350M's layout: every layer attention (rope), dense; no Mamba sub-pool
    "attention_only": {"num_local_experts": 0, "layer_types": ["attention"] * 5},
}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    made = {}

    def get(variant: str):
        if variant not in made:
            path = str(tmp_path_factory.mktemp(f"granite_{variant}"))
            made[variant] = reference(granite_config(**VARIANTS[variant]), path)
        return made[variant]

    return get


@pytest.fixture(scope="module")
def ref(refs):
    return refs("moe")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(refs, variant):
    ref = refs(variant)
    model = load_model(ref.path)
    tokens = ref.prompts[3][:37]  # > chunk_size 16
    ours = model(torch.tensor(tokens), torch.arange(len(tokens)), DenseMamba2Step(0.09))
    want = hf_logits(ref.hf, tokens)
    assert want.std() > 0.3 and (ours - want).abs().max() < 1e-4
    check_greedy(ref)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_at_page_sizes(ref, page_size):
    llm = check_greedy(ref, page_size=page_size)
    assert {n: list(llm.pool[n].layers) for n in llm.pool.subpools} == {
        "full": [1, 4],
        "mamba": [0, 2, 3],
    }


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    check_chunks(ref)


def test_tight_pool_preempts_with_same_tokens(ref):
    check_preemption(ref)


def test_state_and_kv_bytes_after_prefill_match_transformers_cache(ref):
    check_prefill_bytes(ref, [1, 4])


def test_config_reads_granite_fields(ref):
    """The multipliers reach ModelConfig: the attention's as the softmax scale (the
    engine's), the others as the model's hooks; hub-style layer names ("mamba",
    "attention") give the same layer kinds."""
    from unikv.hf_config import model_specs_from_hf_config

    config, hf_config = load_model_config(ref.path)
    e = config.extra
    assert config.family == "granitemoehybrid" and config.sm_scale == 0.09
    assert (e["embedding_multiplier"], e["residual_multiplier"], e["logits_scaling"]) == (
        3.0,
        0.6,
        1.5,
    )
    raw = {
        **hf_config.to_dict(),
        "layer_types": ["mamba", "attention", "mamba", "mamba", "attention"],
    }
    assert model_specs_from_hf_config(raw).layer_kinds == (
        "mamba",
        "full",
        "mamba",
        "mamba",
        "full",
    )


def test_bad_configs_raise(tmp_path):
    from unikv.models.granitemoehybrid import GraniteMoeHybridForCausalLM as Granite

    save_hf(granite_config(num_hidden_layers=2, layer_types=["mamba", "attention"]), str(tmp_path))
    config, _ = load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="tensor parallelism"):
        Granite(config, 64, tp=SimpleNamespace(size=4, rank=0))  # 6 Mamba heads
    for extra, message in [
        ({"num_local_experts": 0, "shared_intermediate_size": 0}, "neither an MoE nor an MLP"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok must be in"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ]:
        bad = type(config)(**{**config.__dict__, "extra": {**config.extra, **extra}})
        with pytest.raises(ValueError, match=message):
            Granite(bad, 64)
