"""Qwen3.5-MoE through ``unikv.engine.LLM`` (fp32 CPU, torch reference kernels)
against transformers' own ``Qwen3_5MoeForCausalLM`` (eager) on the same weights.

The tiny model (``tiny_hybrid_config``'s odd Qwen3.5 shapes: layers [linear,
linear, full, linear, full], head dim 24 with partial rotary, DeltaNet key/value
head dims 12/20 with Hv = 2 Hk) puts a sparse MoE on every layer: 5 experts of
width 24, top 3 renormalised, a shared expert of width 40 behind its sigmoid gate.

- greedy tokens equal transformers' ``generate`` for 24 new tokens over a batch of
  prompts of 5, 17, 33 and 60 tokens, at page sizes 1, 4 and 16, every sampled
  logit row within 1e-4 of transformers' teacher-forced logits;
- 7-token steps cutting prompts mid-way, and a tight pool that preempts: same tokens;
- the byte oracle: right after prefill, each request's state slot read from the
  pool's raw byte buffer (offsets derived here from transformers' config fields)
  equals transformers' cache (``conv_states``, ``recurrent_states``);
- the released ``Qwen3_5MoeForConditionalGeneration`` wrapper: its text decoder runs.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    GreedyReference,
    check_chunked_prefill,
    check_greedy_run,
    check_tight_pool,
    engine_llm,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    state_slot_bytes,
)
from family_fixtures import (
    MOE,
    save_tiny_qwen3_5_mm,
    save_tiny_qwen3_5_moe,
)

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp("qwen3_5_moe"))
    hf = save_tiny_qwen3_5_moe(path)
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"
    assert hf.config.num_experts == MOE["num_experts"]
    return GreedyReference(hf, path, PROMPT_LENS, NEW_TOKENS)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size):
    from unikv.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
    from unikv.models.qwen3_next import SparseMoE

    llm = engine_llm(ref, page_size=page_size)
    assert isinstance(llm.model, Qwen3_5MoeForCausalLM)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in llm.model.model.layers)
    assert sorted(llm.pool.subpools) == ["full", "mamba"]
    check_greedy_run(ref, llm)


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    check_chunked_prefill(ref, engine_llm)


def test_tight_pool_preempts_with_same_tokens(ref):
    """The prompts twice in a pool of 24 attention pages + 2 state slots' bytes:
    requests are preempted (slot freed, prompt recomputed from a zeroed slot)."""
    check_tight_pool(ref, tight_llm)


def tight_llm(ref, kv_cache_bytes, **kw):
    """``engine_llm`` with 24 full pages + 2 state slots' bytes (in place of
    ``check_tight_pool``'s 24 pages of every sub-pool: 24 slots never preempt)."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(ref.path, page_size=4, dtype=torch.float32)
    return engine_llm(ref, kv_cache_bytes=pool_bytes_for(configs, {"full": 24, "mamba": 2}), **kw)


def test_state_slot_bytes_match_transformers_cache(ref):
    """After prefill, for every linear layer in model order: the conv window (C, K)
    then (after every layer's conv part) the delta-rule state (Hv, Dk, Dv), fp32."""
    c = ref.hf.config
    linear = [i for i, t in enumerate(c.layer_types) if t == "linear_attention"]
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim
    conv_dim += c.linear_num_value_heads * c.linear_value_head_dim
    conv_shape = (conv_dim, c.linear_conv_kernel_dim)
    state_shape = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    conv_bytes, state_bytes = (
        conv_dim * c.linear_conv_kernel_dim * 4,
        4 * int(torch.tensor(state_shape).prod()),
    )
    slot_bytes = len(linear) * (conv_bytes + state_bytes)
    seen: dict[int, torch.Tensor] = {}

    def grab(llm, batch, logits) -> None:
        for r in batch.requests:
            if r.num_cached == len(r.prompt_ids) and len(r.output_ids) == 1:
                seen[len(r.prompt_ids)] = state_slot_bytes(llm, r.slot, slot_bytes)

    llm = engine_llm(ref, max_num_batched_tokens=7)
    assert llm.pool["mamba"].page_bytes == slot_bytes
    llm.generate(ref.prompts, SamplingParams(max_tokens=2, temperature=0.0), on_step=grab)
    assert sorted(seen) == PROMPT_LENS
    for prompt in ref.prompts:
        with torch.no_grad():
            cache = ref.hf(torch.tensor([prompt]), use_cache=True).past_key_values
        raw = seen[len(prompt)]
        for j, layer in enumerate(linear):
            conv = raw[j * conv_bytes : (j + 1) * conv_bytes].view(torch.float32)
            start = len(linear) * conv_bytes + j * state_bytes
            state = raw[start : start + state_bytes].view(torch.float32)
            want_conv = cache.layers[layer].conv_states[0][0]
            want_state = cache.layers[layer].recurrent_states[0][0]
            assert want_state.abs().max() > 1e-3  # a state that took the prompt in
            torch.testing.assert_close(conv.view(conv_shape), want_conv, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(state.view(state_shape), want_state, atol=1e-5, rtol=1e-4)


def test_released_multimodal_checkpoint_runs_its_text_decoder(tmp_path):
    """Released Qwen3.5-MoE checkpoints are ``Qwen3_5MoeForConditionalGeneration``:
    the decoder under ``model.language_model.`` beside a vision tower (not loaded)."""
    from unikv.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    hf = save_tiny_qwen3_5_mm(str(tmp_path), moe=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 33)]
    llm = LLM(str(tmp_path), page_size=4, max_num_batched_tokens=7, max_model_len=96)
    assert isinstance(llm.model, Qwen3_5MoeForCausalLM)
    assert llm.config.media_token_ids == (hf.config.image_token_id, hf.config.video_token_id)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(hf, p, 12) for p in prompts]
