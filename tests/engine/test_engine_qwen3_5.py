"""Qwen3.5 (text) and Qwen3-Next through ``unikv.engine.LLM`` (fp32 CPU, torch
reference kernels) against transformers on the same weights.

The tiny models (``engine_fixtures.tiny_hybrid_config``: layers [linear, linear,
full, linear, full], odd head dims, Hv = 2 Hk, partial rotary; Qwen3-Next with
MoE) hold two sub-pools: "full" K/V pages for the attention layers and one
"mamba" state slot per request for the Gated DeltaNet layers.

- greedy tokens identical to transformers' ``generate`` for 24 new tokens over
  prompts of 5, 17, 33 and 60 tokens, at page sizes 1, 4 and 16, and every
  sampled logit row within 1e-4 of transformers' teacher-forced logits;
- chunked prefill cutting prompts mid-way (7-token steps), and a tight pool
  that forces preemption (the state slot is freed and recomputed): same tokens;
- the byte oracle: right after a request's prefill, its state slot read from the
  pool's raw byte buffer, with part offsets derived here from the MambaSpec
  fields (the slot law of docs/design.md), equals transformers' own cache states
  (``conv_states``, ``recurrent_states``) after the same prompt;
- on CPU, the Triton backend (interpreter) gives the same greedy tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    assert_pages_returned,
    hf_greedy,
    hf_logits,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_hybrid,
)

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["qwen3_5", "qwen3_next"]
PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24
ATOL = 1e-4


class Reference:
    """A saved tiny model, its prompts and transformers' greedy outputs."""

    def __init__(self, arch: str, path: str) -> None:
        self.arch, self.path = arch, path
        self.hf = save_tiny_hybrid(arch, path)
        g = torch.Generator().manual_seed(7)
        self.prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
        self.greedy = [hf_greedy(self.hf, p, NEW_TOKENS) for p in self.prompts]
        types = self.hf.config.layer_types
        self.linear = [i for i, t in enumerate(types) if t == "linear_attention"]


@pytest.fixture(scope="module", params=ARCHS)
def ref(request, tmp_path_factory) -> Reference:
    return Reference(request.param, str(tmp_path_factory.mktemp(request.param)))


def _llm(ref: Reference, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("page_size", 4)
    return LLM(ref.path, device="cpu", max_num_seqs=8, **kw)


class LogitRecorder:
    """Step hook: the logits row of every sampled token, by (request, position)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, llm, batch, logits) -> None:
        for i, r in enumerate(batch.requests):
            if r.num_pending == 1:  # this step sampled r's newest token
                self.rows[(r.request_id, r.seq_len - 1)] = logits[i].clone()


def _check_done(llm: LLM) -> None:
    assert_pages_returned(llm)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size):
    llm = _llm(ref, page_size=page_size)
    assert sorted(llm.pool.subpools) == ["full", "mamba"]
    recorder = LogitRecorder()
    outputs = llm.generate(
        ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=recorder
    )
    assert [o.output_ids for o in outputs] == ref.greedy
    first_id = llm.requests.next_id - len(outputs)
    for k, out in enumerate(outputs):
        full = hf_logits(ref.hf, out.prompt_ids + out.output_ids)  # (L, V), teacher-forced
        rows = {p: row for (rid, p), row in recorder.rows.items() if rid == first_id + k}
        assert len(rows) == NEW_TOKENS
        for p, row in rows.items():
            err = (row - full[p - 1]).abs().max().item()
            assert err < ATOL, f"request {k} position {p}: logits differ by {err}"
    _check_done(llm)


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    """7-token steps: every prompt but the first is split across steps (and
    across requests within a step), so states are read and written per chunk."""
    llm = _llm(ref, max_num_batched_tokens=7)
    outputs = llm.generate(ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in outputs] == ref.greedy
    assert llm.stats.steps > sum(PROMPT_LENS) // 7
    _check_done(llm)


def test_tight_pool_preempts_with_same_tokens(ref):
    """Eight requests (the prompts twice) in a pool of 24 full pages + 2 state
    slots' worth of bytes (~35 full pages) for 422 prompt + output tokens:
    requests are preempted (state slot freed, the prompt recomputed from a
    zeroed slot) and the tokens still match."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(ref.path, page_size=4, dtype=torch.float32)
    budget = pool_bytes_for(configs, {"full": 24, "mamba": 2})
    llm = _llm(ref, kv_cache_bytes=budget, max_model_len=88)
    prompts = ref.prompts[::-1] + ref.prompts
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in outputs] == ref.greedy[::-1] + ref.greedy
    served = sum(map(len, prompts)) + len(prompts) * NEW_TOKENS
    full = next(c for c in configs if c.name == "full")
    assert served > llm.pool.total_bytes // full.spec.page_bytes(4) * 4  # all bytes as K/V
    assert llm.stats.preemptions > 0
    _check_done(llm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_triton_kernels_under_the_interpreter(ref):
    """The engine on the Triton kernels (attention and the recurrent ops, under
    TRITON_INTERPRET=1 on CPU, set by conftest): transformers' greedy tokens."""
    prompts = [ref.prompts[2][:30], ref.prompts[0][:3]]  # a chunked one and a short one
    llm = _llm(ref, backend="triton", max_model_len=64, max_num_batched_tokens=16)
    assert llm.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(ref.hf, p, 8) for p in prompts]


def _expected_spec(ref: Reference) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv shape, recurrent shape) of one layer, from transformers' config."""
    c = ref.hf.config
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim
    conv_dim += c.linear_num_value_heads * c.linear_value_head_dim
    shape = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    return (conv_dim, c.linear_conv_kernel_dim), shape


def _slot_states(raw: torch.Tensor, spec) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer (conv (C, K), recurrent (H, Dk, Dv)) of one slot's raw bytes:
    [conv part, all layers][temporal part, all layers], each part starting at a
    multiple of its itemsize (the slot law, written out from the spec's fields)."""
    (conv,), temporal, layers = spec.conv, spec.temporal, spec.num_layers
    conv_item = torch.empty(0, dtype=conv.dtype).element_size()
    temporal_item = torch.empty(0, dtype=temporal.dtype).element_size()
    conv_bytes = math.prod(conv.shape) * conv_item
    temporal_start = -(-layers * conv_bytes // temporal_item) * temporal_item
    temporal_bytes = math.prod(temporal.shape) * temporal_item
    convs, temporals = [], []
    for j in range(layers):
        part = raw[j * conv_bytes : (j + 1) * conv_bytes]
        convs.append(part.view(conv.dtype).view(conv.shape))
        start = temporal_start + j * temporal_bytes
        part = raw[start : start + temporal_bytes]
        temporals.append(part.view(temporal.dtype).view(temporal.shape))
    return convs, temporals


class SlotCopier:
    """Step hook: the raw bytes of each request's state slot right after the step
    that completed its prefill (before any decode step touches it)."""

    def __init__(self) -> None:
        self.raw: dict[int, torch.Tensor] = {}

    def __call__(self, llm, batch, logits) -> None:
        sub = llm.pool.subpools["mamba"]
        for r in batch.requests:
            if r.slot is not None and r.num_cached == len(r.prompt_ids) and not r.output_ids[1:]:
                slot = int(llm.alloc.mamba_slots(torch.tensor([r.slot])).data[0])
                assert 0 < slot < sub.num_pages
                start = slot * sub.page_bytes  # a slot is a page of page_size 1
                self.raw[r.request_id] = llm.pool.buffer[start : start + sub.page_bytes].clone()


@pytest.mark.parametrize("max_batched", [64, 7])
def test_state_slot_bytes_match_transformers_cache(ref, max_batched):
    """Whole or chunked prefill: each request's slot holds, for every linear layer
    in model order, transformers' conv window and delta-rule state."""
    llm = _llm(ref, max_num_batched_tokens=max_batched)
    sub = llm.pool.subpools["mamba"]
    conv_shape, temporal_shape = _expected_spec(ref)
    assert list(sub.layers) == ref.linear
    assert sub.spec.conv[0].shape == conv_shape and sub.spec.conv[0].dtype == torch.float32
    assert sub.spec.temporal.shape == temporal_shape
    assert sub.spec.temporal.dtype == torch.float32
    copier = SlotCopier()
    llm.generate(ref.prompts, SamplingParams(max_tokens=2, temperature=0.0), on_step=copier)
    first_id = llm.requests.next_id - len(ref.prompts)
    assert sorted(copier.raw) == [first_id + k for k in range(len(ref.prompts))]
    for k, prompt in enumerate(ref.prompts):
        convs, temporals = _slot_states(copier.raw[first_id + k], sub.spec)
        with torch.no_grad():
            cache = ref.hf(torch.tensor([prompt]), use_cache=True).past_key_values
        for j, layer in enumerate(ref.linear):
            want_conv = cache.layers[layer].conv_states[0][0]  # (C, K), oldest first
            want_state = cache.layers[layer].recurrent_states[0][0]  # (Hv, Dk, Dv) fp32
            assert want_conv.shape == conv_shape and want_state.shape == temporal_shape
            assert want_state.dtype == torch.float32
            err_conv = (convs[j] - want_conv).abs().max().item()
            err_state = (temporals[j] - want_state).abs().max().item()
            assert err_conv < ATOL, f"request {k} layer {layer}: conv differs by {err_conv}"
            assert err_state < ATOL, f"request {k} layer {layer}: state differs by {err_state}"
    _check_done(llm)


def test_released_multimodal_checkpoint_runs_its_text_decoder(tmp_path):
    """Released Qwen3.5 checkpoints are ``Qwen3_5ForConditionalGeneration``: the
    config nests the decoder in ``text_config`` and the weights sit under
    ``model.language_model.`` beside a vision tower. unikv loads the decoder alone
    and gives the wrapper's own text-only greedy tokens."""
    from family_fixtures import save_tiny_qwen3_5_mm

    from unikv.models.qwen3_5 import Qwen3_5ForCausalLM

    hf = save_tiny_qwen3_5_mm(str(tmp_path))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 33)]
    llm = LLM(str(tmp_path), page_size=4, max_num_batched_tokens=7)
    assert isinstance(llm.model, Qwen3_5ForCausalLM)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(hf, p, 24) for p in prompts]
