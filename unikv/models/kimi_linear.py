"""Kimi-Linear (``KimiLinearForCausalLM``, model_type ``kimi_linear``): Kimi Delta
Attention (KDA) layers and MLA layers in one model, so a request's recurrent state and
its MLA latent rows live in one pool (the Mamba sub-pool beside the MLA sub-pool).

Names are the released checkpoint's (transformers renames them at load): every mixer
is ``self_attn``, every MLP ``block_sparse_moe`` (dense: gate/up/down_proj; MoE: ``gate``,
``experts.{e}.w1 / w3 / w2`` = gate / up / down, ``shared_experts``).

- MLA (``deepseek.MLAttention``) without rope: the latent row ``[c | k_rope]`` is cached
  as projected (k_rope unrotated), softmax scale ``(nope + rope) ** -0.5``.
- KDA: the Gated DeltaNet recurrence with a decay per key channel. One input GEMM
  (``in_proj``: q | k | v | f_a | b | g_a, from the checkpoint's six projections) into
  which the decoder fuses the pre-norm; q, k, v through one depthwise causal conv
  (silu; ``conv1d`` from ``q_conv1d``, ``k_conv1d``, ``v_conv1d``), the step's conv
  state being [q | k | v] as transformers' cache holds it;
  ``g = -exp(A_log) * softplus(f_b_proj(f_a) + dt_bias)`` (T, H, Dk) in fp32 (softplus
  as transformers writes it: log(1 + exp(x)), x above 20), ``beta = sigmoid(b)``; the
  step's ``gated_delta_rule`` with that per-channel g (l2-normed q, k; scale Dk ** -0.5;
  fp32 state (H, Dk, Dv)); output ``o_norm(o) * sigmoid(g_b_proj(g_a))`` (the norm and the
  gate in fp32, weight fp32), o_proj.
- Norms: Llama's RMSNorm (cast before the weight); the MoE is DeepSeek-V3's (sigmoid
  routing with correction bias and groups, shared experts).
Tensor parallelism (``models/parallel.py``): KDA by heads (q, k, v, b, the conv
channels, dt_bias, A_log, the rows of f_b and g_b; f_a and g_a, one head wide, and the
per-head o_norm replicated), so a rank's state slot holds its heads' conv window and
recurrent state; MLA by heads with the latent row whole on every rank
(``deepseek.MLAttention``); the dense MLP, routed and shared experts on their widths.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from unikv.models import decoder
from unikv.models.config import ModelConfig
from unikv.models.deepseek import MLA_FIELDS, MLAttention
from unikv.models.deepseek_moe import DeepseekMoE, check_moe_fields
from unikv.models.hf import Fields
from unikv.models.layers import GatedMLP, Linear, RMSNorm, StateFn
from unikv.models.moe import RoutedExperts
from unikv.models.parallel import linear_layers, shard_rows, tp_size
from unikv.models.qwen3_5 import GatedDeltaNetDims


def kda_dims(cfg: Fields) -> GatedDeltaNetDims:
    """The KDA mixer's dims (the pool's state spec and the mixer both come from here):
    H heads of D for q, k and v alike, a conv of ``short_conv_kernel_size`` taps; read
    from transformers' fields or the release's ``linear_attn_config``."""
    lin = cfg.get("linear_attn_config") or {}
    heads = int(cfg.get("linear_num_heads") or lin.get("num_heads", 32))
    dim = int(cfg.get("linear_head_dim") or lin.get("head_dim", 128))
    kernel = int(cfg.get("linear_conv_kernel_dim") or lin.get("short_conv_kernel_size", 4))
    return GatedDeltaNetDims(heads, heads, dim, dim, kernel)


def config_extras(hf_config) -> dict:
    """Kimi-Linear's own fields (into ``ModelConfig.extra``): MLA widths, the MoE's
    routing (DeepSeek-V3's names), layer and MLP types. ValueError naming the field."""
    missing = [n for n in MLA_FIELDS if getattr(hf_config, n, None) is None]
    if missing:
        raise ValueError(f"kimi_linear config lacks {missing}; fix config.json")
    extra = {n: int(getattr(hf_config, n)) for n in MLA_FIELDS}
    q_lora = getattr(hf_config, "q_lora_rank", None)
    extra.update(
        version=3,
        q_lora_rank=int(q_lora) if q_lora else None,
        attention_bias=bool(getattr(hf_config, "attention_bias", False)),
        mlp_bias=False,
        n_routed_experts=int(hf_config.num_local_experts),
        n_shared_experts=int(getattr(hf_config, "n_shared_experts", 0) or 0),
        num_experts_per_tok=int(hf_config.num_experts_per_tok),
        moe_intermediate_size=int(hf_config.moe_intermediate_size),
        n_group=int(getattr(hf_config, "n_group", 1) or 1),
        topk_group=int(getattr(hf_config, "topk_group", 1) or 1),
        routed_scaling_factor=float(hf_config.routed_scaling_factor),
        norm_topk_prob=bool(hf_config.norm_topk_prob),
        topk_method="noaux_tc",
        mla_sm_scale=(extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"]) ** -0.5,
        layer_types=tuple(hf_config.layer_types),
        mlp_layer_types=tuple(hf_config.mlp_layer_types),
    )
    check_moe_fields(extra, "kimi_linear")
    bad = sorted(set(extra["mlp_layer_types"]) - {"dense", "sparse"})
    if bad or len(extra["mlp_layer_types"]) != hf_config.num_hidden_layers:
        raise ValueError(
            f"kimi_linear mlp_layer_types must list {hf_config.num_hidden_layers} entries of "
            f"'dense' / 'sparse', got {list(extra['mlp_layer_types'])}; fix config.json"
        )
    return extra


class NoRope(nn.Module):
    """Kimi's MLA rotates nothing: ``(q, k)`` as given."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return q, k


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (module docstring); the conv and the recurrence go through
    the step object (``StateFn``): their state lives in the request's pool slot."""

    def __init__(self, config: ModelConfig, layer: int, tp=None) -> None:
        super().__init__()
        d, hidden = config.state_dims.shard(tp_size(tp)), config.hidden_size
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r}: the KDA conv runs 'silu' only")
        self.layer, self.heads, self.dim = layer, d.num_v_heads, d.head_v_dim
        width = self.heads * self.dim
        self.split = (width, width, width, self.dim, self.heads, self.dim)  # q k v f_a b g_a
        self.in_proj = Linear(hidden, sum(self.split), bias=False)
        self.conv1d = nn.Conv1d(3 * width, 3 * width, d.conv_kernel, groups=3 * width, bias=False)
        self.packed = {
            "in_proj": ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj"),
            "conv1d": ("q_conv1d", "k_conv1d", "v_conv1d"),
        }
        # the decay's parameters (f_a_proj runs inside in_proj): dt_bias (H * D,), A_log
        # (1, 1, H, 1) as the checkpoint stores them
        self.f_b_proj = Linear(self.dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.heads, 1))
        self.g_b_proj = Linear(self.dim, width, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.dim))
        self.eps = config.rms_norm_eps
        self.o_proj = linear_layers(tp)[1](width, hidden, bias=False)
        if tp is not None:  # the rank's heads of every per-head tensor (module docstring)
            shard_rows(self.f_b_proj)
            shard_rows(self.g_b_proj)
            self.tp_shards = {
                **{f"{p}.weight": 0 for p in ("q_proj", "k_proj", "v_proj", "b_proj")},
                **{f"{p}_conv1d.weight": 0 for p in "qkv"},
                "dt_bias": 0,
                "A_log": 2,
            }

    def input_linear(self) -> nn.Linear:
        return self.in_proj

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: StateFn) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        return self.from_input(self.in_proj(x), positions, attn)

    def from_input(self, y: torch.Tensor, positions: torch.Tensor, attn: StateFn) -> torch.Tensor:
        """``forward`` after the input GEMM: y (T, 3 H D + 2 D + H) -> (T, hidden)."""
        t, h, d = y.shape[0], self.heads, self.dim
        qkv, f_a, b, g_a = y.split((3 * h * d, d, h, d), dim=-1)
        weight = self.conv1d.weight.view(3 * h * d, -1)  # (C, K)
        qkv = attn.causal_conv1d(self.layer, qkv, weight, None, "silu")
        q, k, v = (part.reshape(t, h, d) for part in qkv.split(h * d, dim=-1))
        raw = (self.f_b_proj(f_a).float() + self.dt_bias.float()).view(t, h, d)
        softplus = torch.where(raw > 20.0, raw, torch.log(1.0 + torch.exp(raw)))
        g = -self.A_log.float().exp().view(1, h, 1) * softplus  # (T, H, D) fp32
        out = attn.gated_delta_rule(
            self.layer, q, k, v, g, b.sigmoid(), scale=d**-0.5, use_qk_l2norm=True
        )  # (T, H, D)
        o = out.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.weight.float()
        o = o * torch.sigmoid(self.g_b_proj(g_a).view(t, h, d).float())
        return self.o_proj(o.to(y.dtype).reshape(t, h * d))


class KimiMoE(DeepseekMoE):
    """DeepSeek-V3's MoE with the release's expert names (w1 gate, w3 up, w2 down)."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        super().__init__(config, tp=tp)
        e = config.extra
        self.experts = RoutedExperts(
            e["n_routed_experts"], config.hidden_size, e["moe_intermediate_size"],
            names=("w1", "w3", "w2"), tp=tp,
        )  # fmt: skip


class DecoderLayer(decoder.DecoderLayer):
    """A KDA or MLA mixer (``self_attn``) and a dense or MoE MLP (``block_sparse_moe``),
    each behind a pre-norm (``decoder.Block``)."""

    def __init__(self, config: ModelConfig, layer: int, rope: NoRope, tp=None) -> None:
        super().__init__()
        e, eps, hidden = config.extra, config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        if e["layer_types"][layer] == "linear_attention":
            self.self_attn = KimiDeltaAttention(config, layer, tp)
        else:
            self.self_attn = MLAttention(config, layer, rope, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if e["mlp_layer_types"][layer] == "sparse":
            self.block_sparse_moe = KimiMoE(config, tp)
        else:
            self.block_sparse_moe = GatedMLP(dataclasses.replace(config, mlp_bias=False), tp)
        self.blocks = [
            decoder.Block(self.input_layernorm, self.self_attn, mixes=True),
            decoder.Block(self.post_attention_layernorm, self.block_sparse_moe, mixes=False),
        ]


class KimiLinearForCausalLM(decoder.DecoderLM):
    """Kimi-Linear over unikv's MLA sub-pool and recurrent-state slots, on the shared
    decoder (``decoder.DecoderLM``).

    Args:
        config: the model's hyper-parameters (``extra`` from ``config_extras``).
        max_positions: unused (no rope), kept for the family interface.
        tp: None, or a ``models.parallel.TensorParallel``: this rank's KDA heads (and
            their state), MLA heads (the latent row whole), MLP and expert columns.
        ops: as ``decoder.DecoderLM``.
    """

    tensor_parallel = True
    fp32_params = ("e_score_correction_bias",)

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """The MLA query heads and ``linear_num_heads`` (KDA) of the layer types
        present, and the width of each MLP kind present (the shared experts' is a
        multiple of ``moe_intermediate_size``)."""
        e, dims = config.extra, {}
        if "full_attention" in e["layer_types"]:
            dims["num_attention_heads"] = config.num_heads
        if "linear_attention" in e["layer_types"]:
            dims["linear_num_heads"] = config.state_dims.num_v_heads
        if "dense" in e["mlp_layer_types"]:
            dims["intermediate_size"] = config.intermediate_size
        if "sparse" in e["mlp_layer_types"]:
            dims["moe_intermediate_size"] = e["moe_intermediate_size"]
        return dims

    def check(self, config: ModelConfig, tp) -> None:
        super().check(config, tp)
        types = config.extra["layer_types"]
        bad = sorted(set(types) - {"linear_attention", "full_attention"})
        if len(types) != config.num_layers or bad:
            raise ValueError(
                f"{config.architecture} needs layer_types of {config.num_layers} entries, "
                f"each 'linear_attention' or 'full_attention'; got {list(types)}"
            )

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        rope = NoRope()
        layers = [DecoderLayer(config, i, rope, tp) for i in range(config.num_layers)]
        return decoder.rms_backbone(config, layers)
