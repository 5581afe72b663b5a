"""The engine end to end on Falcon-H1 (fp32 CPU, torch reference ops) against
transformers on the same weights.

Every Falcon-H1 layer runs attention and a Mamba-2 mixer side by side, so each
layer has K/V pages in the "full" sub-pool AND a conv + SSM state in the "mamba"
sub-pool under the same model layer index. Greedy tokens equal transformers'
``generate`` for 24 new tokens over prompts of 5, 17, 33 and 60 tokens, at page
sizes 1, 4 and 16, with 16- and 7-token prefill chunks and under preemption;
every sampled logit row equals transformers' teacher-forced logits (1e-4). The
byte oracle reads each request's state slot from the pool's raw bytes after its
prefill and compares it with transformers' cache.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    GreedyReference,
    StepLogits,
    check_engine_outputs,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_falcon_h1,
    state_slot_bytes,
)

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp("falcon_h1"))
    hf = save_tiny_falcon_h1(path, mamba_rms_norm=True)
    return GreedyReference(hf, path, PROMPT_LENS, NEW_TOKENS)


def _llm(ref: GreedyReference, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_model_len", 128)
    return LLM(ref.path, device="cpu", max_num_seqs=8, **kw)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size):
    llm = _llm(ref, page_size=page_size)
    recorder = StepLogits()
    outputs = llm.generate(
        ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=recorder
    )
    layers = {name: list(llm.pool[name].layers) for name in llm.pool.subpools}
    assert layers == {"full": [0, 1, 2], "mamba": [0, 1, 2]}
    check_engine_outputs(ref, llm, outputs, recorder)


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    llm = _llm(ref, page_size=4, max_num_batched_tokens=7)
    recorder = StepLogits()
    outputs = llm.generate(
        ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=recorder
    )
    assert recorder.cut >= sum(n // 7 for n in PROMPT_LENS)
    check_engine_outputs(ref, llm, outputs, recorder)


def test_tight_pool_preempts_with_same_tokens(ref):
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(ref.path, page_size=4, dtype=torch.float32)
    budget = pool_bytes_for(configs, {"full": 24, "mamba": 2})
    llm = _llm(ref, page_size=4, kv_cache_bytes=budget, max_model_len=96)
    outputs = llm.generate(ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert llm.stats.preemptions > 0
    check_engine_outputs(ref, llm, outputs)


def test_state_bytes_after_prefill_match_transformers_cache(ref):
    """Right after a request's prefill its state slot's raw bytes hold, for every
    layer, transformers' conv window (C, K) then (after all layers' windows) its
    SSM state (H, P, N), fp32."""
    c = ref.hf.config
    conv_dim = c.mamba_d_ssm + 2 * c.mamba_n_groups * c.mamba_d_state
    conv_bytes = conv_dim * c.mamba_d_conv * 4
    ssm_shape = (c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state)
    ssm_bytes = 4 * ssm_shape[0] * ssm_shape[1] * ssm_shape[2]
    layers = range(c.num_hidden_layers)
    slot_bytes = len(layers) * (conv_bytes + ssm_bytes)
    seen: dict[int, torch.Tensor] = {}

    def grab(llm, batch, logits) -> None:
        for r in batch.requests:
            if r.num_cached == len(r.prompt_ids) and len(r.output_ids) == 1:
                seen[len(r.prompt_ids)] = state_slot_bytes(llm, r.slot, slot_bytes)

    llm = _llm(ref, page_size=4)
    assert llm.pool["mamba"].page_bytes == slot_bytes
    llm.generate(ref.prompts, SamplingParams(max_tokens=2, temperature=0.0), on_step=grab)
    assert sorted(seen) == PROMPT_LENS and llm.stats.preemptions == 0
    for prompt in ref.prompts:
        with torch.no_grad():
            cache = ref.hf(torch.tensor([prompt]), use_cache=True).past_key_values
        raw = seen[len(prompt)]
        for layer in layers:
            conv = raw[layer * conv_bytes : (layer + 1) * conv_bytes].view(torch.float32)
            start = len(layers) * conv_bytes + layer * ssm_bytes
            ssm = raw[start : start + ssm_bytes].view(torch.float32).view(ssm_shape)
            want_conv = cache.layers[layer].conv_states[0][0]  # (C, K)
            want_ssm = cache.layers[layer].recurrent_states[0][0]  # (H, P, N)
            for got, want in ((conv.view(conv_dim, c.mamba_d_conv), want_conv), (ssm, want_ssm)):
                assert want.dtype == torch.float32 and want.abs().max() > 1e-3
                err = (got - want).abs().max()
                assert err <= 1e-5 * want.abs().max(), (len(prompt), layer, err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_triton_kernels_under_the_interpreter(ref):
    """The engine on the Triton ops (TRITON_INTERPRET=1 on CPU, set by conftest):
    attention and Mamba-2 state of the same layers, transformers' greedy tokens."""
    llm = LLM(
        ref.path,
        device="cpu",
        backend="triton",
        page_size=4,
        max_model_len=64,
        max_num_batched_tokens=16,
    )
    outputs = llm.generate(ref.prompts[:2], SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.output_ids for o in outputs] == [g[:8] for g in ref.greedy[:2]]
