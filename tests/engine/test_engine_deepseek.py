"""DeepSeek-V2 and V3 through ``unikv.engine.LLM`` (fp32 CPU, torch reference ops)
against transformers on the same weights.

The tiny models (``engine_fixtures.tiny_deepseek_config``: kv_lora_rank 24, rope 8,
nope 12, v_head_dim 20, a dense first layer then MoE) hold one "mla" sub-pool:
one latent row ``[c | k_rope]`` per layer and token. Decode steps read it in the
absorbed form; extend steps in the form the step's rule picks (``ExtendAttention.
expands_mla``: here the prefill-only steps expand, steps mixing decodes with short
chunks absorb). Each form forced on its own: ``tests/kernels/test_mla_expanded.py``.

- greedy tokens identical to transformers' ``generate`` for 24 new tokens over a
  batch of prompts of 5, 17, 33 and 60 tokens, at page sizes 1, 4 and 16, and
  every sampled logit row within 1e-4 of transformers' teacher-forced logits;
- chunked prefill cutting prompts mid-way (7-token steps), and a tight pool that
  forces preemption (pages freed, the prompt recomputed): same tokens;
- the byte oracle: right after a request's prefill, its latent rows read through
  the pool's (page, slot) views ``mla_paged_views`` (an independent description
  of the bytes) at the physical pages the allocator reports, equal transformers'
  own cache after the same prompt (normalised c as keys, rotated k_rope as values);
- on CPU, the Triton backend (interpreter) gives the same greedy tokens.
"""

from __future__ import annotations

import functools

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
    save_tiny_deepseek,
)

from unikv.engine import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

VERSIONS = [2, 3]
PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=VERSIONS)
def ref(request, tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp(f"deepseek_v{request.param}"))
    return GreedyReference(save_tiny_deepseek(request.param, path), path, PROMPT_LENS, NEW_TOKENS)


_llm = functools.partial(engine_llm, max_model_len=128)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size):
    llm = _llm(ref, page_size=page_size)
    assert list(llm.pool.subpools) == ["mla"]
    check_greedy_run(ref, llm)


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    """7-token steps: prompts are split across steps and share steps with other
    requests' chunks and decodes, so later chunks read earlier chunks' latents."""
    check_chunked_prefill(ref, _llm)


def test_tight_pool_preempts_with_same_tokens(ref):
    """Eight requests (the prompts twice, 422 prompt + output tokens) in a pool of 24
    pages of 4 tokens: requests are preempted and recomputed, same tokens."""
    check_tight_pool(ref, _llm)


class LatentCopier:
    """Step hook: each request's latent rows (every MLA layer, its prompt positions)
    right after the step that completed its prefill, read through the (page, slot)
    views at the physical pages the allocator reports for the request."""

    def __init__(self) -> None:
        self.rows: dict[int, list[torch.Tensor]] = {}

    def __call__(self, llm, batch, logits) -> None:
        sub = llm.pool.subpools["mla"]
        for r in batch.requests:
            if r.slot is None or r.num_cached != len(r.prompt_ids) or r.output_ids[1:]:
                continue
            cols, phys = llm.alloc.request_pages(r.slot)["mla"]
            n, ps = len(r.prompt_ids), sub.page_size
            assert list(cols) == list(range(-(-n // ps)))
            assert (phys >= sub.first_page).all() and (phys < sub.num_pages).all()
            pos = torch.arange(n)
            pages = torch.as_tensor(phys)[pos // ps]
            self.rows[r.request_id] = [v[pages, pos % ps].clone() for v in sub.paged_views]


@pytest.mark.parametrize("max_batched", [64, 7])
def test_latent_rows_match_transformers_cache(ref, max_batched):
    """Whole or chunked prefill: each request's pool rows hold, for every layer,
    transformers' cached compressed kv (keys: kv_a_layernorm(c), values: the
    rotated k_rope in transformers' layout) at every prompt position."""
    llm = _llm(ref, max_num_batched_tokens=max_batched, page_size=4)
    sub = llm.pool.subpools["mla"]
    rank = ref.hf.config.kv_lora_rank
    assert sub.spec.kv_lora_rank == rank and sub.spec.rope_dim == ref.hf.config.qk_rope_head_dim
    assert sub.spec.dtype == torch.float32 and list(sub.layers) == [0, 1, 2]
    copier = LatentCopier()
    llm.generate(ref.prompts, SamplingParams(max_tokens=2, temperature=0.0), on_step=copier)
    first_id = llm.requests.next_id - len(ref.prompts)
    assert sorted(copier.rows) == [first_id + k for k in range(len(ref.prompts))]
    for k, prompt in enumerate(ref.prompts):
        with torch.no_grad():
            cache = ref.hf(torch.tensor([prompt]), use_cache=True).past_key_values
        for layer, rows in enumerate(copier.rows[first_id + k]):
            c, k_rope = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]
            err_c = (rows[:, :rank] - c).abs().max().item()
            err_rope = (rows[:, rank:] - k_rope).abs().max().item()
            assert err_c < 1e-4, f"request {k} layer {layer}: c differs by {err_c}"
            assert err_rope < 1e-4, f"request {k} layer {layer}: k_rope differs by {err_rope}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_triton_kernels_under_the_interpreter(ref):
    """The engine on the Triton kernels (latent store and MLA attention under
    TRITON_INTERPRET=1 on CPU, set by conftest): transformers' greedy tokens."""
    prompts = [ref.prompts[2][:30], ref.prompts[0][:3]]  # a chunked one and a short one
    llm = _llm(ref, backend="triton", max_model_len=64, max_num_batched_tokens=16)
    assert llm.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(ref.hf, p, 8) for p in prompts]
