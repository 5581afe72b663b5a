"""DeepSeek-V2 and DeepSeek-V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``):
multi-head latent attention (MLA) over the pool's MLA sub-pool, dense first
layers, then mixture-of-experts layers (``deepseek_moe.py``).

Module and parameter names mirror transformers, so a checkpoint loads by name.
Per layer and token the cache holds ONE latent row ``[c | k_rope]`` (MLASpec):

    q      = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))   (T, H, nope + rope)
    [c | k_rope] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)    (T, rank), (T, rope)
    (with q_lora, q_a_proj and kv_a_proj_with_mqa are one GEMM, ``qkv_a_proj``)
    rope on q's rope part and on k_rope (one shared head)
    kv_b_proj.weight viewed (H, nope + v, rank) = [W_UK ; W_UV] per head

Attention runs in one of two forms, the step's choice (``expands_mla``, a host
bool made once per step: decode steps absorb; extend steps take the cheaper form
by the cost rule of ``unikv/engine/attention.py``, anchored on the H200, where a 4k
prefill of a DeepSeek-V3 layer ran 13x faster expanded):

- absorbed (``mla``): ``q_latent = q_nope @ W_UK`` (T, H, rank) attends over the
  cached rows with logits ``q_latent . c + q_rope . k_rope``; its output (T, H,
  rank) is mapped back by W_UV;
- expanded (``mla_expanded``): the step gathers the context's rows and up-projects
  them with kv_b_proj (k_nope = W_UK c, v = W_UV c, transformers' own form); the
  full queries ``[q_nope | q_rope]`` attend over ``[k_nope | k_rope]``.

Both are the same math up to rounding; o_proj follows.

- Softmax scale ``(nope + rope) ** -0.5``, times ``mscale(factor, mscale_all_dim)**2``
  for a scaled rope with ``mscale_all_dim`` (DeepSeek's YaRN; its attention factor
  on cos/sin comes from ``rope.py``).
- Rope layout: V2 rotates interleaved pairs (x0, x1), (x2, x3), ... in fp32 and
  keeps them interleaved (transformers' complex product); V3 with ``rope_interleave``
  rotates the same pairs in the model dtype and writes them de-interleaved
  ``[evens' | odds']`` (``apply_rotary_pos_emb_interleave``); V3 without it is
  NeoX's rotate-half. The cached k_rope has exactly transformers' layout.
- ``q_a_layernorm`` and ``kv_a_layernorm`` use eps 1e-6 (transformers' default).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
from torch import nn

from unikv.models import decoder
from unikv.models.config import ModelConfig
from unikv.models.deepseek_moe import DeepseekMoE, check_moe_fields
from unikv.models.layers import GatedMLP, Linear, RMSNorm
from unikv.models.parallel import linear_layers, tp_size
from unikv.models.rope import Rotary

MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
LATENT_NORM_EPS = 1e-6


class MLAFn(Protocol):
    """The step object's MLA ops (``unikv.engine.attention``): store the step's
    latent rows of ``layer`` and attend in the form ``expands_mla`` chose for the step.

    ``mla``: q_latent (T, H, rank), q_rope (T, H, rope), latent (T, rank), rope
    (T, rope) in the model dtype; sm_scale: the softmax scale -> (T, H, rank).
    ``mla_expanded``: q (T, H, nope + rope), latent, rope as above, kv_b_weight
    (H * (nope + v), rank) -> (T, H, v)."""

    def expands_mla(self, layer, *, heads, rank, rope, nope, v_dim) -> bool: ...

    def mla(self, layer, q_latent, q_rope, latent, rope, sm_scale) -> torch.Tensor: ...

    def mla_expanded(self, layer, q, latent, rope, kv_b_weight, sm_scale) -> torch.Tensor: ...


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(rope: dict, qk_head_dim: int) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` when the
    rope is scaled and ``mscale_all_dim`` is set (transformers' yarn_apply_mscale)."""
    scale = qk_head_dim**-0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= _mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def config_extras(hf_config) -> dict:
    """DeepSeek's own fields (into ``ModelConfig.extra``). ValueError naming the
    field when an MLA width is missing or the routing is not one unikv runs."""
    model_type = getattr(hf_config, "model_type", "deepseek")
    missing = [n for n in MLA_FIELDS if getattr(hf_config, n, None) is None]
    if missing:
        raise ValueError(
            f"{model_type} config lacks {missing}: an MLA model needs kv_lora_rank (the cached "
            "latent width), qk_nope_head_dim, qk_rope_head_dim and v_head_dim; fix config.json"
        )
    extra = {n: int(getattr(hf_config, n)) for n in MLA_FIELDS}
    q_lora = getattr(hf_config, "q_lora_rank", None)
    version = 3 if model_type == "deepseek_v3" else 2

    def get(name, default):
        value = getattr(hf_config, name, None)
        return default if value is None else value

    extra.update(
        version=version,
        q_lora_rank=int(q_lora) if q_lora else None,
        attention_bias=bool(get("attention_bias", False)),
        mlp_bias=bool(get("mlp_bias", False)) if version == 2 else False,
        rope_layout="complex" if version == 2 else "interleave",
        first_k_dense_replace=int(get("first_k_dense_replace", 0)),
        n_routed_experts=int(get("n_routed_experts", 0)),
        n_shared_experts=int(get("n_shared_experts", 0)),
        num_experts_per_tok=int(get("num_experts_per_tok", 1)),
        moe_intermediate_size=int(get("moe_intermediate_size", 0)),
        n_group=int(get("n_group", 1)),
        topk_group=int(get("topk_group", 1)),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(get("norm_topk_prob", False)),
        topk_method=get("topk_method", "greedy") if version == 2 else "noaux_tc",
    )
    if version == 3 and not get("rope_interleave", True):
        extra["rope_layout"] = "neox"
    check_moe_fields(extra, model_type)
    rope = dict(getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"})
    extra["mla_sm_scale"] = softmax_scale(
        rope, extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"]
    )
    return extra


class DeepseekRotary(Rotary):
    """Rope over the rope dims only, in DeepSeek's layouts (module docstring):
    ``layout`` "complex" (V2), "interleave" (V3) or "neox"."""

    def __init__(self, params: dict, rope_dim: int, max_positions: int, layout: str) -> None:
        super().__init__(params, rope_dim, max_positions)
        self.layout = layout

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: (T,) int64; q: (T, H, rope); k: (T, 1, rope) -> rotated (q, k)."""
        if self.layout == "neox":  # a host str fixed at construction
            return super().forward(positions, q, k)
        # the pair layouts: one launch for q and k (``rope_pairs``; the tables carry
        # the attention factor)
        return self.ops.rope_pairs(q, k, self.cos, self.sin, positions, self.layout)


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention; see the module docstring.

    With ``tp`` this rank holds 1/tp of the heads: q_proj (or q_b_proj), kv_b_proj
    (each head's W_UK and W_UV rows) column-parallel by heads, o_proj row-parallel;
    q_a_proj, kv_a_proj_with_mqa and their norms replicated, so every rank computes
    and caches the whole latent row (the MLA sub-pool is not sharded) and attends
    with its own heads only, in either form."""

    # read as matrices (absorbed into the queries, or the expanded form's up-projection):
    # an FP8 checkpoint's kv_b_proj is dequantised at load (``fp8_linear``)
    dense_linears = ("kv_b_proj",)
    # read through views only (split along the last dim): an FP8 one may be held padded
    # to whole 128-row blocks for the prefill GEMM (``fp8_linear.Fp8BlockLinear``)
    strided_outputs = ("qkv_a_proj", "kv_a_proj_with_mqa")

    def __init__(self, config: ModelConfig, layer: int, rotary: DeepseekRotary, tp=None) -> None:
        super().__init__()
        e, hidden = config.extra, config.hidden_size
        column, row = linear_layers(tp)
        self.layer, self.num_heads = layer, config.num_heads // tp_size(tp)
        self.nope, self.rope = e["qk_nope_head_dim"], e["qk_rope_head_dim"]
        self.rank, self.v_dim = e["kv_lora_rank"], e["v_head_dim"]
        self.sm_scale, self.q_lora = e["mla_sm_scale"], e["q_lora_rank"] is not None
        qk, heads, bias = self.nope + self.rope, self.num_heads, e["attention_bias"]
        self.packed = {}
        if e["q_lora_rank"] is None:
            self.q_proj = column(hidden, heads * qk, bias=False)
            self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias=bias)
        else:  # q_a and kv_a (both replicated under tp) as one GEMM: [q_a | c | k_rope]
            self.q_a = e["q_lora_rank"]
            self.qkv_a_proj = Linear(hidden, self.q_a + self.rank + self.rope, bias=bias)
            self.packed = {"qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
            self.q_a_layernorm = RMSNorm(e["q_lora_rank"], LATENT_NORM_EPS)
            self.q_b_proj = column(e["q_lora_rank"], heads * qk, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = column(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = row(heads * self.v_dim, hidden, bias=bias)
        self.rotary = [rotary]  # shared, kept out of this module's parameters
        self.widths = {"heads": heads, "rank": self.rank, "rope": self.rope}
        self.widths.update(nope=self.nope, v_dim=self.v_dim)  # the step's expands_mla inputs

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: MLAFn) -> torch.Tensor:
        """x: (T, hidden); positions: (T,) int64 -> (T, hidden)."""
        if self.q_lora:  # a host bool fixed by the config (V2-Lite has no q_lora)
            return self.from_input(self.qkv_a_proj(x), positions, attn)
        q = self.q_proj(x)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        return self.attend(q, latent, k_rope, positions, attn)

    def input_linear(self) -> nn.Module | None:
        """The q_a|kv_a GEMM a decoder may fuse the pre-norm into (``decoder.Block``),
        where it is a plain ``Linear`` or an FP8 one whose x the norm may quantise
        (``fuses_norm``), else None."""
        fused = getattr(self, "qkv_a_proj", None)
        return fused if type(fused) is Linear or getattr(fused, "fuses_norm", False) else None

    def from_input(self, qkv_a: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """``forward`` after the q_a|kv_a GEMM: (T, q_lora + rank + rope)."""
        q_a, latent, k_rope = qkv_a.split([self.q_a, self.rank, self.rope], dim=-1)
        q = self.q_b_proj(self.q_a_layernorm(q_a))
        return self.attend(q, latent, k_rope, positions, attn)

    def attend(self, q, latent, k_rope, positions: torch.Tensor, attn: MLAFn) -> torch.Tensor:
        """After the input GEMMs: q (T, H (nope + rope)), latent (T, rank) before its
        norm, k_rope (T, rope) -> (T, hidden)."""
        t, heads = q.shape[0], self.num_heads
        q_nope, q_rope = q.view(t, heads, -1).split([self.nope, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # (T, rank): the cached c
        q_rope, k_rope = self.rotary[0](positions, q_rope, k_rope[:, None, :])
        if attn.expands_mla(self.layer, **self.widths):  # a host bool, one per step
            q = torch.cat([q_nope, q_rope], dim=-1)  # (T, H, nope + rope)
            weight = self.kv_b_proj.weight  # (H * (nope + v), rank)
            out = attn.mla_expanded(self.layer, q, latent, k_rope[:, 0], weight, self.sm_scale)
            return self.o_proj(out.reshape(t, heads * self.v_dim))
        w = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # (H, nope, rank), (H, v, rank)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (T, H, rank)
        out = attn.mla(self.layer, q_latent, q_rope, latent, k_rope[:, 0], self.sm_scale)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # (T, H, v)
        return self.o_proj(out.reshape(t, heads * self.v_dim))


class DecoderLayer(decoder.DecoderLayer):
    """MLA then an MLP (dense for the first ``first_k_dense_replace`` layers, else the
    MoE), each behind a pre-norm (``decoder.Block``: the dense MLP's inside its gate|up
    GEMM); ``tp``: this rank's shard of each."""

    def __init__(self, config: ModelConfig, layer: int, rotary: DeepseekRotary, tp=None) -> None:
        super().__init__()
        e, eps = config.extra, config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = MLAttention(config, layer, rotary, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        if layer >= e["first_k_dense_replace"]:
            self.mlp = DeepseekMoE(config, tp=tp)
        else:
            self.mlp = GatedMLP(dataclasses.replace(config, mlp_bias=e["mlp_bias"]), tp)
        self.blocks = [
            decoder.Block(self.input_layernorm, self.self_attn, mixes=True),
            decoder.Block(self.post_attention_layernorm, self.mlp, mixes=False),
        ]


class DeepseekForCausalLM(decoder.DecoderLM):
    """DeepSeek-V2 / V3 over unikv's MLA sub-pool, on the shared decoder
    (``decoder.DecoderLM``).

    Args:
        config: the model's hyper-parameters (``extra`` from ``config_extras``).
        max_positions: length of the rope table (the engine's max context).
        tp: None, or a ``models.parallel.TensorParallel``: this rank's heads (the latent
            row whole on every rank, ``MLAttention``), dense MLP columns, routed and
            shared expert rows (``DeepseekMoE``); ``tp_dims`` names the fields.
        ops: as ``decoder.DecoderLM``.
    """

    tensor_parallel = True

    # the V3 routers' score-correction biases: transformers keeps them fp32 in every dtype
    fp32_params = ("e_score_correction_bias",)

    def __init__(self, config: ModelConfig, max_positions: int, tp=None, **kw) -> None:
        super().__init__(config, max_positions, tp, **kw)
        # V3 checkpoints append their multi-token-prediction layer(s) after the last one
        self.ignore_checkpoint_prefixes = (f"model.layers.{config.num_layers}.",)

    def check(self, config: ModelConfig, tp) -> None:
        super().check(config, tp)
        if config.hidden_act != "silu":
            raise ValueError(
                f"hidden_act {config.hidden_act!r}: unikv's DeepSeek MLPs run 'silu' only"
            )

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """The query heads (the KV side is the one shared latent: nothing to divide), and
        the intermediate size of each MLP kind the model has (the shared experts' is a
        multiple of ``moe_intermediate_size``)."""
        e = config.extra
        dims = {"num_attention_heads": config.num_heads}
        if e["first_k_dense_replace"] > 0:
            dims["intermediate_size"] = config.intermediate_size
        if e["first_k_dense_replace"] < config.num_layers:
            dims["moe_intermediate_size"] = e["moe_intermediate_size"]
        return dims

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        e = config.extra
        rotary = DeepseekRotary(config.rope, e["qk_rope_head_dim"], max_positions, e["rope_layout"])
        layers = [DecoderLayer(config, i, rotary, tp) for i in range(config.num_layers)]
        return decoder.rms_backbone(config, layers, rotary)
