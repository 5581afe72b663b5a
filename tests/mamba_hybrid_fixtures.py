"""Shared pieces of the Bamba, Granite-4.0-H and Zamba2 tests: tiny random-init
transformers models (odd shapes: attention heads of 12 / 24, 6 Mamba heads in 2
groups, state size 10, conv kernel 4, chunk size 16), the engine runs every family
file makes, and the byte oracle.

The byte oracle reads, right after a request's prefill, its Mamba state slot from
the pool's raw byte buffer (offsets derived here from transformers' own mixer
shapes: every Mamba layer's conv window (C, K), then every layer's SSM state (H, P,
N), fp32) and its K/V rows through the attention sub-pool's page views at the
physical pages the allocator reports, and compares both with transformers' cache
after the same prompt.
"""

from __future__ import annotations

import torch
from engine_fixtures import (
    VOCAB,
    GreedyReference,
    StepLogits,
    check_engine_outputs,
    state_slot_bytes,
)

from unikv.engine import LLM, SamplingParams

PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24

BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 40,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}
MAMBA = {"mamba_n_heads": 6, "mamba_n_groups": 2, "mamba_d_state": 10, "mamba_d_conv": 4}
MAMBA["mamba_chunk_size"] = 16


def save_hf(config, path: str, seed: int = 0):
    """A random-init fp32 transformers model of ``config`` (eager attention and
    experts) saved to ``path``, every Mamba ``D`` drawn away from its init (ones);
    returns it in eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mamba.D"):
                p.copy_(torch.randn(p.shape) * 0.5)
    model.eval().save_pretrained(path)
    return model


def bamba_config(**overrides):
    """5 layers, attention on 1 and 4 (GQA 4/2, head 12, rope on half of it)."""
    import transformers as tf

    kw = {**BASE, **MAMBA, "num_hidden_layers": 5, "attn_layer_indices": [1, 4]}
    kw.update(num_attention_heads=4, num_key_value_heads=2)
    return tf.BambaConfig(**{**kw, **overrides})


def granite_config(**overrides):
    """5 layers, attention on 1 and 4; every Granite multiplier away from 1; 4
    experts (top 2) beside a shared MLP of 24, rope attention."""
    import transformers as tf

    kw = {**BASE, **MAMBA, "num_hidden_layers": 5, "mamba_d_head": 16}
    kw.update(
        layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=24,
        position_embedding_type="rope",
        embedding_multiplier=3.0,
        attention_multiplier=0.09,
        residual_multiplier=0.6,
        logits_scaling=1.5,
    )
    return tf.GraniteMoeHybridConfig(**{**kw, **overrides})


def zamba2_config(**overrides):
    """6 layers, hybrid on 1, 3 and 4 over 2 shared blocks (layer 4 reuses layer 1's
    weights with its own adapters), q/k/v and MLP adapters of rank 8, rope; the
    shared attention is 96 wide, 4 heads of 24."""
    import transformers as tf

    kw = {**BASE, "num_hidden_layers": 6, "num_attention_heads": 4}
    kw.update(
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"],
        n_mamba_heads=6,
        mamba_ngroups=2,
        mamba_d_state=10,
        mamba_d_conv=4,
        chunk_size=16,
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        adapter_rank=8,
        use_mem_rope=True,
    )
    return tf.Zamba2Config(**{**kw, **overrides})


def reference(config, path: str) -> GreedyReference:
    """``config`` saved at ``path`` and transformers' greedy tokens for the prompts."""
    return GreedyReference(save_hf(config, path), path, PROMPT_LENS, NEW_TOKENS)


def hybrid_llm(ref: GreedyReference, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("page_size", 4)
    return LLM(ref.path, device="cpu", max_num_seqs=8, **kw)


def check_greedy(ref: GreedyReference, **kw) -> LLM:
    """The prompts together (mixed lengths): transformers' greedy tokens and every
    sampled logit row its teacher-forced one (1e-4)."""
    llm = hybrid_llm(ref, **kw)
    rows = StepLogits()
    outputs = llm.generate(
        ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=rows
    )
    check_engine_outputs(ref, llm, outputs, rows)
    return llm


def check_chunks(ref: GreedyReference) -> None:
    """7-token steps: every prompt but the shortest is cut mid-way, and the conv
    window and SSM state carried over each cut continue exactly."""
    llm = hybrid_llm(ref, max_num_batched_tokens=7)
    rows = StepLogits()
    outputs = llm.generate(
        ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=rows
    )
    assert rows.cut >= sum(n // 7 for n in PROMPT_LENS)
    check_engine_outputs(ref, llm, outputs, rows)


def check_preemption(ref: GreedyReference) -> None:
    """A pool of 24 attention pages of 4 tokens and 2 state slots for 115 prompt +
    96 output tokens: requests are preempted, their slots re-zeroed on readmission,
    and the recompute gives the same tokens."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(ref.path, page_size=4, dtype=torch.float32)
    budget = pool_bytes_for(configs, {"full": 24, "mamba": 2})
    llm = hybrid_llm(ref, kv_cache_bytes=budget, max_model_len=96)
    outputs = llm.generate(ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert llm.stats.preemptions > 0
    check_engine_outputs(ref, llm, outputs)


class PrefillCapture:
    """Step hook: right after the step that completes a request's prefill, a copy of
    its state slot's raw bytes and of its K/V rows of every attention layer."""

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.state: dict[int, torch.Tensor] = {}  # prompt length -> raw slot bytes
        self.kv: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, llm, batch, logits) -> None:
        for r in batch.requests:
            if r.num_cached != len(r.prompt_ids) or len(r.output_ids) != 1:
                continue
            n = len(r.prompt_ids)
            self.state[n] = state_slot_bytes(llm, r.slot, self.slot_bytes)
            cols, phys = llm.alloc.request_pages(r.slot)["full"]
            sub = llm.pool["full"]
            page_of = dict(zip(cols.tolist(), phys.tolist()))
            pos = torch.arange(n)
            where = torch.tensor([page_of[p // sub.page_size] for p in range(n)])
            self.kv[n] = {}
            for index, layer in enumerate(sub.layers):
                k, v = sub.paged_views[index]
                rows = (k[where, pos % sub.page_size], v[where, pos % sub.page_size])
                self.kv[n][layer] = tuple(x.clone() for x in rows)


def _hf_mixers(hf) -> dict[int, torch.nn.Module]:
    """transformers' Mamba-2 mixers by model layer (the modules owning a conv1d)."""
    out = {}
    for name, module in hf.named_modules():
        if isinstance(getattr(module, "conv1d", None), torch.nn.Conv1d):
            out[int(name.split("layers.")[1].split(".")[0])] = module
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32 agreement relative to the state's scale."""
    return bool((got - want).abs().max() <= 1e-5 * want.abs().max())


def check_prefill_bytes(ref: GreedyReference, attention_layers: list[int]) -> None:
    """After each request's prefill (and a 2-token prompt, shorter than the conv
    kernel): its state slot holds transformers' conv window and SSM state of every
    Mamba layer, and its K/V rows transformers' cached keys (rope applied) and values
    of every attention layer."""
    mixers = _hf_mixers(ref.hf)
    layers = sorted(mixers)
    m = mixers[layers[0]]
    conv_shape = tuple(m.conv1d.weight.shape[::2])  # (C, K)
    ssm_shape = (m.num_heads, m.head_dim, m.ssm_state_size)
    conv_bytes = 4 * conv_shape[0] * conv_shape[1]
    ssm_bytes = 4 * ssm_shape[0] * ssm_shape[1] * ssm_shape[2]
    capture = PrefillCapture(len(layers) * (conv_bytes + ssm_bytes))
    prompts = [*ref.prompts, [3, 141]]
    llm = hybrid_llm(ref)
    assert llm.pool["mamba"].page_bytes == capture.slot_bytes
    assert list(llm.pool["mamba"].layers) == layers
    assert list(llm.pool["full"].layers) == attention_layers
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), on_step=capture)
    assert sorted(capture.state) == sorted(map(len, prompts)) and llm.stats.preemptions == 0
    for prompt in prompts:
        n = len(prompt)
        with torch.no_grad():
            cache = ref.hf(torch.tensor([prompt]), use_cache=True).past_key_values
        raw = capture.state[n]
        for j, layer in enumerate(layers):
            conv = raw[j * conv_bytes : (j + 1) * conv_bytes].view(torch.float32)
            start = len(layers) * conv_bytes + j * ssm_bytes
            ssm = raw[start : start + ssm_bytes].view(torch.float32)
            want_conv = cache.layers[layer].conv_states[0][0]  # (C, K)
            want_ssm = cache.layers[layer].recurrent_states[0][0]  # (H, P, N)
            assert want_conv.dtype == want_ssm.dtype == torch.float32
            assert _close(conv.view(conv_shape), want_conv), (n, layer)
            assert _close(ssm.view(ssm_shape), want_ssm), (n, layer)
            assert want_ssm.abs().max() > 1e-4  # a state that took the prompt in
            if n < conv_shape[1]:
                assert not want_conv[:, : conv_shape[1] - n].any()
        for layer in attention_layers:
            keys, values = capture.kv[n][layer]
            hf_k = cache.layers[layer].keys[0].transpose(0, 1)  # (n, H, D)
            hf_v = cache.layers[layer].values[0].transpose(0, 1)
            assert hf_k.shape == keys.shape == (n, *hf_k.shape[1:])
            assert (keys - hf_k).abs().max() < 1e-5, (n, layer)
            assert (values - hf_v).abs().max() < 1e-5, (n, layer)
