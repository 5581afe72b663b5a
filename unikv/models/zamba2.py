"""Zamba2 (``Zamba2ForCausalLM``): Mamba-2 layers, some of them fed by a shared
attention block whose weights serve several layers.

    mamba layer i:   h = h + mamba(input_layernorm(h))
    hybrid layer i:  t = linear(shared_b(h, e))          b = (hybrid index j) % num_mem_blocks
                     h = h + mamba(input_layernorm(h + t))

``e`` is the embedding output (transformers' ``original_hidden_states``), the same
for every hybrid layer. The shared block ``b`` (``shared_transformer``):

    x = input_layernorm(cat[h, e])                          (2 hidden wide)
    a = o_proj(attention(q_proj(x) + A_q,j(x), k..., v...)) head_dim = 2 hidden / heads,
                                                            softmax scale (head_dim / 2) ** -0.5,
                                                            rope only with use_mem_rope
    y = pre_ff_layernorm(a)                                 (no residual around either)
    shared_b = down_proj(act(g) * u),  [g | u] = gate_up_proj(y) + A_gu,j(y)

``A_*,j`` are hybrid layer j's own LoRA adapters (``Linear(rank) -> Linear``), kept
in block b's adapter lists at index j (q/k/v only with use_shared_attention_adapter;
the MLP's always). Each hybrid layer has its own K/V cache and Mamba state (kind
"full+mamba": model layer i in both sub-pools), so one block's weights attend over
as many caches as it serves layers.

Checkpoint names are transformers': block b lives under the first hybrid layer that
uses it (``model.layers.i.shared_transformer.*``; later layers tie to it and hold no
tensors of their own), and a hybrid layer's Mamba under ``mamba_decoder``. The Mamba-2
mixer is ``mamba2.Mamba2Mixer``: gated RMSNorm per group (eps 1e-5), step size
clamped at ``time_step_min``, conv bias always present.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from unikv.models import decoder
from unikv.models.config import ModelConfig
from unikv.models.hf import Fields, kinds_zamba2
from unikv.models.layers import Linear, RMSNorm
from unikv.models.mamba2 import Mamba2Dims, Mamba2Mixer
from unikv.models.parallel import Segments, linear_layers, shard_rows, tp_size
from unikv.models.rope import Rotary

ACTIVATIONS = {
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": functools.partial(nn.functional.gelu, approximate="tanh"),
    "silu": nn.functional.silu,
}


def mamba_dims(cfg: Fields) -> Mamba2Dims:
    """The Mamba-2 mixer dims of a Zamba2 config (pool spec and model); defaults are
    transformers' Zamba2Config's. Zamba2's conv always has a bias and its gated norm
    eps is 1e-5 whatever ``rms_norm_eps`` is (transformers' Zamba2MambaMixer)."""
    hidden = cfg.need("hidden_size")
    heads = cfg.get("n_mamba_heads", 8)
    bias = bool(cfg.get("add_bias_linear", False))
    return Mamba2Dims(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=int(cfg.get("mamba_expand", 2) * hidden) // heads,
        n_groups=cfg.get("mamba_ngroups", 1),
        state_size=cfg.get("mamba_d_state", 64),
        conv_kernel=cfg.get("mamba_d_conv", 4),
        conv_bias=True,
        proj_bias=bias,
        out_bias=bias,
        activation="silu",
        eps=1e-5,
        dt_limit=(float(cfg.get("time_step_min", 0.001)), float("inf")),
        fields=("n_mamba_heads", "mamba_ngroups"),
    )


def config_extras(hf_config) -> dict:
    """Zamba2's own fields (for ``ModelConfig.extra``): which layers are hybrid, the
    shared blocks' count and adapters, the attention's width and softmax scale."""
    cfg = Fields(hf_config)
    d = cfg.get("attention_head_dim") or 2 * cfg.need("hidden_size") // cfg.need(
        "num_attention_heads"
    )
    return {
        "hybrid": tuple(k == "full+mamba" for k in kinds_zamba2(cfg)),
        "num_mem_blocks": int(cfg.get("num_mem_blocks", 1)),
        "q_adapters": bool(cfg.get("use_shared_attention_adapter", False)),
        "adapter_rank": int(cfg.get("adapter_rank", 128)),
        "use_mem_rope": bool(cfg.get("use_mem_rope", False)),
        "add_bias_linear": bool(cfg.get("add_bias_linear", False)),
        "sm_scale": (d / 2) ** -0.5,
    }


def _adapters(count: int, owner, fan_in: int, fan_out: int, rank: int, shard=None) -> nn.ModuleList:
    """One LoRA adapter per hybrid layer j that ``owner(j)``, Identity for the others
    (the checkpoint's list layout: index j is hybrid layer j's). ``shard``: under
    tensor parallelism, how the up matrix splits (``fan_out`` is then the rank's);
    the down matrix is replicated."""

    def adapter() -> nn.Sequential:
        up = Linear(rank, fan_out, bias=False)
        return nn.Sequential(Linear(fan_in, rank, bias=False), up if shard is None else
                             shard_rows(up, shard))  # fmt: skip

    return nn.ModuleList(adapter() if owner(j) else nn.Identity() for j in range(count))


class SharedAttention(nn.Module):
    """The shared block's attention: one q|k|v GEMM (``qkv_proj``, loaded from
    q/k/v_proj) over the 2-hidden-wide normed input, each hybrid layer's adapters
    added, rope where ``use_mem_rope``, then paged attention on the calling layer's
    own cache. Under ``tp`` this rank's heads: q|k|v rows and each adapter's up rows
    by heads, o_proj row-parallel."""

    def __init__(
        self, config: ModelConfig, rotary: Rotary | None, owner, count: int, tp=None
    ) -> None:
        super().__init__()
        e, wide, d, n = config.extra, 2 * config.hidden_size, config.head_dim, tp_size(tp)
        self.num_heads, self.num_kv_heads = config.num_heads // n, config.num_kv_heads // n
        self.head_dim = d
        self.split = (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        self.qkv_proj = Linear(wide, sum(self.split), bias=False)
        self.packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
        if tp is not None:  # q, k and v each by heads
            shard_rows(self.qkv_proj)
        self.o_proj = linear_layers(tp)[1](self.num_heads * d, config.hidden_size, bias=False)
        self.adapters = e["q_adapters"]  # a host bool of the config
        if self.adapters:  # (num_kv_heads == num_heads: each adapter is q's width)
            r, shard = e["adapter_rank"], None if tp is None else 0
            for name in ("q", "k", "v"):
                lists = _adapters(count, owner, wide, self.num_heads * d, r, shard)
                setattr(self, f"linear_{name}_adapter_list", lists)
        self.rotary = [rotary]  # shared, kept out of the parameters

    def forward(self, x: torch.Tensor, j: int, layer: int, positions, attn) -> torch.Tensor:
        """x: (T, 2 hidden) normed; j: the hybrid index; layer: the model layer whose
        cache it attends over -> (T, hidden)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        if self.adapters:
            q = q + self.linear_q_adapter_list[j](x)
            k = k + self.linear_k_adapter_list[j](x)
            v = v + self.linear_v_adapter_list[j](x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        rotary = self.rotary[0]
        if rotary is None:
            out = attn(layer, q, k, v, None)
        elif getattr(attn, "fuses_rope", False):  # the engine's: rope inside the K/V store
            out = attn(layer, q, k, v, None, rope=(rotary, positions))
        else:
            q, k = rotary(positions, q, k)
            out = attn(layer, q, k, v, None)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class SharedMLP(nn.Module):
    """``down_proj(act(g) * u)``, [g | u] = ``gate_up_proj(y)`` + hybrid layer j's adapter.
    Under ``tp`` g and u by columns (the adapters' up rows likewise), down_proj
    row-parallel."""

    def __init__(self, config: ModelConfig, owner, count: int, tp=None) -> None:
        super().__init__()
        h, full, bias = (
            config.hidden_size,
            config.intermediate_size,
            config.extra["add_bias_linear"],
        )
        i = full // tp_size(tp)
        halves = None if tp is None else Segments(0, ((full, full), (full, full)))
        self.gate_up_proj = Linear(h, 2 * i, bias=bias)
        if tp is not None:
            shard_rows(self.gate_up_proj, halves)
        self.down_proj = linear_layers(tp)[1](i, h, bias=bias)
        self.gate_up_proj_adapter_list = _adapters(
            count, owner, h, 2 * i, config.extra["adapter_rank"], halves
        )
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, y: torch.Tensor, j: int) -> torch.Tensor:
        gate_up = self.gate_up_proj(y) + self.gate_up_proj_adapter_list[j](y)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SharedBlock(nn.Module):
    """Shared transformer block ``b`` (``shared_transformer``); see the module
    docstring. Its norms run unfused: the adapters read the normed input too, and
    neither sub-block has a residual add to fuse."""

    def __init__(self, config: ModelConfig, rotary: Rotary | None, block: int, tp=None) -> None:
        super().__init__()
        e, h = config.extra, config.hidden_size
        count = sum(e["hybrid"])

        def owner(j: int) -> bool:
            return j % e["num_mem_blocks"] == block

        self.input_layernorm = RMSNorm(2 * h, config.rms_norm_eps)
        self.self_attn = SharedAttention(config, rotary, owner, count, tp)
        self.pre_ff_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.feed_forward = SharedMLP(config, owner, count, tp)

    def forward(self, h, embeds, j: int, layer: int, positions, attn) -> torch.Tensor:
        """h: (T, hidden) the residual stream; embeds: (T, hidden) the embeddings ->
        (T, hidden), before the hybrid layer's ``linear``."""
        x = self.input_layernorm(torch.cat([h, embeds], dim=-1))
        a = self.self_attn(x, j, layer, positions, attn)
        return self.feed_forward(self.pre_ff_layernorm(a), j)


class Embeddings:
    """The step's embedding output, set by the model before the first layer and read
    by every hybrid layer (a host reference, fixed per forward)."""

    value: torch.Tensor | None = None


class MambaLayer(decoder.DecoderLayer):
    """``h + mamba(input_layernorm(h))``: one fused ``decoder.Block``."""

    def __init__(self, config: ModelConfig, layer: int, tp=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = Mamba2Mixer(config.state_dims, layer, tp)
        self.blocks = [decoder.Block(self.input_layernorm, self.mamba, mixes=True)]


class HybridLayer(decoder.DecoderLayer):
    """Hybrid layer ``layer`` (the ``j``-th): the shared block's output through
    ``linear`` joins the stream at the Mamba's input only, not the residual, so the
    layer runs its own ``forward`` (the decoder's (h, residual) pair in and out);
    ``blocks`` names its Mamba block for the decoder's introspection."""

    def __init__(
        self, config: ModelConfig, layer: int, j: int, shared: SharedBlock, owns: bool,
        embeds: Embeddings, tp=None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.layer, self.j, self.embeds = layer, j, embeds
        self.linear = Linear(config.hidden_size, config.hidden_size, bias=False)  # replicated
        self.mamba_decoder = MambaLayer(config, layer, tp)
        if owns:  # the first layer of block b holds its weights (the checkpoint's names)
            self.shared_transformer = shared
        self.shared = [shared]  # the others refer to it, outside their parameters
        self.blocks = self.mamba_decoder.blocks

    def forward(self, h, residual, positions, attn) -> tuple[torch.Tensor, torch.Tensor]:
        stream = h if residual is None else h + residual
        t = self.shared[0](stream, self.embeds.value, self.j, self.layer, positions, attn)
        t = self.linear(t)
        x = self.mamba_decoder.input_layernorm(stream + t)
        return self.mamba_decoder.mamba(x, positions, attn), stream

    def after_input(self, y, residual, positions, attn):
        raise AssertionError("a Zamba2 hybrid layer never takes the embedding inside a GEMM")


class Zamba2ForCausalLM(decoder.DecoderLM):
    """Zamba2 on the shared decoder. It opts out of the embedding inside the first
    GEMM: the hybrid layers need the embeddings themselves, which ``scale_embedding``
    (an identity on the values) keeps for them. Mamba layers keep the fused norms;
    the head keeps the argmax inside its GEMM. Under tensor parallelism: the Mamba-2
    heads (and their state), the shared blocks' heads and MLP columns with their
    adapters' up matrices; the hybrid layers' ``linear`` replicated.

    Args: as ``bamba.BambaForCausalLM`` (Zamba2's fields in ``extra``:
    ``config_extras``); ``max_positions`` sizes the rope table where
    ``use_mem_rope``.
    """

    tensor_parallel = True
    scales_embedding = True

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """The shared blocks' heads and MLP width where a layer is hybrid, and
        ``n_mamba_heads`` (the groups: ``Mamba2Dims.shard``)."""
        dims = {"n_mamba_heads": config.state_dims.num_heads}
        if any(config.extra["hybrid"]):
            dims.update(super().tp_dims(config))
        return dims

    def check(self, config: ModelConfig, tp) -> None:
        super().check(config, tp)
        e = config.extra
        if len(e["hybrid"]) != config.num_layers:
            raise ValueError(
                f"Zamba2 layers_block_type lists {len(e['hybrid'])} layers, num_hidden_layers "
                f"is {config.num_layers}; fix the config"
            )
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"Zamba2 hidden_act must be one of {sorted(ACTIVATIONS)}, got {config.hidden_act!r}"
            )
        if e["q_adapters"] and config.num_kv_heads != config.num_heads:
            raise ValueError(
                "Zamba2 with use_shared_attention_adapter needs num_key_value_heads == "
                f"num_attention_heads (the k/v adapters are 2 hidden wide), got "
                f"{config.num_kv_heads} and {config.num_heads}"
            )
        if e["num_mem_blocks"] < 1:
            raise ValueError(f"Zamba2 num_mem_blocks must be >= 1, got {e['num_mem_blocks']}")

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> decoder.Backbone:
        e = config.extra
        rotary = Rotary(config.rope, config.head_dim, max_positions) if e["use_mem_rope"] else None
        self.embeds = Embeddings()
        blocks: dict[int, SharedBlock] = {}
        layers, j = [], 0
        tied = []
        for i, hybrid in enumerate(e["hybrid"]):
            if not hybrid:
                layers.append(MambaLayer(config, i, tp))
                continue
            b = j % e["num_mem_blocks"]
            owns = b not in blocks
            if owns:
                blocks[b] = SharedBlock(config, rotary, b, tp)
            else:
                tied.append(i)
            layers.append(HybridLayer(config, i, j, blocks[b], owns, self.embeds, tp))
            j += 1
        # a checkpoint may also carry the tied copies of a shared block: unused
        self.ignore_checkpoint_prefixes = tuple(
            f"model.layers.{i}.shared_transformer." for i in tied
        )
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        return decoder.Backbone(embed, layers, norm, rotary, ("embed_tokens", "final_layernorm"))

    def scale_embedding(self, h: torch.Tensor) -> torch.Tensor:
        """Keeps the embeddings for the hybrid layers; the stream gets a copy (the
        fused residual adds may write into it)."""
        self.embeds.value = h
        return h.clone()
