"""LFM2 through ``unikv.engine.LLM`` (fp32 CPU, torch reference kernels) against
transformers' ``Lfm2ForCausalLM`` (eager) on the same weights.

The tiny model has odd shapes: hidden 48, 4 query heads of 12 over 2 KV heads,
layers [conv, conv, full, conv, full, conv], short convs of 3 taps with biases, a
feed-forward width derived by transformers' rule (2/3 of 108, rounded up to a
multiple of 8: 72), untied embeddings (a tiny tied model mostly repeats its last
token) and every norm weight drawn away from its init (ones).

Its pool has a "full" K/V sub-pool and a "mamba" sub-pool of conv-only slots (a
``MambaSpec`` without a temporal part): one slot per request, 4 layers x (48, 3).

- greedy tokens equal transformers' ``generate`` for 24 new tokens over a batch of
  prompts of 5, 17, 33 and 60 tokens at page sizes 1, 4 and 16, every sampled logit
  row within 1e-4 of transformers' teacher-forced logits;
- 7-token steps cutting prompts mid-way; a tight pool that preempts;
- the byte oracle: right after prefill, each request's conv slot and K/V rows read
  from the raw pool buffer (offsets written out from the config's fields) equal
  transformers' cache (``conv_states``; ``keys``/``values``), a 2-token prompt
  (shorter than the window) checking the zero left padding;
- the capacity oracle counts the slot: a spec with no temporal part sizes it as
  its conv parts alone;
- the Triton ops under the interpreter, and prefix-cache hits restoring a
  checkpoint of the conv-only slot: same tokens.
"""

from __future__ import annotations

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
)
from family_fixtures import LFM2_LAYERS, AfterPrefill, kv_rows, save_tiny_lfm2, state_slot

from unikv.engine import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp("lfm2"))
    return GreedyReference(save_tiny_lfm2(path), path, PROMPT_LENS, NEW_TOKENS)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size):
    from unikv.models.lfm2 import Lfm2ForCausalLM

    llm = engine_llm(ref, page_size=page_size)
    assert isinstance(llm.model, Lfm2ForCausalLM)
    assert sorted(llm.pool.subpools) == ["full", "mamba"]
    assert llm.pool.subpools["mamba"].spec.temporal is None  # a conv-only slot
    assert llm.model.model.layers[0].feed_forward.down_proj.in_features == 72
    check_greedy_run(ref, llm)


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    check_chunked_prefill(ref, engine_llm)


def test_tight_pool_preempts_with_same_tokens(ref):
    check_tight_pool(ref, tight_llm)


def tight_llm(ref, kv_cache_bytes, **kw):
    """``engine_llm`` with 24 full pages + 2 slots' bytes (24 slots would never preempt)."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(ref.path, page_size=4, dtype=torch.float32)
    return engine_llm(ref, kv_cache_bytes=pool_bytes_for(configs, {"full": 24, "mamba": 2}), **kw)


def test_conv_slot_and_kv_bytes_match_transformers_cache(ref):
    c = ref.hf.config
    conv_layers = [i for i, t in enumerate(LFM2_LAYERS) if t == "conv"]
    full_layers = [i for i, t in enumerate(LFM2_LAYERS) if t == "full_attention"]
    conv_bytes = c.hidden_size * c.conv_L_cache * 4  # fp32, (C, K) per layer
    slot_bytes = len(conv_layers) * conv_bytes  # no temporal part
    heads, d = c.num_key_value_heads, c.hidden_size // c.num_attention_heads

    def grab(llm, r):
        return state_slot(llm, r, slot_bytes), kv_rows(llm, r, "full", heads, d, torch.float32)

    copier = AfterPrefill(grab)
    llm = engine_llm(ref, max_num_batched_tokens=7)
    assert llm.pool["mamba"].page_bytes == slot_bytes
    prompts = [*ref.prompts, [3, 141]]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), on_step=copier)
    assert sorted(copier.seen) == sorted(map(len, prompts)) and llm.stats.preemptions == 0
    for prompt in prompts:
        with torch.no_grad():
            cache = ref.hf(torch.tensor([prompt]), use_cache=True).past_key_values
        raw, rows = copier.seen[len(prompt)]
        for j, layer in enumerate(conv_layers):
            conv = raw[j * conv_bytes : (j + 1) * conv_bytes].view(torch.float32)
            want = cache.layers[layer].conv_states[0][0]  # (C, K), oldest first
            assert want.shape == (c.hidden_size, c.conv_L_cache)
            torch.testing.assert_close(conv.view(want.shape), want, atol=1e-5, rtol=1e-5)
            if len(prompt) < c.conv_L_cache:
                assert not want[:, : c.conv_L_cache - len(prompt)].any()
        assert sorted(rows) == full_layers
        for layer, (pos, keys, values) in rows.items():
            assert pos.tolist() == list(range(len(prompt)))
            hf_k = cache.layers[layer].keys[0].transpose(0, 1)  # (L, H, D), rope applied
            hf_v = cache.layers[layer].values[0].transpose(0, 1)
            torch.testing.assert_close(keys, hf_k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(values, hf_v, atol=1e-5, rtol=1e-5)


def test_the_capacity_oracle_counts_the_conv_only_slot(ref):
    """The pool of LFM2's config in bf16, sized by hand from the config's fields: a
    slot is the conv windows alone (4 layers x 48 x 3 x 2 B = 1152 B), a page 4
    tokens x 2 layers x 2 KV heads x (12 + 12) x 2 B = 768 B; the sink is one slot.
    In 10 slots' bytes: 9 slots, or 13 pages (15 minus the 2 the sink spans)."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import UnifiedPool, worst_case_pages

    c = ref.hf.config
    slot = LFM2_LAYERS.count("conv") * c.hidden_size * c.conv_L_cache * 2
    page = 4 * LFM2_LAYERS.count("full_attention") * c.num_key_value_heads * 2 * 12 * 2
    assert (slot, page) == (1152, 768)
    configs = specs_from_hf_config(ref.path, page_size=4, dtype=torch.bfloat16)
    state = next(s.spec for s in configs if s.name == "mamba")
    assert state.parts == ("conv0",) and state.entry_bytes == slot
    assert worst_case_pages(state, 1, 1000) == 1  # one slot, whatever the length
    pool = UnifiedPool(configs, 10 * slot, device="meta")
    assert pool.sink_bytes == slot
    assert pool.fits({"mamba": 9}) and not pool.fits({"mamba": 10})
    assert pool.fits({"full": 13}) and not pool.fits({"full": 14})


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_triton_kernels_under_the_interpreter(ref):
    """The engine on the Triton ops (TRITON_INTERPRET=1 on CPU, set by conftest): the
    causal conv with a bias and no activation over a conv-only slot, chunked."""
    prompts = [ref.prompts[2][:20], ref.prompts[0][:3]]  # a chunked one and a short one
    llm = engine_llm(ref, backend="triton", max_model_len=48, max_num_batched_tokens=12)
    assert llm.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(ref.hf, p, 8) for p in prompts]


def test_prefix_cache_hits_restore_the_conv_only_slot(ref):
    """Prefix caching on: a hit restores a checkpoint of the conv-only slot (a copy of
    its bytes) and the tokens stay transformers', with every whole page reused."""
    from prefix_fixtures import run_without_and_with_cache

    run = run_without_and_with_cache(ref.path, ref.hf, 4, 8, seed=3)
    assert run.llm.alloc.prefix.counters()["checkpoints"] > 0
    run.llm.alloc.check_integrity()
