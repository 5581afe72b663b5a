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
    check_chunked_prefill,
    check_greedy_run,
    check_tight_pool,
    engine_llm,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_gemma,
)

from unikv.engine import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["gemma2", "gemma3"]
PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=ARCHS)
def ref(request, tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp(request.param))
    hf = save_tiny_gemma(request.param, path, tie_word_embeddings=False)
    return GreedyReference(hf, path, PROMPT_LENS, NEW_TOKENS)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size):
    llm = engine_llm(ref, page_size=page_size)
    assert sorted(llm.pool.subpools) == ["full", "swa"]
    assert llm.pool.subpools["swa"].spec.sliding_window == 7
    cap = ref.hf.config.attn_logit_softcapping if ref.hf.config.model_type == "gemma2" else 0.0
    assert {c.soft_cap for c in llm.runner.layers} == {cap}  # every layer's kernels get it
    check_greedy_run(ref, llm)


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    """7-token steps: prompts are split across steps (and share steps with other
    requests' chunks and decodes)."""
    check_chunked_prefill(ref, engine_llm)


def test_tight_pool_preempts_with_same_tokens(ref):
    """Eight requests (the prompts twice) in a pool of 24 pages per sub-pool for
    ~570 prompt + output tokens: requests are preempted and recomputed, and the
    tokens still match."""
    check_tight_pool(ref, engine_llm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
@pytest.mark.parametrize("ref", ["gemma2"], indirect=True)  # the one with an attention cap
def test_triton_kernels_under_the_interpreter(ref):
    """The engine on the Triton kernels (TRITON_INTERPRET=1 on CPU, set by
    conftest): decode and extend with the window, the scale and the soft-cap."""
    prompts = [ref.prompts[2][:20], ref.prompts[0][:3]]  # a chunked one and a short one
    llm = engine_llm(ref, backend="triton", max_model_len=48, max_num_batched_tokens=12)
    assert llm.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(ref.hf, p, 8) for p in prompts]


@pytest.mark.parametrize("ref", ["gemma2"], indirect=True)
def test_backend_without_soft_cap_is_refused(ref, monkeypatch):
    """A kernel set whose decode attention takes no ``soft_cap`` cannot run
    Gemma-2's capped attention: LLM() raises at start-up, naming the op."""
    import unikv.engine.build as llm_module  # build_engine looks up get_backend
    from unikv.kernels import get_backend

    torch_ops = get_backend("cpu")

    def decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, page_size, sm_scale,
                         window=0, sinks=None):  # fmt: skip
        raise AssertionError("never called: the engine refuses this backend first")

    ops = SimpleNamespace(**{**vars(torch_ops), "name": "nocap"})
    ops.decode_attention = decode_attention
    monkeypatch.setattr(llm_module, "get_backend", lambda device, backend=None: ops)
    with pytest.raises(ValueError, match="'nocap' backend's decode_attention cannot apply"):
        engine_llm(ref)
