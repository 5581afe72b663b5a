"""Granite-4.0-H (``GraniteMoeHybridForCausalLM``): Bamba's layers (Mamba-2 or
attention, then an MLP) with Granite's multipliers and a MoE MLP.

    h = embed(ids) * embedding_multiplier
    h = h + residual_multiplier * mixer(input_layernorm(h))
    h = h + residual_multiplier * (moe(x) + shared_mlp(x)),  x = post_attention_layernorm(h)
    logits = lm_head(norm(h)) / logits_scaling

- the mixer: Bamba's Mamba-2 (``bamba.BambaMixer``) or attention whose softmax scale
  is ``attention_multiplier`` (not head_dim ** -0.5), with rope when
  ``position_embedding_type == "rope"`` and without any positional embedding else;
- ``block_sparse_moe``: a softmax over the router's top-k logits, SwiGLU experts
  stored stacked as the checkpoint holds them (``input_linear.weight`` (E, 2I, H),
  rows [gate | up]; ``output_linear.weight`` (E, H, I)), run by the fused MoE;
  absent when ``num_local_experts`` is 0 (a dense model);
- ``shared_mlp``: a SwiGLU whose ``input_linear`` is [gate | up]; absent when
  ``shared_intermediate_size`` is 0 (transformers then builds a zero-width one,
  whose zero-size tensors unikv skips on load).

State as Bamba's. Names are the checkpoint's: ``model.layers.i.{mamba,self_attn,
block_sparse_moe,shared_mlp,input_layernorm,post_attention_layernorm}``, ``model.norm``.
"""

from __future__ import annotations

import torch
from torch import nn

from unikv.kernels.backend import model_ops, step_rows
from unikv.models import decoder
from unikv.models.bamba import MAMBA, BambaMixer, check_layer_types, hybrid_tp_dims
from unikv.models.config import ModelConfig
from unikv.models.layers import Attention, Linear, RMSNorm
from unikv.models.parallel import Segments, reduce_partial, shard_rows, tp_size
from unikv.models.rope import Rotary

_EXTRA_FIELDS = {
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 1.0,
    "logits_scaling": 1.0,
    "num_local_experts": 0,
    "num_experts_per_tok": 2,
    "shared_intermediate_size": 0,
}


def config_extras(hf_config) -> dict:
    """Granite's own fields of a ``GraniteMoeHybridConfig`` (for ``ModelConfig.extra``):
    the layer types, the multipliers (the attention's as ``sm_scale``), the MoE sizes
    and whether attention takes rope."""
    e = {name: getattr(hf_config, name, None) for name in _EXTRA_FIELDS}
    e = {name: default if e[name] is None else e[name] for name, default in _EXTRA_FIELDS.items()}
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        e[name] = float(e[name])
    e["sm_scale"] = float(e.pop("attention_multiplier"))
    e["layer_types"] = tuple(hf_config.layers_block_type)
    e["rope"] = getattr(hf_config, "position_embedding_type", None) == "rope"
    e["position_embedding_type"] = getattr(hf_config, "position_embedding_type", None)
    return e


class NoRopeAttention(Attention):
    """``layers.Attention`` (one q|k|v GEMM, biases) without positional embedding."""

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        t = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = attn(self.layer, q, k, v, None)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class Weight(nn.Module):
    """One stacked expert tensor under the checkpoint's ``<name>.weight``; ``shard``:
    how tensor parallelism narrows it (a dim or ``Segments``), None: replicated."""

    def __init__(self, *shape: int, shard=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))
        if shard is not None:
            self.tp_shards = {"weight": shard}


def gate_up_segments(intermediate: int, dim: int) -> Segments:
    """[gate (I) | up (I)] along ``dim``, each half split over the ranks on its own."""
    return Segments(dim, ((intermediate, intermediate), (intermediate, intermediate)))


class MoE(nn.Module):
    """``router.layer`` (E, H): top-k of the logits, softmaxed over those k (fp32,
    then the model dtype, as transformers' GraniteMoeHybridTopKRouter); the experts'
    stacked weights are the fused MoE's operands as stored (w1 = ``input_linear``,
    w2 = ``output_linear``). Under ``tp`` the router is replicated and every expert
    holds its slice of the intermediate rows (gate and up each, and the down columns):
    the output is this rank's partial sum (the layer all-reduces it)."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        super().__init__()
        e, h, full = config.extra, config.hidden_size, config.intermediate_size
        i, split = full // tp_size(tp), tp is not None
        self.num_experts, self.top_k = e["num_local_experts"], e["num_experts_per_tok"]
        self.router = nn.Module()
        self.router.layer = Weight(self.num_experts, h)
        gate_up = gate_up_segments(full, 1) if split else None
        self.input_linear = Weight(self.num_experts, 2 * i, h, shard=gate_up)
        self.output_linear = Weight(self.num_experts, h, i, shard=2 if split else None)
        self.kernel = model_ops().moe  # the backend's MoE, fixed at construction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        logits = nn.functional.linear(x, self.router.layer.weight).float()  # (T, E)
        top, indices = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).to(x.dtype)
        w1, w2 = self.input_linear.weight, self.output_linear.weight
        return self.kernel(x, weights, indices, w1, w2, activation="silu", rows=step_rows())


class SharedMLP(nn.Module):
    """``output_linear(silu(gate) * up)``, [gate | up] = ``input_linear(x)``: the SwiGLU
    inside the down GEMM (the backend's ``silu_mul_linear``). Under ``tp`` gate and up
    by columns (``input_linear`` stays a plain Linear: the pre-norm fuses into it), the
    down GEMM's output this rank's partial sum (the layer all-reduces it)."""

    def __init__(self, hidden: int, intermediate: int, tp=None) -> None:
        super().__init__()
        i = intermediate // tp_size(tp)
        self.input_linear = Linear(hidden, 2 * i, bias=False)
        self.output_linear = Linear(i, hidden, bias=False)
        if tp is not None:
            shard_rows(self.input_linear, gate_up_segments(intermediate, 0))
            shard_rows(self.output_linear, 1)
        self.ops = model_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.input_linear(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul_linear(gate_up, self.output_linear.weight, None, rows=step_rows())


class DenseBody:
    """The dense MLP block's body for ``decoder.Block``: the pre-norm inside
    ``shared_mlp.input_linear`` (its attribute of that name is a Linear, not the
    decoder's ``input_linear()`` hook, hence this adapter)."""

    def __init__(self, mlp: SharedMLP) -> None:
        self.mlp = mlp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def input_linear(self) -> nn.Linear:
        return self.mlp.input_linear

    def from_input(self, gate_up: torch.Tensor, positions=None, attn=None) -> torch.Tensor:
        return self.mlp.down(gate_up)


class DecoderLayer(decoder.DecoderLayer):
    """The mixer behind ``input_layernorm`` and the MLP behind
    ``post_attention_layernorm``; each block's output scaled by ``residual_multiplier``
    (the block's ``post``) before the residual add fused into the next norm."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary | None, tp=None) -> None:
        super().__init__()
        e, eps, h = config.extra, config.rms_norm_eps, config.hidden_size
        self.block_type = e["layer_types"][layer]
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if self.block_type == MAMBA:
            self.mamba = mixer = BambaMixer(config.state_dims, layer, tp)
        elif rotary is not None:
            self.self_attn = mixer = Attention(config, layer, rotary, tp)
        else:
            self.self_attn = mixer = NoRopeAttention(config, layer, None, tp)
        if e["num_local_experts"] > 0:
            self.block_sparse_moe = MoE(config, tp)
        if e["shared_intermediate_size"] > 0:
            self.shared_mlp = SharedMLP(h, e["shared_intermediate_size"], tp)
        self.tp = tp  # the MLP block's partial sums are all-reduced once (``mlp_sum``)
        self.scale = e["residual_multiplier"]
        self.has_shared = e["shared_intermediate_size"] > 0  # a host bool of the config
        # dense: the norm inside the shared MLP's first GEMM; MoE: a bound method (the
        # MoE's ``input_linear`` is its stacked experts, not the decoder's GEMM hook)
        mlp = DenseBody(self.shared_mlp) if e["num_local_experts"] == 0 else self.moe
        self.blocks = [
            decoder.Block(self.input_layernorm, mixer, mixes=True, post=self.scaled),
            decoder.Block(self.post_attention_layernorm, mlp, mixes=False, post=self.mlp_scaled),
        ]

    def scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out * self.scale

    def mlp_scaled(self, out: torch.Tensor) -> torch.Tensor:
        """The MLP block's ``post``: its partial sums summed over the ranks (one
        all-reduce under tp), then scaled."""
        return reduce_partial(self.tp, out) * self.scale

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block_sparse_moe(x)
        return out + self.shared_mlp(x) if self.has_shared else out


class GraniteMoeHybridForCausalLM(decoder.DecoderLM):
    """Granite-4.0-H on the shared decoder.

    Its multipliers opt out of two fused pieces, as Falcon-H1's: the embedding is
    scaled before the first norm (no gather inside the first GEMM) and the logits
    divided after the head (the greedy argmax runs on the scaled logits, as the
    sampler would). Under tensor parallelism as Bamba, the experts and the shared MLP
    on their intermediate widths (their partial sums all-reduced once per layer).

    Args: as ``bamba.BambaForCausalLM`` (Granite's fields in ``extra``:
    ``config_extras``); ``max_positions`` is unused without rope.
    """

    tensor_parallel = True
    scales_embedding = True
    finishes_logits = True

    def __init__(self, config: ModelConfig, max_positions: int, tp=None, *, ops=None) -> None:
        super().__init__(config, max_positions, tp, ops=ops)
        e = config.extra
        if e["shared_intermediate_size"] == 0:  # transformers saves a zero-width shared MLP
            self.ignore_checkpoint_prefixes = tuple(
                f"model.layers.{i}.shared_mlp." for i in range(config.num_layers)
            )

    def check(self, config: ModelConfig, tp) -> None:
        super().check(config, tp)
        check_layer_types(config, "Granite-4.0-H")
        e = config.extra
        if config.hidden_act != "silu":
            raise ValueError(f"Granite-4.0-H hidden_act must be 'silu', got {config.hidden_act!r}")
        if e["position_embedding_type"] not in (None, "rope", "nope"):
            raise ValueError(
                f"Granite-4.0-H position_embedding_type must be 'rope', 'nope' or null, got "
                f"{e['position_embedding_type']!r}"
            )
        if e["num_local_experts"] == 0 and e["shared_intermediate_size"] == 0:
            raise ValueError(
                "Granite-4.0-H with num_local_experts 0 needs shared_intermediate_size > 0 "
                "(the dense MLP); the config gives neither an MoE nor an MLP"
            )
        experts, k = e["num_local_experts"], e["num_experts_per_tok"]
        if experts and not 0 < k <= experts:
            raise ValueError(
                f"Granite-4.0-H num_experts_per_tok must be in [1, num_local_experts "
                f"({experts})], got {k}; fix the config"
            )

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        rotary = (
            Rotary(config.rope, config.head_dim, max_positions) if config.extra["rope"] else None
        )
        layers = [DecoderLayer(config, i, rotary, tp) for i in range(config.num_layers)]
        return decoder.rms_backbone(config, layers, rotary)

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """Bamba's (heads where a layer attends, ``mamba_n_heads``), the experts'
        ``intermediate_size`` and ``shared_intermediate_size`` where they exist."""
        e, dims = config.extra, hybrid_tp_dims(config)
        if e["num_local_experts"] > 0:
            dims["intermediate_size"] = config.intermediate_size
        if e["shared_intermediate_size"] > 0:
            dims["shared_intermediate_size"] = e["shared_intermediate_size"]
        return dims

    def scale_embedding(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.config.extra["embedding_multiplier"]

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.config.extra["logits_scaling"]
