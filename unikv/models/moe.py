"""Routed experts shared by unikv's MoE families (Qwen3-Next, Qwen3-MoE, Mixtral,
DeepSeek, NemotronH), run by the fused MoE (``unikv/kernels/moe/fused.py``).

``RoutedExperts`` keeps each expert's linears under the checkpoint's names
(``experts.{e}.gate_proj.weight`` ...), so checkpoints load by name, but their
storage is two stacked tensors, the fused kernel's operands::

    w1 (E, N1, d)   N1 = 2I: rows [gate (I) | up (I)]  (relu2: N1 = I, up only)
    w2 (E, d, I)    down
    experts[e].gate_proj.weight is the view w1[e, :I], up_proj w1[e, I:], down w2[e]

The stacking is redone whenever the module's tensors are replaced (``to``,
``to_empty``, ``cuda``: torch routes them all through ``_apply``).

FP8 experts (a block-quantised checkpoint, ``models/fp8.py``): ``keep_fp8`` turns each
expert's linears into ``Fp8Weight`` s (the file's e4m3 ``weight`` beside its fp32
``weight_scale_inv``, one per block of bn x bk) before the weights load, and the stacks
into ``w1`` / ``w2`` float8_e4m3fn with ``w1_scale`` (E, parts * ceil(I / bn),
ceil(d / bk)) (each part, gate and up, blocked on its own, its scale rows in part order)
and ``w2_scale`` (E, ceil(d / bn), ceil(I / bk)); the backend's ``moe_fp8`` runs them
(Triton: each weight tile dequantised in registers inside the fused kernels,
``kernels/moe/fp8.py``; the torch reference dequantises per call,
``kernels/linear/fp8_gemm_ref.moe_fp8``). Never
dequantised at load. Under tensor parallelism the scales shard with their weights (gate
and up rows, down columns); a rank's slice must be whole blocks. The kernel is the
backend's ``moe`` (``kernels/backend.py``), taken at construction (``model_ops``: the
loader builds the model inside ``building(ops)``) and fixed for the module's life:
the Triton MoE for the Triton backend, the torch reference (``kernels/moe/ref.py``,
the routed loop these families ran before) for the torch backend, whatever the device.
"""

from __future__ import annotations

import torch
from torch import nn

from unikv.kernels.backend import (
    DENSE_MAX_TOKENS,
    KernelBackend,
    RowsPlan,
    dense_rows,
    model_ops,
    step_rows,
)
from unikv.models.parallel import tp_size

__all__ = ["DENSE_MAX_TOKENS", "RoutedExperts", "routed_experts", "top_k_softmax"]

SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")


class Fp8Weight(nn.Module):
    """One FP8 expert matrix under a linear's names: ``weight`` (out, in) float8_e4m3fn,
    ``weight_scale_inv`` (ceil(out / bn), ceil(in / bk)) fp32 (views into the stacks)."""

    def __init__(self, out_features: int, in_features: int, block, device, shard) -> None:
        super().__init__()
        bn, bk = block
        fp8 = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        scale = torch.empty(-(-out_features // bn), -(-in_features // bk), device=device)
        self.weight = nn.Parameter(fp8, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        if shard is not None:  # tensor parallelism: the scales shard as the weight does
            self.tp_shards = {"weight": shard, "weight_scale_inv": shard}


class Expert(nn.Module):
    """One expert's bias-free linears, named as in the checkpoint; no forward of its
    own (the fused MoE runs all experts at once)."""

    def __init__(self, shapes: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        for name, (fan_in, fan_out) in shapes.items():
            setattr(self, name, nn.Linear(fan_in, fan_out, bias=False))


class RoutedExperts(nn.ModuleList):
    """E experts of one MoE layer (``activation`` "silu": SwiGLU, ``names`` (gate, up,
    down); "relu2": ``down(relu(up(x)) ** 2)``, ``names`` (up, down)); ``ops``: the
    backend whose ``moe`` runs them (None: ``model_ops()``).

    forward(x (T, d), weights (T, k), indices (T, k) int64) -> (T, d) in x.dtype:
    the sum of each token's k experts, weighted (``moe_ref.fused_moe``).

    With ``tp`` (``models/parallel.py``) every expert holds intermediate rows
    [r*I/tp, (r+1)*I/tp) (gate and up rows, down columns): ``intermediate`` is the
    full I, the stacks hold I/tp, and the output is this rank's partial sum, which
    the owning MoE block all-reduces once (after adding its shared experts')."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        *,
        activation: str = "silu",
        names: tuple[str, ...] = SWIGLU_NAMES,
        ops: KernelBackend | None = None,
        tp=None,
    ) -> None:
        gated = activation != "relu2"
        if activation not in ("silu", "relu2") or len(names) != 2 + gated:
            raise ValueError(
                f"RoutedExperts runs 'silu' (names gate, up, down) or 'relu2' (up, down), "
                f"got {activation!r} with names {names}"
            )
        intermediate //= tp_size(tp)
        shapes = {name: (hidden, intermediate) for name in names[:-1]}
        shapes[names[-1]] = (intermediate, hidden)
        super().__init__(Expert(shapes) for _ in range(num_experts))
        if tp is not None:  # the loader narrows gate/up rows and down columns
            for expert in self:
                for name in names[:-1]:
                    getattr(expert, name).tp_shards = {"weight": 0}
                getattr(expert, names[-1]).tp_shards = {"weight": 1}
        self.activation, self.names, self.intermediate = activation, names, intermediate
        self.hidden, self.tp = hidden, tp
        self.ops = model_ops(ops)
        self.kernel = self.ops.moe  # the backend's MoE, fixed at construction
        self.fp8_block: tuple[int, int] | None = None  # set by ``keep_fp8``
        self._stack()

    def keep_fp8(self, block: tuple[int, int]) -> None:
        """Hold the experts in block-scaled FP8 (module docstring): before the weights
        load, on the module's device. ValueError where tensor parallelism cuts a scale
        block (a rank's gate / up rows or down columns not whole blocks)."""
        bn, bk = block
        i, size = self.intermediate, 1 if self.tp is None else self.tp.size
        if size > 1 and (i % bn or i % bk):
            raise ValueError(
                f"FP8 experts: tensor parallelism of {size} leaves each rank {i} intermediate "
                f"rows / columns of every expert, which cuts the {bn} x {bk} scale blocks; "
                "use a tensor-parallel size that leaves every rank whole blocks"
            )
        *ins, out = self.names
        device = self.w1.device
        split = self.tp is not None
        for expert in self:
            for name in ins:
                shard = 0 if split else None
                setattr(expert, name, Fp8Weight(i, self.hidden, block, device, shard))
            setattr(expert, out, Fp8Weight(self.hidden, i, block, device, 1 if split else None))
        self.fp8_block = (bn, bk)
        self.kernel = self.ops.moe_fp8
        self._stack()

    def _apply(self, fn, recurse=True):  # to / to_empty / cuda: restack
        super()._apply(fn, recurse)
        self._stack()
        return self

    @torch.no_grad()
    def _stack(self) -> None:
        """Move every expert weight (and FP8 scale) into w1/w2 (w1_scale/w2_scale) and
        make the parameters views of them."""
        *ins, out = self.names
        attrs = ("weight",) if self.fp8_block is None else ("weight", "weight_scale_inv")
        for attr in attrs:
            suffix = "" if attr == "weight" else "_scale"
            w1 = torch.stack([torch.cat([getattr(getattr(x, n), attr) for n in ins]) for x in self])
            w2 = torch.stack([getattr(getattr(x, out), attr) for x in self])
            setattr(self, "w1" + suffix, w1)
            setattr(self, "w2" + suffix, w2)
            rows = getattr(getattr(self[0], ins[0]), attr).shape[0]  # one part's
            for e, expert in enumerate(self):
                for j, name in enumerate(ins):
                    getattr(getattr(expert, name), attr).data = w1[e, j * rows : (j + 1) * rows]
                getattr(getattr(expert, out), attr).data = w2[e]

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        sum_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x: (T, d); weights: (T, k) routing weights; indices: (T, k) int64 expert
        ids -> (T, d) in x.dtype. ``sum_dtype``: the reference's accumulator (None:
        x.dtype; NemotronH sums in fp32); the Triton kernel always sums in fp32."""
        if self.fp8_block is not None:  # a host value fixed at load
            return self.kernel(
                x, weights, indices, self.w1, self.w1_scale, self.w2, self.w2_scale,
                block=self.fp8_block, activation=self.activation, sum_dtype=sum_dtype,
                rows=step_rows(),
            )  # fmt: skip
        return self.kernel(
            x, weights, indices, self.w1, self.w2, activation=self.activation,
            sum_dtype=sum_dtype, rows=step_rows(),
        )  # fmt: skip


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: nn.ModuleList,
    *,
    sum_dtype: torch.dtype | None = None,
    rows: RowsPlan | None = None,
) -> torch.Tensor:
    """The unfused loop over a ModuleList of callable experts (families not yet on
    ``RoutedExperts``): x: (T, d); weights: (T, k); indices: (T, k) int64 -> (T, d).
    Dense (every expert, zero weight where not routed) where ``rows`` (the step's
    ``RowsPlan``; None: ``dense_rows`` of T, T <= ``DENSE_MAX_TOKENS``) says, sparse
    (syncs the host) otherwise; experts added in index order."""
    acc = sum_dtype or x.dtype
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    table = dense_rows(x.shape[0]) if rows is None else rows.moe_dense  # a host bool
    if table:
        dense = torch.zeros(x.shape[0], len(experts), dtype=weights.dtype, device=x.device)
        dense.scatter_(1, indices, weights)  # (T, E), zero where not routed
        for e, expert in enumerate(experts):
            out += (expert(x) * dense[:, e, None]).to(acc)
        return out.to(x.dtype)
    for e, expert in enumerate(experts):
        token_idx, slot = torch.where(indices == e)
        if token_idx.numel():
            y = expert(x[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(acc))
    return out.to(x.dtype)


def top_k_softmax(logits: torch.Tensor, k: int, renormalise: bool, dtype: torch.dtype):
    """The k largest of softmax(logits) (fp32) and their experts, the weights renormalised
    to sum 1 where ``renormalise``, cast to ``dtype``. Renormalised, they are the softmax
    of the k largest logits (the softmax is monotonic and its normaliser cancels): two
    launches (top-k, softmax) in place of four (softmax, top-k, sum, divide)."""
    if renormalise:  # a host bool fixed by the config
        top, indices = torch.topk(logits, k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=torch.float32).to(dtype), indices
    top, indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    return top.to(dtype), indices
