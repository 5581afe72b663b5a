"""Bamba (Mamba-2 + rope attention with a half-rotary head, SwiGLU MLPs) in unikv
against transformers on the same weights (fp32 CPU, torch reference ops).

- the model alone (``DenseMamba2Step``, no pool): transformers' logits (1e-4);
- the engine: greedy tokens equal transformers' ``generate`` for 24 new tokens over
  prompts of 5, 17, 33 and 60 tokens in one batch, at page sizes 1, 4 and 16, with
  7-token steps cutting prompts mid-way and under preemption, every sampled logit row
  transformers' teacher-forced one (1e-4);
- the byte oracle (``mamba_hybrid_fixtures.check_prefill_bytes``): after prefill each
  request's state slot and K/V rows hold transformers' cache.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from engine_fixtures import DenseMamba2Step, hf_logits, one_thread  # noqa: F401  (a fixture)
from mamba_hybrid_fixtures import (
    bamba_config,
    check_chunks,
    check_greedy,
    check_preemption,
    check_prefill_bytes,
    reference,
    save_hf,
)

from unikv.engine import LLM, SamplingParams
from unikv.models import load_model, load_model_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference(bamba_config(), str(tmp_path_factory.mktemp("bamba")))


def test_logits_match_transformers(ref):
    model = load_model(ref.path)
    assert model.config.family == "bamba" and model.config.rope["partial_rotary_factor"] == 0.5
    tokens = ref.prompts[3][:37]  # > chunk_size 16: transformers' chunked scan crosses chunks
    ours = model(
        torch.tensor(tokens), torch.arange(len(tokens)), DenseMamba2Step(model.config.sm_scale)
    )
    want = hf_logits(ref.hf, tokens)
    assert want.std() > 0.3 and (ours - want).abs().max() < 1e-4


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size):
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_triton_kernels_under_the_interpreter(ref):
    """The engine on the Triton ops (TRITON_INTERPRET=1 on CPU, set by conftest)."""
    llm = LLM(ref.path, device="cpu", backend="triton", page_size=4, max_model_len=64,
              max_num_batched_tokens=16)  # fmt: skip
    outputs = llm.generate(ref.prompts[:2], SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.output_ids for o in outputs] == [g[:8] for g in ref.greedy[:2]]


def test_bad_configs_raise(tmp_path):
    from unikv.models.bamba import BambaForCausalLM

    save_hf(bamba_config(num_hidden_layers=2, attn_layer_indices=[1]), str(tmp_path))
    config, _ = load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="tensor parallelism"):
        BambaForCausalLM(config, 64, tp=SimpleNamespace(size=4, rank=0))  # 6 Mamba heads
    bad = type(config)(**{**config.__dict__, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        BambaForCausalLM(bad, 64)
