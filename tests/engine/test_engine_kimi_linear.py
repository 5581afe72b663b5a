"""Kimi-Linear through ``unikv.engine.LLM`` (fp32 CPU, torch reference kernels) against
transformers' ``KimiLinearForCausalLM`` on the same weights.

The tiny model: layers [KDA, MLA, KDA, KDA, MLA] (3 KDA heads of 12, conv 4; MLA 4
heads, kv_lora_rank 24, rope 8, nope 12, v 20), MLPs [dense, MoE, MoE, dense, MoE]
(4 experts in 2 groups, 2 per token, a shared expert). Its pool holds two sub-pools:
"mla" latent pages for the MLA layers and one "mamba" state slot per request for the
KDA layers (conv window and per-channel-decay delta-rule state), side by side.

- greedy tokens identical to transformers' ``generate`` for 24 new tokens over a
  batch of mixed prompt lengths, at page sizes 1, 4 and 16, and every sampled logit
  row within 1e-4 of transformers' teacher-forced logits;
- chunked prefill cutting prompts mid-way (7-token steps), and a tight pool that
  forces preemption: same tokens;
- the byte oracle, right after each request's prefill (whole and chunked): its state
  slot read from the raw pool buffer (offsets from the MambaSpec fields,
  ``test_engine_qwen3_5._slot_states``) equals transformers' cache ``conv_states`` /
  ``recurrent_states`` of every KDA layer, and its latent rows read through the MLA
  sub-pool's page views equal the cache's (c, k_rope) of every MLA layer;
- the Triton backend (interpreter on CPU) gives the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import VOCAB, assert_pages_returned, hf_greedy, hf_logits, one_thread  # noqa: F401
from test_engine_deepseek import LatentCopier
from test_engine_qwen3_5 import LogitRecorder, SlotCopier, _slot_states

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = [5, 17, 40]
NEW_TOKENS = 24
ATOL = 1e-4
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
               "full_attention"]  # fmt: skip
MLP_TYPES = ["dense", "sparse", "sparse", "dense", "sparse"]


def tiny_kimi_config(**overrides):
    import transformers as tf

    kw = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 4,
        "num_key_value_heads": 4, "kv_lora_rank": 24, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 12, "v_head_dim": 20, "q_lora_rank": None, "num_local_experts": 4,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "linear_head_dim": 12, "linear_num_heads": 3,
        "linear_conv_kernel_dim": 4, "layer_types": LAYER_TYPES, "mlp_layer_types": MLP_TYPES,
        "initializer_range": 0.1, "eos_token_id": None, "bos_token_id": None,
        "pad_token_id": None, "max_position_embeddings": 512,
    }  # fmt: skip
    kw.update(overrides)
    return tf.KimiLinearConfig(**kw)


def save_tiny_kimi(path: str, seed: int = 0, **overrides):
    """The tiny transformers Kimi-Linear (random init, a random router bias that
    matters for the choice; ``overrides``: config fields) saved to ``path``; returns it
    (fp32, eval)."""
    import transformers as tf

    torch.manual_seed(seed)
    hf = tf.AutoModelForCausalLM.from_config(tiny_kimi_config(**overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.05)
    hf.eval().save_pretrained(path)
    return hf


class Reference:
    def __init__(self, path: str) -> None:
        hf = save_tiny_kimi(path)
        self.hf, self.path = hf, path
        g = torch.Generator().manual_seed(7)
        self.prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
        self.greedy = [hf_greedy(hf, p, NEW_TOKENS) for p in self.prompts]
        self.kda = [i for i, t in enumerate(LAYER_TYPES) if t == "linear_attention"]
        self.mla = [i for i, t in enumerate(LAYER_TYPES) if t == "full_attention"]


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Reference:
    return Reference(str(tmp_path_factory.mktemp("kimi_linear")))


def _llm(ref: Reference, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_model_len", 96)
    kw.setdefault("page_size", 4)
    return LLM(ref.path, device="cpu", max_num_seqs=8, **kw)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_and_logits_match_transformers(ref, page_size):
    llm = _llm(ref, page_size=page_size)
    assert sorted(llm.pool.subpools) == ["mamba", "mla"]
    recorder = LogitRecorder()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outputs = llm.generate(ref.prompts, params, on_step=recorder)
    assert [o.output_ids for o in outputs] == ref.greedy
    first_id = llm.requests.next_id - len(outputs)
    for k, out in enumerate(outputs):
        full = hf_logits(ref.hf, out.prompt_ids + out.output_ids)  # (L, V), teacher-forced
        rows = {p: row for (rid, p), row in recorder.rows.items() if rid == first_id + k}
        assert len(rows) == NEW_TOKENS
        for p, row in rows.items():
            err = (row - full[p - 1]).abs().max().item()
            assert err < ATOL, f"request {k} position {p}: logits differ by {err}"
    assert_pages_returned(llm)


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    llm = _llm(ref, max_num_batched_tokens=7)
    outputs = llm.generate(ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in outputs] == ref.greedy
    assert llm.stats.steps > sum(PROMPT_LENS) // 7
    assert_pages_returned(llm)


def test_tight_pool_preempts_with_same_tokens(ref):
    """Six requests (the prompts twice) in a pool of 20 MLA pages + 2 state slots'
    bytes: requests are preempted (pages and slot freed, the prompt recomputed from a
    zeroed slot) and the tokens still match."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(ref.path, page_size=4, dtype=torch.float32)
    budget = pool_bytes_for(configs, {"mla": 20, "mamba": 2})
    llm = _llm(ref, kv_cache_bytes=budget, max_model_len=72)
    prompts = ref.prompts[::-1] + ref.prompts
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in outputs] == ref.greedy[::-1] + ref.greedy
    assert llm.stats.preemptions > 0
    assert_pages_returned(llm)


class BothCopier:
    """Step hook: after each request's prefill, its state slot's raw bytes and its
    latent rows (``SlotCopier`` and ``LatentCopier`` of the same step)."""

    def __init__(self) -> None:
        self.slots, self.latents = SlotCopier(), LatentCopier()

    def __call__(self, llm, batch, logits) -> None:
        self.slots(llm, batch, logits)
        self.latents(llm, batch, logits)


@pytest.mark.parametrize("max_batched", [64, 7])
def test_state_and_latent_bytes_match_transformers_cache(ref, max_batched):
    llm = _llm(ref, max_num_batched_tokens=max_batched)
    c = ref.hf.config
    mamba, mla = llm.pool.subpools["mamba"], llm.pool.subpools["mla"]
    width = c.linear_num_heads * c.linear_head_dim
    assert list(mamba.layers) == ref.kda and list(mla.layers) == ref.mla
    assert mamba.spec.conv[0].shape == (3 * width, c.linear_conv_kernel_dim)
    assert mamba.spec.temporal.shape == (c.linear_num_heads, c.linear_head_dim, c.linear_head_dim)
    assert mamba.spec.temporal.dtype == torch.float32
    assert mla.spec.kv_lora_rank == c.kv_lora_rank and mla.spec.rope_dim == c.qk_rope_head_dim
    copier = BothCopier()
    llm.generate(ref.prompts, SamplingParams(max_tokens=2, temperature=0.0), on_step=copier)
    first_id = llm.requests.next_id - len(ref.prompts)
    ids = [first_id + k for k in range(len(ref.prompts))]
    assert sorted(copier.slots.raw) == ids and sorted(copier.latents.rows) == ids
    rank = c.kv_lora_rank
    for k, prompt in enumerate(ref.prompts):
        with torch.no_grad():
            cache = ref.hf(torch.tensor([prompt]), use_cache=True).past_key_values
        convs, temporals = _slot_states(copier.slots.raw[ids[k]], mamba.spec)
        for j, layer in enumerate(ref.kda):
            want_conv = cache.layers[layer].conv_states[0][0]  # (3 H D, K), oldest first
            want_state = cache.layers[layer].recurrent_states[0][0]  # (H, Dk, Dv) fp32
            assert (convs[j] - want_conv).abs().max().item() < ATOL, (k, layer)
            assert (temporals[j] - want_state).abs().max().item() < ATOL, (k, layer)
        for j, layer in enumerate(ref.mla):
            rows = copier.latents.rows[ids[k]][j]
            c_rows, k_rope = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]
            assert (rows[:, :rank] - c_rows).abs().max().item() < ATOL, (k, layer)
            assert (rows[:, rank:] - k_rope).abs().max().item() < ATOL, (k, layer)
    assert_pages_returned(llm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_triton_kernels_under_the_interpreter(ref):
    """The engine on the Triton kernels (the per-channel delta rule, the conv, MLA
    under TRITON_INTERPRET=1): transformers' greedy tokens."""
    prompts = [ref.prompts[2][:20], ref.prompts[0][:3]]
    llm = _llm(ref, backend="triton", max_model_len=48, max_num_batched_tokens=16)
    assert llm.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(ref.hf, p, 6) for p in prompts]


def test_config_without_layer_types_reads_the_releases_linear_attn_config(tmp_path):
    """The released config.json names its layers in ``linear_attn_config`` (1-based);
    the pool specs and the model agree with transformers' reading of it."""
    import json

    from unikv.hf_config import model_specs_from_hf_config

    config = tiny_kimi_config().to_dict()
    config.pop("layer_types")
    config["linear_attn_config"] = {"full_attn_layers": [2, 5], "kda_layers": [1, 3, 4],
                                    "head_dim": 12, "num_heads": 3, "short_conv_kernel_size": 4}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    specs = model_specs_from_hf_config(str(tmp_path))
    assert specs.layer_kinds == ("mamba", "mla", "mamba", "mamba", "mla")
    assert {s.name: s.layers for s in specs.subpools} == {"mla": (1, 4), "mamba": (0, 2, 3)}
