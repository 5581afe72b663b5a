"""Qwen3.5 (text, ``Qwen3_5ForCausalLM``): a hybrid of Gated DeltaNet
("linear_attention") layers and gated full-attention layers, on unikv's layers.

Qwen3-Next (``qwen3_next.py``) shares everything here but its packed input
projections and its MoE block. Module and parameter names mirror transformers
(``model.layers.i.linear_attn.in_proj_qkv``, ``...self_attn.q_proj``), so a
checkpoint loads by name, except that each mixer's input projections run as one
GEMM (``in_proj``, ``qkv_proj``), filled at load with the checkpoint's tensors
concatenated (their ``packed`` maps), and the decoder fuses the pre-norm into it. Tokens of a step are flattened over the batch:
``input_ids``/``positions`` are (T,).

- Norms are zero-centred: ``x_hat * (1 + w)`` in fp32, then cast (``ZeroCenteredRMSNorm``).
- Full attention: ``q_proj`` gives, per head, q and an output gate (2D wide);
  q/k norms (one kernel, ``qk_rms_norm``); partial rotary (inside the engine's K/V
  store, as ``layers.Attention``); ``attn(layer, q, k, v)``; ``out * sigmoid(gate)``
  (one kernel, ``sigmoid_mul``); o_proj.
- Gated DeltaNet: q/k/v through a depthwise causal conv (silu) over
  ``conv_dim = 2 Hk Dk + Hv Dv`` channels, beta = sigmoid(b),
  g = -exp(A_log) * softplus(a + dt_bias) (fp32), value head h reading q/k head
  h // (Hv / Hk) (the gates and the GQA mapping inside the op: ``gating``), the
  gated delta rule (l2-normed q/k, scale Dk**-0.5),
  a gated RMSNorm with z, out_proj. The conv and the recurrence go through the
  step object (``StateFn``): their state lives in the request's pool slot.
- Tensor parallelism (``models/parallel.py``): a rank runs ``state_dims.shard(tp)``,
  its value heads and the key heads they read, the one input GEMM narrowed per
  checkpoint part (``projection_shards``), out_proj row-parallel; attention by heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from unikv.models import decoder
from unikv.models.config import ModelConfig
from unikv.models.hf import Fields
from unikv.models.layers import AttentionFn, GatedMLP, Linear, RMSNorm, StateFn, model_ops
from unikv.models.parallel import Segments, linear_layers, shard_rows, tp_size
from unikv.models.rope import Rotary


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """One Gated DeltaNet mixer's heads: Hk key heads of Dk, Hv value heads of Dv, a
    causal conv of ``conv_kernel`` taps over q, k and v."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """The delta-rule state of one request: (Hv, Dk, Dv)."""
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def shard(self, size: int) -> GatedDeltaNetDims:
        """One of ``size`` tensor-parallel ranks' dims: value heads / size; key heads /
        size, or (``size`` a multiple of them) the one key head the rank's value heads
        read. ValueError naming the fields otherwise."""
        if size == 1:
            return self
        hk, hv = self.num_k_heads, self.num_v_heads
        if hv % size or (hk % size and size % hk):
            raise ValueError(
                f"tensor parallelism of {size} needs linear_num_value_heads ({hv}) divisible "
                f"by {size} and linear_num_key_heads ({hk}) divisible by {size} or dividing "
                "it; use a tensor-parallel size that splits the Gated DeltaNet heads"
            )
        local_k = hk // size if hk % size == 0 else 1
        return dataclasses.replace(self, num_k_heads=local_k, num_v_heads=hv // size)

    def segments(self) -> Segments:
        """How [q | k | v] (the conv's channels, ``in_proj_qkv``'s rows) split over ranks:
        q and k by key heads, v by value heads."""
        hk, hv = self.num_k_heads, self.num_v_heads
        return Segments(0, ((self.key_dim, hk), (self.key_dim, hk), (self.value_dim, hv)))


def gdn_dims(cfg: Fields) -> GatedDeltaNetDims:
    """The Gated DeltaNet dims of a Qwen3.5 / Qwen3-Next config (the pool's state spec
    and the model's mixer both come from here); defaults are transformers'."""
    return GatedDeltaNetDims(
        num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        head_k_dim=int(cfg.get("linear_key_head_dim", 128)),
        head_v_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )


def config_extras(hf_config) -> dict:
    """Qwen3.5's own fields (into ``ModelConfig.extra``): ``layer_types`` (the Gated
    DeltaNet shapes: ``gdn_dims``). ValueError when the value heads are not a
    multiple of the key heads."""
    dims = gdn_dims(Fields(hf_config))
    hk, hv = dims.num_k_heads, dims.num_v_heads
    if hv % hk:
        raise ValueError(
            f"linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk}); "
            "fix config.json"
        )
    return {"layer_types": tuple(hf_config.layer_types)}


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm with weight ``1 + w`` (w stored zero-centred), multiplied in fp32
    before the cast back (transformers' ``Qwen3_5RMSNorm``), through the backend's
    norm ops (``offset`` 1), so the decoder fuses the residual add into it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps, weight_in_fp32=True, offset=1.0)


class GatedRMSNorm(nn.Module):
    """``w * rmsnorm(x) * silu(gate)`` over each head's ``dim`` values (transformers'
    ``Qwen3_5RMSNormGated``): norm in fp32, weight in x's dtype, gate in fp32; one
    backend op (``gated_rms_norm``, ``weight_mode="dtype_before_gate"``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = model_ops(None)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: (T, H * dim) -> (T, H * dim), each head normalised on its own."""
        return self.ops.gated_rms_norm(  # the (dim,) weight serves every head
            x, gate, self.weight, self.eps, group_size=self.weight.shape[0],
            weight_mode="dtype_before_gate",
        )  # fmt: skip


class GatedAttention(nn.Module):
    """Full attention with a per-head sigmoid output gate; ``q_proj`` packs, per
    head, D query dims then D gate dims. q, k and v come from one GEMM,
    ``qkv_proj``, loaded from the checkpoint's ``q_proj``, ``k_proj``, ``v_proj``
    (``packed``), into which the decoder fuses the pre-norm (``input_linear``)."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary, tp=None) -> None:
        super().__init__()
        hidden, d, n = config.hidden_size, config.head_dim, tp_size(tp)
        self.layer, self.head_dim = layer, d
        self.num_heads, self.num_kv_heads = config.num_heads // n, config.num_kv_heads // n
        self.split = (2 * self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        self.qkv_proj = Linear(hidden, sum(self.split), bias=config.qkv_bias)
        self.packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
        if tp is not None:  # q|gate, k, v each by heads (q_proj packs q and gate per head)
            shard_rows(self.qkv_proj)
        self.o_proj = linear_layers(tp)[1](self.num_heads * d, hidden, bias=config.o_bias)
        self.q_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps)
        self.rotary = [rotary]  # shared, kept out of this module's parameters
        self.ops = model_ops()  # the q|k norms' and the output gate's kernels

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """x: (T, hidden); positions: (T,) int64 -> (T, hidden)."""
        return self.from_input(self.qkv_proj(x), positions, attn)

    def input_linear(self) -> nn.Linear:
        return self.qkv_proj

    def from_input(self, qkv: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """``forward`` after the q|k|v GEMM: qkv (T, 2 Hq D + 2 Hkv D) -> (T, hidden)."""
        t, h, d = qkv.shape[0], self.num_heads, self.head_dim
        q_gate, k, v = qkv.split(self.split, dim=-1)
        q, gate = q_gate.view(t, h, 2 * d).chunk(2, dim=-1)  # (T, H, D) each
        q, k = self.ops.qk_rms_norm(  # both norms in one launch
            q, k.view(t, self.num_kv_heads, d), self.q_norm.weight, self.k_norm.weight,
            self.q_norm.eps, **self.q_norm.kw,
        )  # fmt: skip
        v = v.view(t, self.num_kv_heads, d)
        if getattr(attn, "fuses_rope", False):  # the engine's: rope inside the K/V store
            out = attn(self.layer, q, k, v, None, rope=(self.rotary[0], positions))
        else:
            q, k = self.rotary[0](positions, q, k)
            out = attn(self.layer, q, k, v)  # (T, H, D)
        # out * sigmoid(gate) in one launch, the gate read in place from the GEMM's output
        return self.o_proj(self.ops.sigmoid_mul(out, gate).reshape(t, h * d))


class GatedDeltaNet(nn.Module):
    """Qwen3.5's Gated DeltaNet mixer. Its input projections run as one GEMM,
    ``in_proj``, loaded from the checkpoint's ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a`` (``packed``), into which the decoder fuses the
    pre-norm (``input_linear``). Subclasses change ``make_projections`` and ``unpack``
    only (Qwen3-Next's checkpoint packs them per key head)."""

    def __init__(self, config: ModelConfig, layer: int, tp=None) -> None:
        super().__init__()
        full, hidden = config.state_dims, config.hidden_size
        d = full.shard(tp_size(tp))  # this rank's heads
        if config.hidden_act != "silu":
            raise ValueError(
                f"hidden_act {config.hidden_act!r}: the Gated DeltaNet conv runs 'silu' only"
            )
        self.layer = layer
        self.num_k_heads, self.num_v_heads = d.num_k_heads, d.num_v_heads
        self.head_k_dim, self.head_v_dim = d.head_k_dim, d.head_v_dim
        self.key_dim, self.value_dim, self.conv_dim = d.key_dim, d.value_dim, d.conv_dim
        kernel = d.conv_kernel
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False
        )  # weight (C, 1, K); only the weight is used, by the step's causal conv
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)  # per head: replicated
        self.out_proj = linear_layers(tp)[1](self.value_dim, hidden, bias=False)
        self.make_projections(hidden)
        if tp is not None:
            # tensor parallelism: the rank's heads of every input projection (the one
            # GEMM stays a plain Linear: the pre-norm fuses into it), the conv's channels,
            # dt_bias and A_log; out_proj row-parallel (one all-reduce)
            shard_rows(self.conv1d, full.segments())
            self.tp_shards = {**self.projection_shards(full), "dt_bias": 0, "A_log": 0}

    def make_projections(self, hidden: int) -> None:
        self.split = (self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads)
        self.in_proj = Linear(hidden, sum(self.split), bias=False)
        self.packed = {"in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}

    def projection_shards(self, full: GatedDeltaNetDims) -> dict:
        """How each checkpoint input projection splits over ranks (``parallel.shard_plan``):
        [q | k | v] by segments, z, b and a by value heads."""
        return {"in_proj_qkv.weight": full.segments(), "in_proj_z.weight": 0,
                "in_proj_b.weight": 0, "in_proj_a.weight": 0}  # fmt: skip

    def unpack(self, y: torch.Tensor):
        """The one input GEMM's output y (T, conv_dim + Hv Dv + 2 Hv) -> (qkv (T,
        conv_dim) as [q | k | v], z (T, Hv, Dv), b (T, Hv), a (T, Hv)), views of y."""
        qkv, z, b, a = y.split(self.split, dim=-1)
        return qkv, z.view(y.shape[0], self.num_v_heads, self.head_v_dim), b, a

    def input_linear(self) -> nn.Linear:
        return self.in_proj

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: StateFn) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden); reads and updates this layer's conv and
        delta-rule states through ``attn``."""
        return self.from_input(self.in_proj(x), positions, attn)

    def from_input(self, y: torch.Tensor, positions: torch.Tensor, attn: StateFn) -> torch.Tensor:
        """``forward`` after the input GEMM (``input_linear``)."""
        t = y.shape[0]
        qkv, z, b, a = self.unpack(y)
        weight = self.conv1d.weight.view(self.conv_dim, -1)  # (C, K)
        qkv = attn.causal_conv1d(self.layer, qkv, weight, None, "silu")  # (T, C)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)
        out = attn.gated_delta_rule(  # the gates and the GQA heads inside the op
            self.layer, q, k, v, a, b, scale=self.head_k_dim**-0.5, use_qk_l2norm=True,
            gating=(self.A_log, self.dt_bias),
        )  # (T, Hv, Dv)  # fmt: skip
        out = self.norm(out.reshape(t, self.value_dim), z.reshape(t, self.value_dim))
        return self.out_proj(out)


class DecoderLayer(decoder.DecoderLayer):
    """One hybrid layer: a token mixer (``linear_attn`` or ``self_attn``) and an MLP,
    each behind a zero-centred pre-norm and a residual (``decoder.Block``)."""

    def __init__(
        self, config: ModelConfig, layer: int, rotary: Rotary, mixer: type, mlp: nn.Module, tp=None
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)
        if config.extra["layer_types"][layer] == "linear_attention":
            self.linear_attn = body = mixer(config, layer, tp)
        else:
            self.self_attn = body = GatedAttention(config, layer, rotary, tp)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)
        self.mlp = mlp
        self.blocks = [
            decoder.Block(self.input_layernorm, body, mixes=True),
            decoder.Block(self.post_attention_layernorm, mlp, mixes=False),
        ]


def _check_layer_types(config: ModelConfig) -> None:
    types = config.extra.get("layer_types", ())
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if len(types) != config.num_layers or bad:
        raise ValueError(
            f"{config.architecture} needs layer_types of {config.num_layers} entries, each "
            f"'linear_attention' or 'full_attention'; got {list(types)}: fix config.json"
        )


class Qwen3_5ForCausalLM(decoder.DecoderLM):
    """Qwen3.5 (text) over unikv's paged attention and recurrent-state slots, on the
    shared decoder (``decoder.DecoderLM``: residual adds inside the zero-centred norms,
    the dense MLP's pre-norm inside its gate|up GEMM, the head's fast path).

    Args:
        config: the model's hyper-parameters (``extra`` from ``config_extras``).
        max_positions: length of the rope table (the engine's max context).
        tp: None, or a ``models.parallel.TensorParallel``: this rank's Gated DeltaNet
            heads (and their state), attention heads and MLP columns.
        ops: as ``decoder.DecoderLM``.
    """

    tensor_parallel = True
    mixer: type = GatedDeltaNet
    # checkpoint tensors the target does not run (the multi-token-prediction head), as
    # transformers' _keys_to_ignore_on_load_unexpected; speculative_config={"method":
    # "mtp"} loads its first layer as a draft (models/mtp.py)
    ignore_checkpoint_prefixes = ("mtp.",)

    def check(self, config: ModelConfig, tp) -> None:
        super().check(config, tp)
        _check_layer_types(config)

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        rotary = Rotary(config.rope, config.head_dim, max_positions)
        layers = [
            DecoderLayer(config, i, rotary, self.mixer, self.make_mlp(config, i, tp), tp)
            for i in range(config.num_layers)
        ]
        norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        return decoder.Backbone(embed, layers, norm, rotary)

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """Attention heads, the dense MLP's columns and the value heads (the key heads:
        ``GatedDeltaNetDims.shard``)."""
        return {
            **super().tp_dims(config),
            "linear_num_value_heads": config.state_dims.num_v_heads,
        }

    @staticmethod
    def make_mlp(config: ModelConfig, layer: int, tp=None) -> nn.Module:
        return GatedMLP(config, tp)
