"""NemotronH (``NemotronHForCausalLM``): a hybrid of Mamba-2, attention, MLP and
MoE blocks, one mixer per layer.

Layer i's type is ``config.layers_block_type[i]`` (the legacy
``hybrid_override_pattern`` letter): "linear_attention" (M) a Mamba-2 mixer
(``mamba2.py``), "full_attention" (*) attention WITHOUT positional embedding
(no rope), "mlp" (-) ``down(relu(up(x))^2)``, "moe" (E) routed non-gated relu2
experts plus a shared expert (DeepSeek-V3's sigmoid router, group-limited top-k).
Every block is ``x + mixer(norm(x))``; the model ends with ``norm_f``, ``lm_head``.

State: Mamba layers keep their conv + SSM state in the engine's Mamba sub-pool,
attention layers K/V in the full-attention sub-pool; MLP/MoE layers keep none.
Names are the checkpoints' (transformers renames ``backbone.`` to ``model.`` and
stacks the experts on load, and undoes both on save): ``backbone.embeddings``,
``backbone.layers.i.norm``, ``backbone.layers.i.mixer.*`` (experts one module
each: ``mixer.experts.e.up_proj.weight``), ``backbone.norm_f``, ``lm_head``.
"""

from __future__ import annotations

import torch
from torch import nn

from unikv.models import decoder
from unikv.models.config import ModelConfig
from unikv.models.hf import Fields
from unikv.models.layers import AttentionFn, Linear, RMSNorm, model_ops, step_rows
from unikv.models.mamba2 import Mamba2Dims, Mamba2Mixer
from unikv.models.moe import RoutedExperts
from unikv.models.parallel import linear_layers, shard_rows, tp_size

MAMBA, ATTENTION, MLP_TYPE, MOE = "linear_attention", "full_attention", "mlp", "moe"
LAYER_TYPES = (MAMBA, ATTENTION, MLP_TYPE, MOE)
MLP_ACTIVATIONS = ("relu2",)

# NemotronHConfig fields copied into ModelConfig.extra (name -> default)
_EXTRA_FIELDS = {
    "layer_norm_epsilon": 1e-5,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "moe_latent_size": None,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
}


def config_extras(hf_config) -> dict:
    """NemotronH's own fields of a transformers ``NemotronHConfig`` (for
    ``ModelConfig.extra``): the layer types and the Mamba/MLP/MoE sizes."""
    extra = {name: getattr(hf_config, name, default) for name, default in _EXTRA_FIELDS.items()}
    extra["layer_types"] = tuple(hf_config.layers_block_type)
    for key in ("routed_scaling_factor", "layer_norm_epsilon"):
        extra[key] = float(extra[key])
    return extra


def mamba_dims(cfg: Fields) -> Mamba2Dims:
    """The Mamba-2 mixer dims of a NemotronH config (the pool's state spec and the
    model's mixer both come from here); defaults are transformers' NemotronHConfig's,
    and the legacy field names (``mamba_n_groups``, ``mamba_d_conv``) are read too.
    transformers' NemotronH clamps the step size to ``(time_step_min, inf)`` (not
    ``config.time_step_limit``)."""
    bias = bool(cfg.get("use_bias", False))
    return Mamba2Dims(
        hidden_size=cfg.need("hidden_size"),
        num_heads=cfg.get("mamba_num_heads", 128),
        head_dim=cfg.get("mamba_head_dim", 64),
        n_groups=cfg.get("n_groups") or cfg.get("mamba_n_groups", 8),
        state_size=cfg.get("ssm_state_size", 128),
        conv_kernel=cfg.get("conv_kernel") or cfg.get("mamba_d_conv", 4),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bias,
        out_bias=bias,
        activation=cfg.get("mamba_hidden_act", "silu"),
        eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        dt_limit=(float(cfg.get("time_step_min", 0.001)), float("inf")),
    )


class NoRopeAttention(nn.Module):
    """q/k/v/o projections without bias, no positional embedding, paged attention.
    q, k and v come from one GEMM, ``qkv_proj``, loaded from the checkpoint's
    ``q_proj``, ``k_proj``, ``v_proj`` (``packed``), into which the decoder fuses the
    pre-norm (``input_linear``). Under ``tp`` this rank's heads (each part of q|k|v
    narrowed by heads, the GEMM still a plain ``Linear``; o_proj row-parallel)."""

    def __init__(self, config: ModelConfig, layer: int, tp=None) -> None:
        super().__init__()
        hidden, d, n = config.hidden_size, config.head_dim, tp_size(tp)
        self.layer, self.head_dim = layer, d
        self.num_heads, self.num_kv_heads = config.num_heads // n, config.num_kv_heads // n
        self.split = (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        self.qkv_proj = Linear(hidden, sum(self.split), bias=False)
        self.packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
        if tp is not None:
            shard_rows(self.qkv_proj)
        self.o_proj = linear_layers(tp)[1](self.num_heads * d, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """x: (T, hidden); positions: unused (no rope) -> (T, hidden)."""
        return self.from_input(self.qkv_proj(x), positions, attn)

    def input_linear(self) -> nn.Linear:
        return self.qkv_proj

    def from_input(self, qkv: torch.Tensor, positions, attn: AttentionFn) -> torch.Tensor:
        """``forward`` after the q|k|v GEMM: qkv (T, (Hq + 2 Hkv) D) -> (T, hidden)."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = attn(self.layer, q, k, v, None)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class Relu2MLP(nn.Module):
    """``down(relu(up(x)) ** 2)`` (NemotronH's MLP and shared expert); under ``tp`` up
    column-parallel (still a plain ``Linear``: the pre-norm fuses into it), down
    row-parallel (one all-reduce)."""

    def __init__(
        self, hidden: int, intermediate: int, bias: bool, tp=None, reduce: bool = True
    ) -> None:
        super().__init__()
        inter = intermediate // tp_size(tp)
        self.up_proj = Linear(hidden, inter, bias=bias)
        if tp is not None:
            shard_rows(self.up_proj)
        self.down_proj = linear_layers(tp, reduce)[1](inter, hidden, bias=bias)
        self.ops = model_ops()  # relu(up) ** 2 in one kernel, or inside the down GEMV
        self.rebind()

    def rebind(self) -> None:
        """relu2 inside the down GEMV where ``down_proj`` is a plain ``Linear`` (again
        after the loader replaced it, ``DecoderLM.rebind``); else its own kernel."""
        self.fused_down = type(self.down_proj) is Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_input(self.up_proj(x))

    def input_linear(self) -> nn.Linear:
        """``up_proj``: the decoder fuses the pre-norm into it (a layer's MLP; the MoE's
        shared expert is called whole)."""
        return self.up_proj

    def from_input(self, up: torch.Tensor, positions=None, attn=None) -> torch.Tensor:
        if self.fused_down:  # a host bool fixed at load
            down = self.down_proj
            return self.ops.relu_square_linear(up, down.weight, down.bias, rows=step_rows())
        return self.down_proj(self.ops.relu_square(up))


class TopkRouter(nn.Module):
    """Sigmoid router with a score-correction bias and group-limited top-k
    (transformers' NemotronHTopkRouter, from DeepSeek-V3); runs in fp32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e = config.extra
        self.num_experts, self.top_k = e["n_routed_experts"], e["num_experts_per_tok"]
        self.n_group, self.topk_group = e["n_group"], e["topk_group"]
        self.norm_topk_prob, self.scale = e["norm_topk_prob"], e["routed_scaling_factor"]
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) -> (weights (T, k) fp32, expert indices (T, k) int64)."""
        t = x.shape[0]
        scores = nn.functional.linear(x.float(), self.weight.float()).sigmoid()  # (T, E)
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(t, self.n_group, self.num_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # (T, n_group)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask[:, :, None].expand_as(grouped).reshape(t, self.num_experts) > 0
        choice = choice.masked_fill(~keep, float("-inf"))
        indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, indices


class MoE(nn.Module):
    """Routed non-gated relu2 experts (``experts.e.up_proj`` / ``down_proj``,
    optionally in a latent space: ``fc1_latent_proj`` / ``fc2_latent_proj``) plus
    ``shared_experts``; x: (T, hidden) -> (T, hidden). Routed outputs accumulate
    in fp32, expert by expert in index order, as transformers' loop does.

    The routed experts run in the fused MoE (``models/moe.RoutedExperts``). Under
    ``tp`` the router and the latent projections are replicated, the routed and shared
    experts sharded on their intermediate dims; their partial sums are added and
    all-reduced once (with a latent space: the routed sum before ``fc2_latent_proj``,
    the shared expert its own)."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        super().__init__()
        e, hidden = config.extra, config.hidden_size
        latent, bias = e["moe_latent_size"], bool(e["mlp_bias"])
        dim, inter = latent or hidden, e["moe_intermediate_size"]
        self.gate = TopkRouter(config)
        names = ("up_proj", "down_proj")
        self.experts = RoutedExperts(
            e["n_routed_experts"], dim, inter, activation="relu2", names=names, tp=tp
        )
        self.tp = tp
        shared = e["moe_shared_expert_intermediate_size"]
        # without a latent space the routed and shared partial sums are reduced once
        self.shared_experts = Relu2MLP(hidden, shared, bias, tp, reduce=latent is not None)
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(hidden, latent, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent, hidden, bias=bias)
        self.latent = latent is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x)
        h = self.fc1_latent_proj(x) if self.latent else x
        h = self.experts(h, weights, indices, sum_dtype=weights.dtype)
        if self.latent:  # a host bool fixed at construction
            h = self.fc2_latent_proj(h if self.tp is None else self.tp.all_reduce(h))
            return h + self.shared_experts(x)  # (its own all-reduce under tp)
        h = h + self.shared_experts(x)
        return h if self.tp is None else self.tp.all_reduce(h)


class Block(decoder.DecoderLayer):
    """One layer, ``x + mixer(norm(x))`` (one ``decoder.Block``); the mixer is picked
    by the layer's type."""

    def __init__(self, config: ModelConfig, layer: int, tp=None) -> None:
        super().__init__()
        e = config.extra
        self.block_type = e["layer_types"][layer]
        self.norm = RMSNorm(config.hidden_size, e["layer_norm_epsilon"])
        if self.block_type == MAMBA:
            self.mixer = Mamba2Mixer(config.state_dims, layer, tp)
        elif self.block_type == ATTENTION:
            self.mixer = NoRopeAttention(config, layer, tp)
        elif self.block_type == MLP_TYPE:
            inter = config.intermediate_size
            self.mixer = Relu2MLP(config.hidden_size, inter, e["mlp_bias"], tp)
        else:
            self.mixer = MoE(config, tp)
        mixes = self.block_type in (MAMBA, ATTENTION)  # a host str fixed at construction
        self.blocks = [decoder.Block(self.norm, self.mixer, mixes=mixes)]


def _check(config: ModelConfig) -> None:
    e = config.extra
    types = e["layer_types"]
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad or len(types) != config.num_layers:
        raise ValueError(
            f"NemotronH layers_block_type must list {config.num_layers} entries out of "
            f"{LAYER_TYPES}, got {list(types)}"
        )
    if (MLP_TYPE in types or MOE in types) and e["mlp_hidden_act"] not in MLP_ACTIVATIONS:
        raise ValueError(
            f"NemotronH mlp_hidden_act must be one of {MLP_ACTIVATIONS}, got "
            f"{e['mlp_hidden_act']!r}"
        )
    experts, groups = e["n_routed_experts"], e["n_group"]
    if MOE in types and (experts % groups or experts // groups < 2 or e["topk_group"] > groups):
        raise ValueError(
            f"NemotronH MoE routing needs n_routed_experts ({experts}) a multiple of n_group "
            f"({groups}) with >= 2 experts per group and topk_group ({e['topk_group']}) <= "
            "n_group; fix the config"
        )


class NemotronHForCausalLM(decoder.DecoderLM):
    """NemotronH over unikv's step object (paged attention + recurrent-state ops), on
    the shared decoder (``decoder.DecoderLM``: each residual add inside the next norm,
    the head's fast path).

    Args:
        config: ModelConfig with NemotronH's fields in ``extra`` (``config_extras``).
        max_positions: unused (no rope); kept for the registry's signature.
        tp: None, or a ``models.parallel.TensorParallel``: this rank's Mamba-2 heads
            (and their state), attention heads, MLP and expert columns.
        ops: as ``decoder.DecoderLM``.
    """

    tensor_parallel = True
    backbone_name = "backbone"
    # the MoE routers' score-correction biases: transformers keeps them fp32 in every dtype
    fp32_params = ("e_score_correction_bias",)

    def check(self, config: ModelConfig, tp) -> None:
        super().check(config, tp)
        _check(config)

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """The fields of the layer types present: attention heads, ``mamba_num_heads``
        (the groups: ``Mamba2Dims.shard``), the MLP's and the experts' widths."""
        e, types = config.extra, set(config.extra["layer_types"])
        dims = {}
        if ATTENTION in types:
            dims["num_attention_heads"] = config.num_heads
            dims["num_key_value_heads"] = config.num_kv_heads
        if MAMBA in types:
            dims["mamba_num_heads"] = config.state_dims.num_heads
        if MLP_TYPE in types:
            dims["intermediate_size"] = config.intermediate_size
        if MOE in types:
            dims["moe_intermediate_size"] = e["moe_intermediate_size"]
            dims["moe_shared_expert_intermediate_size"] = e["moe_shared_expert_intermediate_size"]
        return dims

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        layers = [Block(config, i, tp) for i in range(config.num_layers)]
        norm = RMSNorm(config.hidden_size, config.extra["layer_norm_epsilon"])
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        return decoder.Backbone(embed, layers, norm, names=("embeddings", "norm_f"))
