"""Tensor parallelism over torch.distributed (Megatron-style, no sequence split).

With ``tp`` ranks, every rank holds a 1/tp slice of each layer and all ranks
see the same tokens:

    attention  q/k/v_proj  column-parallel by heads   rank r: q heads [r*Hq/tp, (r+1)*Hq/tp),
                                                       kv heads [r*H/tp, (r+1)*H/tp)
                                                       (MiMo: each layer type's own H)
               sinks       sliced like the q heads
               o_proj      row-parallel: partial sum on each rank, all-reduce, + bias
    MLA        q_proj or q_b_proj, kv_b_proj (each head's W_UK and W_UV rows):
                           column-parallel by heads; o_proj row-parallel
               q_a_proj, kv_a_proj_with_mqa and their norms: replicated, so every
                           rank computes the whole latent row [c | k_rope] and caches
                           it (the MLA sub-pool is not split); the absorbed and the
                           expanded forms attend with the rank's heads only
    MLP        gate/up     column-parallel on the intermediate dim
               down_proj   row-parallel + all-reduce
    MoE        experts     every expert sharded on its intermediate dim (gate/up
                           rows, or gpt-oss's interleaved gate_up columns with each
                           pair kept together; down_proj columns); the router is
                           replicated, so every rank routes alike; shared experts
                           (DeepSeek, Qwen3-Next, NemotronH) sharded the same way;
                           the routed and shared partial sums are added, then ONE
                           all-reduce; a down bias is added by rank 0 only
                           (``RowParallelLinear(reduce=False)``); gates and
                           NemotronH's latent projections replicated
    Gated      in_proj     by heads, one GEMM still (a plain Linear: the pre-norm
    DeltaNet               fuses into it): [q | k | v] rows by key / value heads
    (Qwen3.5,              (``Segments``), z, b, a by value heads; Qwen3-Next's
    Qwen3-Next)            per-key-head packing by key heads
               conv1d      the channels of the rank's q, k, v heads
               dt_bias, A_log  by value heads; the per-head gated norm replicated
               out_proj    row-parallel + all-reduce
               key heads   fewer than ranks (tp a multiple of them): each rank takes
                           the one key head its value heads read
    Mamba-2    in_proj     [z | x | B | C | dt]: z, x, dt by heads, B and C by
    (NemotronH,            groups where tp divides n_groups, else (tp a multiple
    Falcon-H1)             of n_groups) the one group the rank's heads use
               conv1d      [x | B | C] channels likewise; dt_bias, A_log, D by heads
               norm        the gated RMSNorm per group; a group spanning ranks has
                           its mean square summed over them (one small all-reduce)
               out_proj    row-parallel + all-reduce
    (Bamba,                Bamba's and Granite's gated norm spans the whole inner
    Granite-4.0-H,         width (one group over all ranks: its mean square summed);
    Zamba2)                Zamba2's shared blocks by heads, each hybrid layer's LoRA
                           adapters: the down matrix replicated, the up matrix by the
                           heads (or MLP columns) it adds to
    Falcon-H1  mixers      Mamba-2 and attention side by side: their scaled partial
                           sums added, then one all-reduce
    LFM2       short conv  in_proj [B | C | x] and the conv by channels (each rank
                           its channels' window); out_proj row-parallel
    KDA        in_proj     q, k, v, b by heads; the low-rank f_a and g_a replicated
    (Kimi-                 (their up matrices f_b, g_b by heads); conv1d, dt_bias and
    Linear)                A_log by heads; o_proj row-parallel; its MLA as above
    Granite    experts     stacked (E, 2I, H) [gate | up] by Segments on dim 1,
                           (E, H, I) on dim 2
    embed_tokens, lm_head, norms, rope: replicated (every rank computes the same
                           fp32 logits, so every rank samples the same tokens)

Experts are split tensor-parallel, not expert-parallel, in every family: the fused
MoE then runs unchanged on each rank (all experts, 1/tp of their width), routing
stays replicated, and no token is exchanged (one all-reduce, as a dense MLP's).

Each rank therefore stores K/V only for its own KV heads, and recurrent state only
for its own heads: its unified pool is built from specs with ``num_kv_heads / tp``;
an MLA spec is kept whole (per-rank MLA bytes equal TP 1's); a Mamba sub-pool gets
the rank's conv channels and ``heads / tp`` state heads (from the family's
``state_dims.shard``), so per-rank state bytes fall with tp
(:func:`shard_subpool_configs`).

Parameter names stay transformers' (``q_proj.weight`` ...): a module that is
sharded says how in ``tp_shards`` (parameter name -> dim, or ``Segments`` for a
tensor of segments split each on its own; a part of a packed projection may have
its own entry), and the loader narrows each checkpoint tensor with
:func:`shard_tensor` before copying it. A family opts in with ``tensor_parallel``
and names the HF fields a tp size must divide in ``tp_dims``;
:func:`check_tp_config` checks them (and the recurrent dims' own rule) before any
weight loads.

The all-reduce sums partial products in another order than one big matmul, so
fp32 logits differ from TP 1 by rounding only (about 1e-6 here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from unikv.models.config import ModelConfig


class TensorParallel:
    """This rank's place in a tensor-parallel group.

    Args:
        group: a torch.distributed process group (None: the default group),
            initialised before; NCCL on GPUs, gloo on CPU.
    """

    def __init__(self, group=None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "tensor parallelism needs torch.distributed initialised first "
                "(dist.init_process_group('nccl' on GPUs or 'gloo' on CPU))"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (contiguous); returns it."""
        dist.all_reduce(x, group=self.group)
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the group (a host sync; start-up only)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def refuse_tp(config: ModelConfig, tp) -> None:
    """For families without a sharded implementation: ``tp`` must be None."""
    if tp is not None:
        raise ValueError(
            f"{config.architecture} does not support tensor parallelism in unikv; "
            "run it with tp=None (one device)"
        )


def check_tp_config(config: ModelConfig, size: int) -> None:
    """Raise ValueError unless ``config`` can be split over ``size`` ranks: its model
    class shards (``tensor_parallel``) and ``size`` divides every field its
    ``tp_dims(config)`` names (HF field name -> value), and its recurrent dims split
    (``state_dims.shard(size)``). Runs before any weight loads."""
    from unikv.models.family import named

    model = named(config.family).model_class()
    if not getattr(model, "tensor_parallel", False):
        raise ValueError(
            f"tensor parallelism is not implemented for the {config.family!r} family "
            f"({config.architecture}) yet: build the LLM with tp_group=None "
            "(tensor_parallel_size=1)"
        )
    bad = {name: value for name, value in model.tp_dims(config).items() if value % size}
    if bad:
        raise ValueError(
            f"tensor parallelism of {size} needs {sorted(bad)} divisible by {size}, got "
            f"{bad}; use a tensor-parallel size that divides them (1 always does)"
        )
    if hasattr(config.state_dims, "shard"):  # the recurrent dims' own rule (Mamba-2 groups)
        config.state_dims.shard(size)


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear`` holding rows [r*out/tp, (r+1)*out/tp) of the full weight
    (and bias); output (T, out/tp) is this rank's slice, no communication."""

    tp_shards: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` holding columns [r*in/tp, (r+1)*in/tp) of the full weight.

    x: (T, in/tp), this rank's slice -> (T, out), the full product: the partial
    products are all-reduced, then the (replicated) bias is added once.

    ``reduce=False``: the output stays this rank's partial sum, for a block that adds
    several partial sums and all-reduces them once (a MoE's routed and shared
    experts, Falcon-H1's two mixers); the bias is then added by rank 0 only, so the
    sum counts it once."""

    tp_shards: ClassVar[dict[str, int]] = {"weight": 1}

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, tp, reduce: bool = True
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp, self.reduce = tp, reduce
        self.adds_bias = bias and (reduce or tp.rank == 0)  # host bools, fixed here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight)
        if self.reduce:
            out = self.tp.all_reduce(out)
        return out + self.bias if self.adds_bias else out


def partial_row(linear: nn.Linear, tp) -> RowParallelLinear:
    """A ``reduce=False`` twin of row-parallel ``linear`` (same shape and bias flag)."""
    bias = linear.bias is not None
    return RowParallelLinear(linear.in_features, linear.out_features, bias, tp=tp, reduce=False)


def linear_layers(tp: TensorParallel | None, reduce: bool = True):
    """(column linear, row linear) classes for ``tp`` (``layers.Linear`` when None: the
    kernel backend's ``linear``); ``reduce=False``: the row linear leaves its partial
    sum for the caller's one all-reduce (``RowParallelLinear``)."""
    if tp is None:
        from unikv.models.layers import Linear

        return Linear, Linear
    return ColumnParallelLinear, partial(RowParallelLinear, tp=tp, reduce=reduce)


def reduce_partial(tp: TensorParallel | None, x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the group (a block's partial sums, one all-reduce), or ``x``
    unchanged without tensor parallelism."""
    return x if tp is None else tp.all_reduce(x)


def tp_size(tp: TensorParallel | None) -> int:
    return 1 if tp is None else tp.size


@dataclass(frozen=True)
class Segments:
    """How to shard a tensor made of segments along ``dim`` (a packed projection, a
    conv over [x | B | C]): each segment ``(length, groups)`` is split on its own.

    A segment whose ``groups`` the TP size divides is split into ``size`` equal slices
    (rank r: slice r); one whose ``groups`` divides the size (Mamba-2's B and C with
    fewer groups than ranks) gives rank r the one group its heads use, group
    ``r * groups // size``; the rank's slices are concatenated in segment order."""

    dim: int
    segments: tuple[tuple[int, int], ...]

    def slices(self, rank: int, size: int, name: str) -> list[tuple[int, int]]:
        """(start, length) of each of the rank's slices, in order."""
        out, start = [], 0
        for length, groups in self.segments:
            if groups % size == 0:
                step = length // size
                out.append((start + rank * step, step))
            elif size % groups == 0:
                step = length // groups
                out.append((start + (rank * groups // size) * step, step))
            else:
                raise ValueError(
                    f"tensor {name}: a segment of {groups} groups can be neither split over "
                    f"nor shared by {size} ranks; use a tensor-parallel size that divides "
                    "the group count or that it divides"
                )
            start += length
        return out


def shard_rows(module: nn.Module, spec: int | Segments = 0) -> nn.Module:
    """Mark a plain ``Linear`` (or conv) as column-parallel: the loader narrows its
    ``weight`` and ``bias`` by ``spec`` (dim 0, or ``Segments``). No communication, and
    the module stays a plain ``Linear``, so a decoder may still fuse a pre-norm into it."""
    module.tp_shards = {"weight": spec, "bias": spec}
    return module


def shard_plan(model: nn.Module) -> dict[str, int | Segments]:
    """Full parameter name -> how it is sharded (a dim or ``Segments``), from modules'
    ``tp_shards``. A module may also name a part of one of its ``packed`` (fused)
    projections (``"in_proj_qkv.weight"``): that checkpoint tensor is narrowed on its
    own before the parts are concatenated (``loader.load_weights``)."""
    plan = {}
    for prefix, module in model.named_modules():
        parts = {p for names in getattr(module, "packed", {}).values() for p in names}
        for name, dim in getattr(module, "tp_shards", {}).items():
            owner = name.split(".", 1)[0]
            if getattr(module, name, None) is not None or owner in parts:
                plan[f"{prefix}.{name}" if prefix else name] = dim
    return plan


def shard_tensor(
    full: torch.Tensor, dim: int | Segments, rank: int, size: int, name: str
) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/size slice of ``full`` along ``dim``, or its
    slices of each segment (``Segments``), concatenated."""
    if isinstance(dim, Segments):
        total = sum(length for length, _ in dim.segments)
        if full.shape[dim.dim] != total:
            raise ValueError(
                f"tensor {name}: dim {dim.dim} of shape {tuple(full.shape)} is not the "
                f"{total} its segments {dim.segments} add up to; config.json and the "
                "weights disagree"
            )
        parts = [full.narrow(dim.dim, s, n) for s, n in dim.slices(rank, size, name)]
        return torch.cat(parts, dim=dim.dim)
    if full.shape[dim] % size:
        raise ValueError(
            f"tensor {name}: dim {dim} of shape {tuple(full.shape)} is not divisible by the "
            f"tensor-parallel size {size}; the checkpoint cannot be split this way"
        )
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


def shard_subpool_configs(configs: Sequence, size: int, state_dims=None) -> list:
    """The SubPoolConfigs of one rank: each attention spec with ``num_kv_heads / size``;
    an MLA spec unchanged (its latent row is shared by every head, so every rank
    caches it whole: per-rank MLA bytes equal TP 1's); a recurrent (Mamba / Gated
    DeltaNet) spec with the rank's conv channels and state heads (``shard_state_spec``,
    from the family's ``state_dims``).

    Raises ValueError for specs whose heads ``size`` does not divide."""
    if size == 1:
        return list(configs)
    out = []
    for c in configs:
        if c.spec.kind == "mla":  # kv_a_proj is replicated: every rank stores the latent
            out.append(c)
            continue
        if c.spec.kind == "mamba":
            out.append(dataclasses.replace(c, spec=shard_state_spec(c, size, state_dims)))
            continue
        heads = getattr(c.spec, "num_kv_heads", None)
        if c.spec.kind not in ("full", "swa") or heads is None:
            raise ValueError(
                f"sub-pool {c.name!r} ({c.spec.kind}) cannot be sharded by KV heads; tensor "
                "parallelism supports attention, MLA and recurrent (Mamba) sub-pools only"
            )
        if heads % size:
            raise ValueError(
                f"sub-pool {c.name!r}: num_kv_heads {heads} is not divisible by the "
                f"tensor-parallel size {size}"
            )
        spec = dataclasses.replace(c.spec, num_kv_heads=heads // size)
        out.append(dataclasses.replace(c, spec=spec))
    return out


def shard_state_spec(c, size: int, state_dims):
    """One rank's MambaSpec of sub-pool config ``c``: conv (C_r, K) and temporal
    (H / size, ...) from the family's recurrent dims split over the ranks
    (``state_dims.shard(size)``: C_r holds the channels of the rank's heads, and of
    the Mamba-2 group(s) they use, which other ranks may share)."""
    if not hasattr(state_dims, "shard"):
        raise ValueError(
            f"sub-pool {c.name!r} (recurrent state) can be sharded only with its family's "
            "recurrent dims (ModelConfig.state_dims with a shard method); this family "
            "runs without tensor parallelism"
        )
    spec = c.spec
    (conv,), temporal = spec.conv, spec.temporal
    assert conv.shape == (state_dims.conv_dim, state_dims.conv_kernel), (
        f"sub-pool {c.name!r}: the conv part {conv.shape} is not the family's dims'"
    )
    # a conv-only slot (LFM2's short convolutions) has no temporal part
    full_temporal = () if temporal is None else tuple(temporal.shape)
    assert full_temporal == tuple(state_dims.state_shape), (
        f"sub-pool {c.name!r}: the temporal part {full_temporal} is not the family's dims'"
    )
    local = state_dims.shard(size)
    if temporal is not None:
        temporal = dataclasses.replace(temporal, shape=tuple(local.state_shape))
    return dataclasses.replace(
        spec,
        conv=(dataclasses.replace(conv, shape=(local.conv_dim, local.conv_kernel)),),
        temporal=temporal,
    )
