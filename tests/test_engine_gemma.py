"""Gemma-2 and Gemma-3 (text) through ``unikv.engine.LLM`` (fp32 CPU, torch
reference kernels) against transformers' eager models on the same weights.

The tiny models (``engine_fixtures.tiny_gemma_config``: window 7, Gemma-2
alternating sliding/full layers with attention soft-cap 5, Gemma-3 five sliding
layers per full one with per-type rope; final cap 3) hold two sub-pools: "swa"
pages for the sliding layers (freed as tokens leave the window) and "full" pages.
Their embeddings are untied here: a tiny tied model mostly repeats its last
token, which would make the token comparisons weak (tying is checked by the
model tests, ``test_models_gemma.py``).

- greedy tokens identical to transformers' ``generate`` for 24 new tokens over
  prompts of 5, 17, 33 and 60 tokens (longer than the window, which is a
  multiple of no page size), at page sizes 1, 4 and 16, and every sampled logit
  row within 1e-4 of transformers' teacher-forced logits;
- chunked prefill cutting prompts mid-way (7-token steps), and a tight pool that
  forces preemption by recompute: same tokens;
- the Triton kernels (under the interpreter on CPU): same tokens, soft-cap included;
- a backend whose attention cannot soft-cap is refused at start-up.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from engine_fixtures import (
    GreedyReference,
    StepLogits,
    check_engine_outputs,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_gemma,
)

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["gemma2", "gemma3"]
PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=ARCHS)
def ref(request, tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp(request.param))
    hf = save_tiny_gemma(request.param, path, tie_word_embeddings=False)
    return GreedyReference(hf, path, PROMPT_LENS, NEW_TOKENS)


def _llm(ref: GreedyReference, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_model_len", 96)
    kw.setdefault("page_size", 4)
    return LLM(ref.path, device="cpu", max_num_seqs=8, **kw)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size):
    llm = _llm(ref, page_size=page_size)
    assert sorted(llm.pool.subpools) == ["full", "swa"]
    assert llm.pool.subpools["swa"].spec.sliding_window == 7
    cap = ref.hf.config.attn_logit_softcapping if ref.hf.config.model_type == "gemma2" else 0.0
    assert {c.soft_cap for c in llm.runner.layers} == {cap}  # every layer's kernels get it
    rows = StepLogits()
    outputs = llm.generate(ref.prompts, SamplingParams(max_tokens=NEW_TOKENS), on_step=rows)
    check_engine_outputs(ref, llm, outputs, rows)


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    """7-token steps: prompts are split across steps (and share steps with other
    requests' chunks and decodes)."""
    rows = StepLogits()
    llm = _llm(ref, max_num_batched_tokens=7)
    outputs = llm.generate(ref.prompts, SamplingParams(max_tokens=NEW_TOKENS), on_step=rows)
    assert rows.cut > 0 and llm.stats.steps > sum(PROMPT_LENS) // 7
    check_engine_outputs(ref, llm, outputs)


def test_tight_pool_preempts_with_same_tokens(ref):
    """Eight requests (the prompts twice) in a pool of 24 pages per sub-pool for
    ~570 prompt + output tokens: requests are preempted and recomputed, and the
    tokens still match."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(ref.path, page_size=4, dtype=torch.float32)
    budget = pool_bytes_for(configs, {c.name: 24 for c in configs})
    llm = _llm(ref, kv_cache_bytes=budget, max_model_len=88)
    prompts = ref.prompts[::-1] + ref.prompts
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [o.output_ids for o in outputs] == ref.greedy[::-1] + ref.greedy
    assert llm.stats.preemptions > 0
    check_engine_outputs(ref, llm, outputs[len(ref.prompts) :])


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
@pytest.mark.parametrize("ref", ["gemma2"], indirect=True)  # the one with an attention cap
def test_triton_kernels_under_the_interpreter(ref):
    """The engine on the Triton kernels (TRITON_INTERPRET=1 on CPU, set by
    conftest): decode and extend with the window, the scale and the soft-cap."""
    prompts = [ref.prompts[2][:20], ref.prompts[0][:3]]  # a chunked one and a short one
    llm = _llm(ref, backend="triton", max_model_len=48, max_num_batched_tokens=12)
    assert llm.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8))
    assert [o.output_ids for o in outputs] == [hf_greedy(ref.hf, p, 8) for p in prompts]


@pytest.mark.parametrize("ref", ["gemma2"], indirect=True)
def test_backend_without_soft_cap_is_refused(ref, monkeypatch):
    """A kernel set whose decode attention takes no ``soft_cap`` cannot run
    Gemma-2's capped attention: LLM() raises at start-up, naming the op."""
    import unikv.engine.llm as llm_module
    from unikv.kernels import get_backend

    torch_ops = get_backend("cpu")

    def decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, page_size, sm_scale,
                         window=0, sinks=None):  # fmt: skip
        raise AssertionError("never called: the engine refuses this backend first")

    ops = SimpleNamespace(**{**vars(torch_ops), "name": "nocap"})
    ops.decode_attention = decode_attention
    monkeypatch.setattr(llm_module, "get_backend", lambda device, backend=None: ops)
    with pytest.raises(ValueError, match="'nocap' backend's decode_attention cannot apply"):
        _llm(ref)
