"""Routed experts shared by unikv's MoE families (Qwen3-Next, Qwen3-MoE, Mixtral,
DeepSeek, NemotronH), run by the fused MoE (``unikv/kernels/moe/fused.py``).

``RoutedExperts`` keeps each expert's linears under the checkpoint's names
(``experts.{e}.gate_proj.weight`` ...), so checkpoints load by name, but their
storage is two stacked tensors, the fused kernel's operands::

    w1 (E, N1, d)   N1 = 2I: rows [gate (I) | up (I)]  (relu2: N1 = I, up only)
    w2 (E, d, I)    down
    experts[e].gate_proj.weight is the view w1[e, :I], up_proj w1[e, I:], down w2[e]

The stacking is redone whenever the module's tensors are replaced (``to``,
``to_empty``, ``cuda``: torch routes them all through ``_apply``). The kernel is the
backend's ``moe`` (``kernels/backend.py``), taken at construction (``model_ops``: the
loader builds the model inside ``building(ops)``) and fixed for the module's life:
the Triton MoE for the Triton backend, the torch reference (``kernels/moe/ref.py``,
the routed loop these families ran before) for the torch backend, whatever the device.
"""

from __future__ import annotations

import torch
from torch import nn

from unikv.kernels.backend import DENSE_MAX_TOKENS, KernelBackend, model_ops
from unikv.models.parallel import tp_size

__all__ = ["DENSE_MAX_TOKENS", "RoutedExperts", "routed_experts"]

SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")


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
        self.kernel = model_ops(ops).moe  # the backend's MoE, fixed at construction
        self._stack()

    def _apply(self, fn, recurse=True):  # to / to_empty / cuda: restack
        super()._apply(fn, recurse)
        self._stack()
        return self

    @torch.no_grad()
    def _stack(self) -> None:
        """Move every expert weight into w1/w2 and make the parameters views of them."""
        *ins, out = self.names
        self.w1 = torch.stack([torch.cat([getattr(x, n).weight for n in ins]) for x in self])
        self.w2 = torch.stack([getattr(x, out).weight for x in self])
        i = self.intermediate
        for e, expert in enumerate(self):
            for j, name in enumerate(ins):
                getattr(expert, name).weight.data = self.w1[e, j * i : (j + 1) * i]
            getattr(expert, out).weight.data = self.w2[e]

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
        return self.kernel(
            x, weights, indices, self.w1, self.w2, activation=self.activation, sum_dtype=sum_dtype
        )


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: nn.ModuleList,
    *,
    sum_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The unfused loop over a ModuleList of callable experts (families not yet on
    ``RoutedExperts``): x: (T, d); weights: (T, k); indices: (T, k) int64 -> (T, d).
    Dense (every expert, zero weight where not routed) for T <= ``DENSE_MAX_TOKENS``,
    sparse (syncs the host) above; experts added in index order."""
    acc = sum_dtype or x.dtype
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    if x.shape[0] <= DENSE_MAX_TOKENS:
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
