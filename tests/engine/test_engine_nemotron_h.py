"""The engine end to end on NemotronH (fp32 CPU, torch reference ops) against
transformers on the same weights.

Two tiny models: the hybrid "M*M-M*-" (Mamba-2, attention, MLP) and "ME*M-E"
(MoE). Greedy tokens equal transformers' ``generate`` for 24 new tokens over
prompts of 5, 17, 33 and 60 tokens, at page sizes 1, 4 and 16, with prefill
chunks of 16 or 7 tokens (cutting prompts mid-way) and under preemption. Every
logit row the engine sampled from is compared with transformers' teacher-forced
whole-sequence logits (max abs error 1e-4): transformers' own decode path skips
the step-size clamp at ``time_step_min`` that its prefill applies, so its
generate logits drift ~2e-4 from its full forward; unikv clamps in every step.

The byte oracle reads each request's state slot from the pool's raw byte buffer
(offsets computed here from the config, not from MambaSpec) right after its
prefill and compares it with transformers' cache after the same prompt.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    GreedyReference,
    StepLogits,
    check_engine_outputs,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_nemotron_h,
    state_slot_bytes,
)

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PATTERNS = ["M*M-M*-", "ME*M-E"]
PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24


def _reference(pattern: str, path: str) -> GreedyReference:
    ref = GreedyReference(save_tiny_nemotron_h(path, pattern), path, PROMPT_LENS, NEW_TOKENS)
    ref.pattern = pattern
    return ref


@pytest.fixture(scope="module", params=PATTERNS)
def ref(request, tmp_path_factory) -> GreedyReference:
    return _reference(request.param, str(tmp_path_factory.mktemp("nemotron_h")))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> GreedyReference:
    return _reference(PATTERNS[0], str(tmp_path_factory.mktemp("nemotron_h_hybrid")))


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
    assert sorted(llm.pool.subpools) == ["full", "mamba"]
    check_engine_outputs(ref, llm, outputs, recorder)


def test_chunked_prefill_cuts_prompts_mid_way(hybrid):
    """7-token steps: every prompt but the shortest is split, and a Mamba state
    carried over a chunk boundary (conv window and SSM state) must continue
    exactly where the previous chunk left it."""
    llm = _llm(hybrid, page_size=4, max_num_batched_tokens=7)
    recorder = StepLogits()
    outputs = llm.generate(
        hybrid.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=recorder
    )
    assert recorder.cut >= sum(n // 7 for n in PROMPT_LENS)
    check_engine_outputs(hybrid, llm, outputs, recorder)


def test_tight_pool_preempts_with_same_tokens(hybrid):
    """A pool of the bytes of 24 attention pages (96 tokens at page size 4) plus 2
    state slots, shared between them, for 115 prompt + 96 output tokens:
    requests are preempted, their state slots freed and re-zeroed on
    readmission; the recompute gives the same tokens."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(hybrid.path, page_size=4, dtype=torch.float32)
    budget = pool_bytes_for(configs, {"full": 24, "mamba": 2})
    llm = _llm(hybrid, page_size=4, kv_cache_bytes=budget, max_model_len=96)
    outputs = llm.generate(hybrid.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert llm.stats.preemptions > 0
    check_engine_outputs(hybrid, llm, outputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_triton_kernels_under_the_interpreter(hybrid):
    """The engine on the Triton ops (TRITON_INTERPRET=1 on CPU, set by conftest),
    fed the model's strided conv / scan inputs: transformers' greedy tokens."""
    llm = LLM(
        hybrid.path,
        device="cpu",
        backend="triton",
        page_size=4,
        max_model_len=64,
        max_num_batched_tokens=16,
    )
    outputs = llm.generate(hybrid.prompts[:2], SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.output_ids for o in outputs] == [g[:8] for g in hybrid.greedy[:2]]


def _mamba_layers(pattern: str) -> list[int]:
    return [i for i, c in enumerate(pattern) if c == "M"]


def _slot_bytes(hf_config, num_layers: int) -> tuple[int, int, int]:
    """(conv bytes per layer, SSM bytes per layer, slot bytes): fp32 parts, all
    layers' conv windows first, then all layers' SSM states."""
    c = hf_config
    conv_dim = c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size
    conv = conv_dim * c.conv_kernel * 4
    ssm = c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size * 4
    return conv, ssm, num_layers * (conv + ssm)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32 agreement relative to the state's scale (SSM states are ~1e-3 here)."""
    return bool((got - want).abs().max() <= 1e-5 * want.abs().max())


def test_state_bytes_after_prefill_match_transformers_cache(hybrid):
    """Right after a request's prefill, its state slot's raw bytes hold
    transformers' conv window (C, K) and SSM state (H, P, N) of every Mamba layer
    after the same prompt; a 2-token prompt (shorter than the conv kernel) checks
    the window's zero left padding."""
    hf_config, layers = hybrid.hf.config, _mamba_layers(hybrid.pattern)
    conv_bytes, ssm_bytes, slot_bytes = _slot_bytes(hf_config, len(layers))
    prompts = [*hybrid.prompts, [3, 141]]
    seen: dict[int, torch.Tensor] = {}

    def grab(llm, batch, logits) -> None:
        for r in batch.requests:
            if r.num_cached == len(r.prompt_ids) and len(r.output_ids) == 1:
                seen[len(r.prompt_ids)] = state_slot_bytes(llm, r.slot, slot_bytes)

    llm = _llm(hybrid, page_size=4)
    assert llm.pool["mamba"].page_bytes == slot_bytes
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), on_step=grab)
    assert sorted(seen) == sorted(map(len, prompts)) and llm.stats.preemptions == 0
    c = hf_config
    conv_shape = (conv_bytes // 4 // c.conv_kernel, c.conv_kernel)
    ssm_shape = (c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size)
    for prompt in prompts:
        with torch.no_grad():
            cache = hybrid.hf(torch.tensor([prompt]), use_cache=True).past_key_values
        raw = seen[len(prompt)]
        for j, layer in enumerate(layers):
            conv = raw[j * conv_bytes : (j + 1) * conv_bytes].view(torch.float32)
            start = len(layers) * conv_bytes + j * ssm_bytes
            ssm = raw[start : start + ssm_bytes].view(torch.float32)
            want_conv = cache.layers[layer].conv_states[0][0]  # (C, K)
            want_ssm = cache.layers[layer].recurrent_states[0][0]  # (H, P, N)
            assert want_conv.dtype == want_ssm.dtype == torch.float32
            assert _close(conv.view(conv_shape), want_conv), (len(prompt), layer)
            assert _close(ssm.view(ssm_shape), want_ssm), (len(prompt), layer)
            assert want_ssm.abs().max() > 1e-4  # a state that took the prompt in
        if len(prompt) < c.conv_kernel:
            assert not want_conv[:, : c.conv_kernel - len(prompt)].any()
