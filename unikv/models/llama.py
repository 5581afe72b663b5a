"""Decoder-only causal LMs in the Llama layout: Llama 3, Qwen2, Qwen3 (q/k
norm), Mistral (sliding window), and, with a MoE block, gpt-oss.

Module names mirror transformers (``model.layers.i.self_attn.q_proj`` ...), so
a checkpoint's state dict loads by name (q/k/v and gate/up concatenated into one
GEMM each at load, ``layers.Attention``). Tokens of a step are flattened:
``input_ids`` and ``positions`` are (T,) over all requests of the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from unikv.kernels.backend import KernelBackend, building, resolve_feedback
from unikv.models.config import ModelConfig
from unikv.models.layers import (
    Attention,
    AttentionFn,
    GatedMLP,
    Linear,
    RMSNorm,
    overrides_forward,
)
from unikv.models.rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, rotary: Rotary, mlp: nn.Module, tp=None
    ) -> None:
        super().__init__()
        fp32_norm = config.family == "gpt_oss"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp32_norm)
        self.self_attn = Attention(config, layer, rotary, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp32_norm)
        self.mlp = mlp
        # each pre-norm inside the GEMM after it (the backend's add_rms_norm_linear), where
        # that GEMM is a plain ``Linear`` of the stock blocks (not a subclass's, not tp)
        self.fuse_qkv = type(self.self_attn.qkv_proj) is Linear
        self.fuse_mlp = (isinstance(mlp, GatedMLP) and not overrides_forward(mlp, GatedMLP)
                         and type(mlp.gate_up_proj) is Linear)  # fmt: skip

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: (T, hidden), the previous block's output (the embeddings for the
        first layer, whose ``residual`` is None); residual: (T, hidden), the sum
        of the outputs before it. Returns (this layer's MLP output, the residual
        stream before it): each residual add is fused into the next norm."""
        if self.fuse_qkv:
            qkv, residual = self.input_layernorm.linear(h, residual, self.self_attn.qkv_proj)
            return self.after_qkv(qkv, residual, positions, attn)
        if residual is None:  # the first layer: a structural None, not a device branch
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm.add(h, residual)
        return self._mlp(self.self_attn(h, positions, attn), residual)

    def after_qkv(
        self, qkv: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its fused q|k|v projection on (``fuse_qkv``): attention and
        the MLP; returns what ``forward`` returns."""
        return self._mlp(self.self_attn.attend(qkv, positions, attn), residual)

    def _mlp(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fuse_mlp:
            gate_up, residual = self.post_attention_layernorm.linear(
                h, residual, self.mlp.gate_up_proj
            )
            return self.mlp.down(gate_up), residual
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        make_mlp: Callable[..., nn.Module],
        max_positions: int,
        tp=None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = Rotary(config.rope, config.head_dim, max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary, make_mlp(config, tp), tp)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.family == "gpt_oss")


class CausalLM(nn.Module):
    """A causal LM over unikv's paged attention.

    Args:
        config: the model's hyper-parameters.
        max_positions: length of the rope table (the engine's max context).
        tp: None, or a ``models.parallel.TensorParallel``: this rank's shard of
            every layer (embeddings and lm_head replicated).
        ops: the kernel backend every module calls, fixed at construction (None: the
            enclosing ``backend.building``'s, the torch references outside any).

    ``logits_dtype``: the dtype ``forward`` returns logits in (fp32 by default);
    None keeps lm_head's (the model dtype), so that a greedy argmax needs no
    full-vocabulary fp32 copy. Set once, before the step runs.

    ``resolves_feedback``: ``forward`` reads ``attn.feedback`` when the attention has
    one (a step planner's buffer of the previous step's tokens, in one request's
    decode graphs): placeholder ids -(1 + lane) are the tokens there, resolved inside
    the first GEMV's gather, and a greedy step writes its tokens into it.
    """

    resolves_feedback = True

    def __init__(
        self, config: ModelConfig, max_positions: int, tp=None, *, ops: KernelBackend | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        if config.family == "gpt_oss":
            from unikv.models.gpt_oss import MoE as make_mlp
        else:
            make_mlp = GatedMLP
        with building(ops):
            self.model = Backbone(config, make_mlp, max_positions, tp)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_dtype: torch.dtype | None = torch.float32

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        logits_indices: torch.Tensor | None = None,
        greedy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids: (T,) int64 token ids; positions: (T,) int64;
        logits_indices: (N,) int64 rows of the step whose logits are wanted
        (None: all). Returns logits (N, vocab) in ``logits_dtype`` (fp32 unless set);
        greedy: (logits, (N,) int64 greedy tokens), the argmax of the logits as
        lm_head wrote them, inside its GEMV where the backend runs one (into
        ``attn.feedback`` when the attention has one: ``resolves_feedback``)."""
        layers = self.model.layers
        feedback = getattr(attn, "feedback", None)  # placeholder ids' tokens (graphs)
        if layers[0].fuse_qkv:  # the embedding inside the first q|k|v GEMM's loads
            first = layers[0]
            qkv, residual = first.input_layernorm.embed_linear(
                input_ids, self.model.embed_tokens.weight, first.self_attn.qkv_proj, feedback
            )
            h, residual = first.after_qkv(qkv, residual, positions, attn)
            layers = layers[1:]
        else:
            h = self.model.embed_tokens(resolve_feedback(input_ids, feedback))
            residual = None
        for layer in layers:
            h, residual = layer(h, residual, positions, attn)
        if logits_indices is not None:
            h, residual = (
                h.index_select(0, logits_indices),
                residual.index_select(0, logits_indices),
            )
        if not greedy:
            logits, _ = self.model.norm.linear(h, residual, self.lm_head)
            return logits if self.logits_dtype is None else logits.to(self.logits_dtype)
        out = None if feedback is None else feedback[: h.shape[0]]  # where the step reads it
        logits, tokens = self.model.norm.linear_argmax(h, residual, self.lm_head, out)
        return (logits if self.logits_dtype is None else logits.to(self.logits_dtype)), tokens
