"""Shared fixtures of the engine tests: tiny random-initialised transformers
models saved to a temp dir, and transformers' own greedy tokens and logits.

The models are transformers' (``AutoModelForCausalLM.from_config``), so every
comparison checks unikv against an independent implementation of the same
architecture. ``initializer_range`` is raised from 0.02 so that the logits of
a random model are not near-uniform (near-ties would make greedy comparisons
depend on rounding, not on correctness).
"""

from __future__ import annotations

import pytest
import torch

from unikv.engine.demo import hf_greedy  # noqa: F401  (re-exported for the engine tests)

VOCAB = 256
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def tiny_hf_config(arch: str, **overrides):
    """A tiny transformers config of ``arch`` (llama, qwen2, qwen3, mistral, gpt_oss)."""
    import transformers as tf

    kw = dict(TINY)
    if arch == "llama":
        kw["rope_parameters"] = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        cls = tf.LlamaConfig
    elif arch == "qwen2":
        cls = tf.Qwen2Config
    elif arch == "qwen3":
        kw.update(head_dim=32, tie_word_embeddings=True, num_hidden_layers=3)
        cls = tf.Qwen3Config
    elif arch == "mistral":
        kw.update(sliding_window=7)
        cls = tf.MistralConfig
    elif arch == "gpt_oss":
        kw.update(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=6,
            num_hidden_layers=4,
            intermediate_size=64,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=128,
            ),
        )
        cls = tf.GptOssConfig
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cls(**kw)


def save_tiny_model(arch: str, path: str, seed: int = 0, **overrides):
    """Build a random-init transformers model of ``arch``, save it to ``path``,
    return the (fp32, eval) transformers model."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_hf_config(arch, **overrides)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path)
    return model


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' fp32 logits (len(tokens), vocab) of one full forward."""
    with torch.no_grad():
        return model(torch.tensor([tokens], device=model.device)).logits[0].float().cpu()


def dense_attention(q, k, v, window, sinks, sm_scale):
    """Contiguous causal attention of one sequence, written from the definition.

    q: (T, Hq, D), k/v: (T, H, D); window None or W; sinks None or (Hq,)."""
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.einsum("thd,shd->hts", q, k) * sm_scale
    pos = torch.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks[:, None, None].expand(hq, t, 1)], dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)[..., :t]
    return torch.einsum("hts,shd->thd", probs, v.float()).to(q.dtype)


class DenseAttention:
    """An ``AttentionFn`` for one whole sequence with no cache (model tests)."""

    def __init__(self, windows, sm_scale):
        self.windows, self.sm_scale = windows, sm_scale

    def __call__(self, layer, q, k, v, sinks=None):
        return dense_attention(q, k, v, self.windows[layer], sinks, self.sm_scale)


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread avoids
    oversubscription (10x faster here); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
