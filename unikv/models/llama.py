"""Decoder-only causal LMs in the Llama layout: Llama 3, Qwen2, Qwen3 (q/k
norm), Mistral (sliding window), and, with a MoE block, gpt-oss.

Module names mirror transformers (``model.layers.i.self_attn.q_proj`` ...), so
a checkpoint's state dict loads by name (q/k/v and gate/up concatenated into one
GEMM each at load, ``layers.Attention``). Tokens of a step are flattened:
``input_ids`` and ``positions`` are (T,) over all requests of the batch.
"""

from __future__ import annotations

from torch import nn

from unikv.models.config import ModelConfig
from unikv.models.decoder import Backbone, Block, DecoderLM
from unikv.models.decoder import DecoderLayer as _Layer
from unikv.models.layers import Attention, GatedMLP, RMSNorm
from unikv.models.rope import Rotary


class DecoderLayer(_Layer):
    """Attention then an MLP, each behind a pre-norm (``decoder.Block``): each pre-norm
    inside the GEMM after it where that GEMM is a plain ``Linear`` of the stock blocks
    (not a subclass's, not tp). ``mlp_name``: the MLP's checkpoint name."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: Rotary,
        mlp: nn.Module,
        tp=None,
        mlp_name: str = "mlp",
    ) -> None:
        super().__init__()
        fp32_norm = config.family == "gpt_oss"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp32_norm)
        self.self_attn = Attention(config, layer, rotary, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp32_norm)
        self.add_module(mlp_name, mlp)
        self.blocks = [
            Block(self.input_layernorm, self.self_attn, mixes=True),
            Block(self.post_attention_layernorm, mlp, mixes=False),
        ]

    @property
    def fuse_qkv(self) -> bool:
        return self.blocks[0].linear is not None

    @property
    def fuse_mlp(self) -> bool:
        return self.blocks[1].linear is not None


class CausalLM(DecoderLM):
    """A causal LM over unikv's paged attention in the Llama layout (``decoder.DecoderLM``:
    the fused fast path and tensor parallelism).

    Args:
        config: the model's hyper-parameters.
        max_positions: length of the rope table (the engine's max context).
        tp: None, or a ``models.parallel.TensorParallel``: this rank's shard of
            every layer (embeddings and lm_head replicated).
        ops: the kernel backend every module calls, fixed at construction (None: the
            enclosing ``backend.building``'s, the torch references outside any).

    ``make_mlp(config, layer, tp)``: the MLP of a layer (a subclass's MoE);
    ``mlp_name``: its checkpoint name.
    """

    tensor_parallel = True
    mlp_name = "mlp"

    def make_mlp(self, config: ModelConfig, layer: int, tp) -> nn.Module:
        if config.family == "gpt_oss":
            from unikv.models.gpt_oss import MoE

            return MoE(config, tp)
        return GatedMLP(config, tp)

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> Backbone:
        rotary = Rotary(config.rope, config.head_dim, max_positions)
        layers = [
            DecoderLayer(config, i, rotary, self.make_mlp(config, i, tp), tp, self.mlp_name)
            for i in range(config.num_layers)
        ]
        fp32_norm = config.family == "gpt_oss"
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp32_norm)
        return Backbone(nn.Embedding(config.vocab_size, config.hidden_size), layers, norm, rotary)
