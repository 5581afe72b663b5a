"""MiMo-V2-Flash through ``unikv.engine.LLM`` (fp32 CPU, torch reference kernels)
against transformers' eager ``MiMoV2FlashForCausalLM`` on the same weights.

The tiny model (``tiny_mimo_config``: 7 layers, full on layers 0 and 5 as
transformers' default pattern puts them, sliding elsewhere with window 7; K heads
of 36 and V heads of 20, 1 KV head on full layers and 2 on sliding ones, 4 query
heads; partial rope, 12 of 36 dims, with a different base per layer type;
attention sinks and value scale 0.707; a dense first layer, then 4 routed experts
in 2 groups, top 2, DeepSeek-V3 routing with a correction bias) holds two
sub-pools of asymmetric K/V: "full" and "swa" (pages freed as tokens leave the
window, which is a multiple of no page size).

- greedy tokens identical to transformers' ``generate`` for 24 new tokens over
  prompts of 5, 17, 33 and 60 tokens, at page sizes 1, 4 and 16, and every sampled
  logit row within 1e-4 of transformers' teacher-forced logits;
- chunked prefill cutting prompts mid-way (7-token steps), and a tight pool that
  forces preemption by recompute: same tokens;
- the byte oracle: right after a request's prefill, its K and V rows read through
  the pool's (page, slot) views at the physical pages the allocator reports equal
  transformers' own cache (rotated k, scaled v; the window's tail for sliding layers);
- the Triton kernels (under the interpreter on CPU): same tokens.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import (
    TINY,
    GreedyReference,
    check_chunked_prefill,
    check_greedy_run,
    check_tight_pool,
    engine_llm,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
)

from unikv.engine import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24
WINDOW = 7
FULL_LAYERS, SWA_LAYERS = (0, 5), (1, 2, 3, 4, 6)  # transformers' default pattern, 7 layers


def tiny_mimo_config(**overrides):
    """A tiny transformers ``MiMoV2FlashConfig`` with odd shapes (module docstring)."""
    import transformers as tf

    kw = dict(TINY)
    kw.update(
        num_hidden_layers=7,
        num_key_value_heads=1,
        head_dim=36,
        v_head_dim=20,
        sliding_window=WINDOW,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.0,
        attention_value_scale=0.707,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},  # factor 0.334
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.334,
            },
        },
    )
    kw.update(overrides)
    return tf.MiMoV2FlashConfig(**kw)


def save_tiny_mimo(path: str, seed: int = 0, **overrides):
    """A random-init transformers MiMo-V2-Flash (``tiny_mimo_config``) saved to
    ``path``; returns the fp32 eval model (eager attention and experts). The sinks,
    the routers' correction bias and the norm weights are drawn away from their
    init so that each bites."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(
        tiny_mimo_config(**overrides),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("e_score_correction_bias", "sinks")):
                p.copy_(torch.randn(p.shape))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    model.eval().save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp("mimo_v2_flash"))
    return GreedyReference(save_tiny_mimo(path), path, PROMPT_LENS, NEW_TOKENS)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size):
    llm = engine_llm(ref, page_size=page_size)
    full, swa = llm.pool.subpools["full"], llm.pool.subpools["swa"]
    assert sorted(llm.pool.subpools) == ["full", "swa"]
    assert (full.layers, swa.layers) == (FULL_LAYERS, SWA_LAYERS)
    facts = [(s.spec.num_kv_heads, s.spec.head_dim, s.spec.v_head_dim) for s in (full, swa)]
    assert facts == [(1, 36, 20), (2, 36, 20)]
    assert swa.spec.sliding_window == WINDOW and full.spec.sliding_window is None
    check_greedy_run(ref, llm)


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    """7-token steps: prompts are split across steps (and share steps with other
    requests' chunks and decodes)."""
    check_chunked_prefill(ref, engine_llm)


def test_tight_pool_preempts_with_same_tokens(ref):
    """Eight requests (the prompts twice) in a pool of 24 pages per sub-pool:
    requests are preempted and recomputed, and the tokens still match."""
    check_tight_pool(ref, engine_llm)


class RowCopier:
    """Step hook: each request's K and V rows (every layer of every sub-pool, the
    prompt positions still bound) right after the step that completed its prefill,
    read through the (page, slot) views at the physical pages the allocator reports."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, llm, batch, logits) -> None:
        for r in batch.requests:
            if r.slot is None or r.num_cached != len(r.prompt_ids) or r.output_ids[1:]:
                continue
            pages = llm.alloc.request_pages(r.slot)
            per_layer = {}
            for name, sub in llm.pool.subpools.items():
                cols, phys = pages[name]
                ps = sub.page_size
                page_of = dict(zip(cols.tolist(), phys.tolist()))
                pos = torch.tensor([p for p in range(len(r.prompt_ids)) if p // ps in page_of])
                where = torch.tensor([page_of[p // ps] for p in pos.tolist()])
                for index, layer in enumerate(sub.layers):
                    k, v = sub.paged_views[index]
                    per_layer[layer] = (pos, k[where, pos % ps].clone(), v[where, pos % ps].clone())
            self.rows[r.request_id] = per_layer


def test_kv_rows_match_transformers_cache(ref):
    """Each request's pool rows hold transformers' cached keys (rope applied) and
    values (scaled) of every layer: all prompt positions for full layers, the last
    W - 1 (what transformers' sliding cache keeps) for sliding layers."""
    llm = engine_llm(ref, page_size=4)
    copier = RowCopier()
    llm.generate(ref.prompts, SamplingParams(max_tokens=2, temperature=0.0), on_step=copier)
    first_id = llm.requests.next_id - len(ref.prompts)
    assert sorted(copier.rows) == [first_id + k for k in range(len(ref.prompts))]
    for k, prompt in enumerate(ref.prompts):
        with torch.no_grad():
            cache = ref.hf(torch.tensor([prompt]), use_cache=True).past_key_values
        for layer, (pos, keys, values) in copier.rows[first_id + k].items():
            hf_k = cache.layers[layer].keys[0].transpose(0, 1)  # (kept, H, D)
            hf_v = cache.layers[layer].values[0].transpose(0, 1)  # (kept, H, Dv)
            kept = hf_k.shape[0]
            assert kept == (len(prompt) if layer in FULL_LAYERS else min(len(prompt), WINDOW - 1))
            tail = pos >= len(prompt) - kept  # positions transformers still caches
            assert int(tail.sum()) == kept, f"request {k} layer {layer}: a needed page was freed"
            err_k = (keys[tail] - hf_k).abs().max().item()
            err_v = (values[tail] - hf_v).abs().max().item()
            assert err_k < 1e-5 and err_v < 1e-5, f"request {k} layer {layer}: {err_k}, {err_v}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_triton_kernels_under_the_interpreter(ref):
    """The engine on the Triton kernels (TRITON_INTERPRET=1 on CPU, set by conftest):
    decode and extend with asymmetric heads, the window and the sinks."""
    prompts = [ref.prompts[2][:20], ref.prompts[0][:3]]  # a chunked one and a short one
    llm = engine_llm(ref, backend="triton", max_model_len=48, max_num_batched_tokens=12)
    assert llm.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(ref.hf, p, 8) for p in prompts]
