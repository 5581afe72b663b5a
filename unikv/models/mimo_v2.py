"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``, transformers' ``mimo_v2_flash``) on
unikv's layers.

    per layer:  x = x + self_attn(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))

- Attention: q/k heads of ``head_dim`` (192 in the release), v heads of
  ``v_head_dim`` (128): the cache is asymmetric, K rows of D and V rows of Dv per
  head (the pool stores them; whether padded or exact is the layout's business,
  the model only sees the attention call). Values are scaled by
  ``attention_value_scale`` before they are cached; softmax scale
  ``head_dim ** -0.5``; o_proj has no bias.
- Layers follow ``layer_types``: full layers (the first one and every sixth by
  default) have ``num_key_value_heads`` KV heads and no sinks; sliding layers
  have twice the KV heads, window ``sliding_window`` and a learned attention sink
  per query head (``self_attn.attention_sink_bias`` in the checkpoint, transformers'
  ``sinks``).
- Rope per layer type (``rope_parameters[layer_type]``), partial: the first
  ``int(head_dim * partial_rotary_factor)`` dims of q and k are rotated, NeoX
  layout; MiMo's default factor is 0.334 when a default-type entry omits it.
- MLP per ``mlp_layer_types``: "dense" a SwiGLU of ``intermediate_size``;
  "sparse" DeepSeek-V3 routing (sigmoid, correction bias, group top-k,
  renormalised, ``deepseek_moe.TopkRouter``) over SwiGLU experts of
  ``moe_intermediate_size`` and no shared experts (``moe.RoutedExperts``, the fused MoE).
- The checkpoint's multi-token-prediction head (``model.mtp.*``) is not loaded here;
  ``speculative_config={"method": "mtp"}`` loads its first layer (``models/mtp.py``).

Names mirror transformers' checkpoint (``model.layers.i.mlp.experts.e.gate_proj``),
so a checkpoint loads by name.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from unikv.models import decoder
from unikv.models.config import ModelConfig
from unikv.models.deepseek_moe import TopkRouter, check_moe_fields
from unikv.models.layers import AttentionFn, GatedMLP, RMSNorm
from unikv.models.moe import RoutedExperts
from unikv.models.parallel import linear_layers, reduce_partial, tp_size
from unikv.models.rope import Rotary

LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_TYPES = ("dense", "sparse")
DEFAULT_PARTIAL_ROTARY = 0.334  # transformers' MiMoV2Flash default for default-type rope
SWA_KV_HEAD_FACTOR = 2  # sliding layers have twice the KV heads of full ones


def _get(hf_config, name: str, default):
    value = getattr(hf_config, name, None)
    return default if value is None else value


def _rope_by_type(hf_config) -> dict[str, dict]:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    missing = [t for t in LAYER_TYPES if not isinstance(params.get(t), dict)]
    if missing:
        raise ValueError(
            f"MiMo-V2-Flash rope_parameters must hold one dict per layer type "
            f"{list(LAYER_TYPES)}, got {params!r}; read config.json with transformers' "
            "MiMoV2FlashConfig"
        )
    out = {}
    for t in LAYER_TYPES:
        p = dict(params[t])
        p.setdefault("rope_type", "default")
        if p["rope_type"] == "default":
            p.setdefault("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)
        out[t] = p
    return out


def _check_layer_types(hf_config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    n = hf_config.num_hidden_layers
    layer_types = tuple(hf_config.layer_types or ())
    mlp_types = tuple(getattr(hf_config, "mlp_layer_types", None) or ())
    for name, types, allowed in (
        ("layer_types", layer_types, LAYER_TYPES),
        ("mlp_layer_types", mlp_types, MLP_TYPES),
    ):
        if len(types) != n or set(types) - set(allowed):
            raise ValueError(
                f"MiMo-V2-Flash needs {name} of {n} entries out of {list(allowed)}, got "
                f"{list(types)}; fix config.json"
            )
    return layer_types, mlp_types


def config_extras(hf_config) -> dict:
    """MiMo-V2-Flash's own fields of a transformers ``MiMoV2FlashConfig`` (into
    ``ModelConfig.extra``). ValueError for what unikv does not run: an activation
    other than silu, a sliding-layer KV head count other than transformers' (twice
    the full layers'), a routing the V3 router cannot run."""
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"MiMo-V2-Flash hidden_act {act!r} is not supported; unikv runs 'silu'")
    layer_types, mlp_types = _check_layer_types(hf_config)
    kv = hf_config.num_key_value_heads
    swa_kv = _get(hf_config, "swa_num_key_value_heads", SWA_KV_HEAD_FACTOR * kv)
    if swa_kv != SWA_KV_HEAD_FACTOR * kv:
        raise ValueError(
            f"swa_num_key_value_heads {swa_kv} != {SWA_KV_HEAD_FACTOR} x num_key_value_heads "
            f"({kv}): transformers' MiMo-V2-Flash gives sliding layers twice the KV heads; "
            "fix config.json"
        )
    extra = {
        "layer_types": layer_types,
        "mlp_layer_types": mlp_types,
        "rope_by_type": _rope_by_type(hf_config),
        "v_head_dim": int(_get(hf_config, "v_head_dim", hf_config.head_dim)),
        "v_scale": float(_get(hf_config, "attention_value_scale", 1.0)),
        "swa_num_kv_heads": int(swa_kv),
        "attention_bias": bool(_get(hf_config, "attention_bias", False)),
        # the DeepSeek-V3 router's fields (deepseek_moe.TopkRouter)
        "version": 3,
        "topk_method": "noaux_tc",
        "n_routed_experts": int(_get(hf_config, "n_routed_experts", 0)),
        "num_experts_per_tok": int(_get(hf_config, "num_experts_per_tok", 1)),
        "moe_intermediate_size": int(_get(hf_config, "moe_intermediate_size", 0)),
        "n_group": int(_get(hf_config, "n_group", 1)),
        "topk_group": int(_get(hf_config, "topk_group", 1)),
        "routed_scaling_factor": float(_get(hf_config, "routed_scaling_factor", 1.0)),
        "norm_topk_prob": bool(_get(hf_config, "norm_topk_prob", True)),
    }
    if "sparse" in mlp_types:
        check_moe_fields(extra, "mimo_v2_flash")
    return extra


class MiMoAttention(nn.Module):
    """q/k/v/o projections, partial rope, ``attn`` over the layer's sub-pool; see the
    module docstring. ``sliding``: a sliding layer (twice the KV heads, sinks).

    With ``tp`` this rank holds 1/tp of the query heads and of the layer's KV heads
    (q/k/v column-parallel by heads, the sinks sliced like the q heads), o_proj
    row-parallel (``models/parallel.py``)."""

    def __init__(
        self, config: ModelConfig, layer: int, rotary: Rotary, sliding: bool, tp=None
    ) -> None:
        super().__init__()
        e, hidden, n = config.extra, config.hidden_size, tp_size(tp)
        column, row = linear_layers(tp)
        self.layer, self.num_heads = layer, config.num_heads // n
        kv_heads = e["swa_num_kv_heads"] if sliding else config.num_kv_heads
        self.num_kv_heads = kv_heads // n
        self.head_dim, self.v_head_dim = config.head_dim, e["v_head_dim"]
        self.v_scale = e["v_scale"]
        heads, kv, bias = self.num_heads, self.num_kv_heads, e["attention_bias"]
        self.q_proj = column(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = column(hidden, kv * self.head_dim, bias=bias)
        self.v_proj = column(hidden, kv * self.v_head_dim, bias=bias)
        self.o_proj = row(heads * self.v_head_dim, hidden, bias=False)
        # (Hq,) sink logits; kept fp32 (``build``), as the attention kernels take them
        self.attention_sink_bias = nn.Parameter(torch.zeros(heads)) if sliding else None
        if tp is not None and sliding:
            self.tp_shards = {"attention_sink_bias": 0}  # the sinks follow the q heads
        self.rotary = [rotary]  # shared, kept out of this module's parameters

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """x: (T, hidden); positions: (T,) int64 -> (T, hidden)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.v_head_dim) * self.v_scale
        q, k = self.rotary[0](positions, q, k)
        out = attn(self.layer, q, k, v, self.attention_sink_bias)  # (T, Hq, Dv)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_head_dim))


class MiMoMoE(nn.Module):
    """``mlp.gate`` (DeepSeek-V3 router) and ``mlp.experts.{e}`` (SwiGLU), no shared
    experts. With ``tp``: the router replicated, the experts sharded on
    ``moe_intermediate_size``, one all-reduce."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        super().__init__()
        e = config.extra
        self.gate = TopkRouter(config)
        self.experts = RoutedExperts(
            e["n_routed_experts"], config.hidden_size, e["moe_intermediate_size"], tp=tp
        )
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        weights, indices = self.gate(x)  # (T, k) fp32, (T, k) int64
        return reduce_partial(self.tp, self.experts(x, weights, indices))


class DecoderLayer(decoder.DecoderLayer):
    """Attention then an MLP (dense or MoE per ``mlp_layer_types``), each behind a
    pre-norm (``decoder.Block``: the dense MLP's inside its gate|up GEMM); ``tp``: this
    rank's shard of each."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__()
        e, h, eps = config.extra, config.hidden_size, config.rms_norm_eps
        sliding = e["layer_types"][layer] == "sliding_attention"
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = MiMoAttention(config, layer, rotary, sliding, tp)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if e["mlp_layer_types"][layer] == "sparse":
            self.mlp = MiMoMoE(config, tp)
        else:
            self.mlp = GatedMLP(dataclasses.replace(config, mlp_bias=False), tp)
        self.blocks = [
            decoder.Block(self.input_layernorm, self.self_attn, mixes=True),
            decoder.Block(self.post_attention_layernorm, self.mlp, mixes=False),
        ]


class MiMoV2FlashForCausalLM(decoder.DecoderLM):
    """MiMo-V2-Flash over unikv's "full" and "swa" sub-pools, on the shared decoder
    (``decoder.DecoderLM``).

    Args:
        config: the model's hyper-parameters (``extra`` from ``config_extras``).
        max_positions: length of the rope tables (the engine's max context).
        tp: None, or a ``models.parallel.TensorParallel``: this rank's query heads, KV
            heads of both layer types, sinks, dense MLP columns and expert rows
            (``tp_dims`` names the fields the size must divide).
        ops: as ``decoder.DecoderLM``.
    """

    tensor_parallel = True

    # before the weights load (``build``): the routers' ``e_score_correction_bias``
    # (transformers keeps it fp32 in every model dtype) and the attention sinks (the
    # kernels take fp32 sinks) as fp32 parameters
    fp32_params = ("e_score_correction_bias", "attention_sink_bias")
    ignore_checkpoint_prefixes = ("model.mtp.",)  # multi-token-prediction head

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """Query heads, both layer types' KV heads, and the intermediate size of each
        MLP kind the model has."""
        e = config.extra
        dims = {"num_attention_heads": config.num_heads}
        types = set(e["layer_types"])
        if "full_attention" in types:
            dims["num_key_value_heads"] = config.num_kv_heads
        if "sliding_attention" in types:
            dims["swa_num_key_value_heads"] = e["swa_num_kv_heads"]
        if "dense" in e["mlp_layer_types"]:
            dims["intermediate_size"] = config.intermediate_size
        if "sparse" in e["mlp_layer_types"]:
            dims["moe_intermediate_size"] = e["moe_intermediate_size"]
        return dims

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        layer = functools.partial(DecoderLayer, tp=tp)
        return decoder.typed_rope_backbone(config, max_positions, LAYER_TYPES, layer, norm)
