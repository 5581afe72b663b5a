"""The tiny models of the Qwen3.5-MoE, Qwen3.5 and Gemma-3 multimodal and LFM2 tests
(CPU and GPU), and the byte oracles they share: a request's
cached state read from the pool's raw byte buffer, at offsets written out here from
the layout law of docs/design.md section 2 and the config's own fields (not from the
specs' offset methods), right after the step that finished its prefill.

    attention row (t, l, K) = page * page_bytes + ps * l * (row_k + row_v) + (t % ps) * row_k
    attention row (t, l, V) = page * page_bytes + ps * (l * (row_k + row_v) + row_k) + (t % ps) * row_v
    state slot s            = buffer[s * slot_bytes : (s + 1) * slot_bytes]
"""

from __future__ import annotations

import torch
from engine_fixtures import VOCAB, save_random_model, tiny_gemma_config, tiny_hybrid_config


def kv_rows(llm, request, name: str, heads: int, head_dim: int, dtype) -> dict:
    """Model layer -> (positions (n,), K (n, H, D), V (n, H, D)) of ``request``'s prompt
    rows still bound in attention sub-pool ``name`` (H KV heads of width D, dtype),
    copied from ``llm.pool.buffer`` byte by byte."""
    sub = llm.pool.subpools[name]
    item = torch.empty((), dtype=dtype).element_size()
    row = heads * head_dim * item
    layers, ps = list(sub.layers), sub.page_size
    page_bytes = ps * len(layers) * 2 * row
    cols, phys = llm.alloc.request_pages(request.slot)[name]
    page_of = dict(zip(cols.tolist(), phys.tolist()))
    positions = [p for p in range(len(request.prompt_ids)) if p // ps in page_of]
    buffer = llm.pool.buffer
    out = {}
    for j, layer in enumerate(layers):
        keys, values = [], []
        for p in positions:
            base = page_of[p // ps] * page_bytes + ps * j * 2 * row
            k = base + (p % ps) * row
            v = base + ps * row + (p % ps) * row
            keys.append(buffer[k : k + row].clone().view(dtype).view(heads, head_dim))
            values.append(buffer[v : v + row].clone().view(dtype).view(heads, head_dim))
        out[layer] = (torch.tensor(positions), torch.stack(keys), torch.stack(values))
    return out


def state_slot(llm, request, slot_bytes: int) -> torch.Tensor:
    """A copy of ``request``'s recurrent-state slot: physical slot s of the state
    sub-pool lies at byte ``s * slot_bytes`` of the buffer."""
    phys = int(llm.alloc.mamba_slots(torch.tensor([request.slot])).data[0])
    assert phys > 0, "slot 0 is the sink"
    return llm.pool.buffer[phys * slot_bytes : (phys + 1) * slot_bytes].clone()


class AfterPrefill:
    """``on_step`` hook: ``grab(llm, request)`` for every request right after the step
    that finished its prefill (before a decode step touches its state), by prompt length."""

    def __init__(self, grab) -> None:
        self.grab, self.seen = grab, {}

    def __call__(self, llm, batch, logits) -> None:
        for r in batch.requests:
            if r.num_cached == len(r.prompt_ids) and len(r.output_ids) == 1:
                self.seen[len(r.prompt_ids)] = self.grab(llm, r)


# -- the tiny models of this issue's families (transformers' own, random-init, fp32) ------


MOE = {
    "num_experts": 5,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40,
}


def tiny_qwen3_5_moe_config(**overrides):
    """Qwen3.5's tiny text config as a ``Qwen3_5MoeTextConfig`` plus ``MOE``."""
    import transformers as tf

    fields = tiny_hybrid_config("qwen3_5").to_dict()
    kept = {k: fields[k] for k in ("rope_parameters", "layer_types", "head_dim")}
    names = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    names += ("num_key_value_heads", "max_position_embeddings", "initializer_range")
    names += tuple(k for k in fields if k.startswith("linear_"))
    kept.update({k: fields[k] for k in names})
    kept.update(eos_token_id=None, bos_token_id=None, pad_token_id=None, **{**MOE, **overrides})
    return tf.Qwen3_5MoeTextConfig(**kept)


def save_tiny_qwen3_5_moe(path: str, seed: int = 0):
    """A random-init transformers Qwen3_5MoeForCausalLM (``tiny_qwen3_5_moe_config``,
    eager attention) saved to ``path``; returns the fp32 eval model."""
    config = tiny_qwen3_5_moe_config()
    config._attn_implementation = "eager"
    return save_random_model(config, path, seed)


def save_tiny_qwen3_5_mm(path: str, moe: bool = False, seed: int = 0):
    """A random-init transformers ``Qwen3_5ForConditionalGeneration`` (or, with ``moe``,
    ``Qwen3_5MoeForConditionalGeneration``), as the released checkpoints are: the tiny
    text decoder under ``model.language_model.`` beside a one-block vision tower, saved
    to ``path``; returns the fp32 eval wrapper."""
    import transformers as tf

    mod = tf.models.qwen3_5_moe.configuration_qwen3_5_moe if moe else (
        tf.models.qwen3_5.configuration_qwen3_5)  # fmt: skip
    vision = (mod.Qwen3_5MoeVisionConfig if moe else mod.Qwen3_5VisionConfig)(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=4, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16,
    )  # fmt: skip
    text = tiny_qwen3_5_moe_config() if moe else tiny_hybrid_config("qwen3_5")
    config = (tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config)(
        text_config=text.to_dict(), vision_config=vision.to_dict()
    )
    torch.manual_seed(seed)
    wrapper = tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration
    hf = wrapper(config).eval()
    hf.save_pretrained(path)
    return hf


def save_tiny_gemma3_mm(path: str, seed: int = 0):
    """A random-init transformers Gemma3ForConditionalGeneration (one-layer SigLIP
    tower) saved to ``path``; the fp32 eval wrapper with eager attention."""
    import transformers as tf

    text = tiny_gemma_config("gemma3", tie_word_embeddings=False)
    vision = tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8,
    )  # fmt: skip
    config = tf.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration._from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape) * 0.5)
    model.eval().save_pretrained(path)
    return model


LFM2_LAYERS = ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]


def save_tiny_lfm2(path: str, seed: int = 0):
    import transformers as tf

    config = tf.Lfm2Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=108, num_hidden_layers=len(LFM2_LAYERS),
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        layer_types=list(LFM2_LAYERS), conv_L_cache=3, conv_bias=True, block_multiple_of=8,
        initializer_range=0.1, tie_word_embeddings=False, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape) * 0.5)
    model.eval().save_pretrained(path)
    return model
