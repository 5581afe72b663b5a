"""The signatures of the fused MoE ops, stated once (``KernelBackend``'s fields are typed
by these; ``kernels/attention/protocols.py`` says how a variant may extend one, and
``tests/kernels/test_kernel_protocols.py`` checks it).

Weights are stacked per expert, rows = output features: w1 (E, N1, K) with N1 = 2I
(gated) or I (relu2), w2 (E, d, I); MXFP4 experts are uint8 blocks (E, N, K / 32, 16)
with e8m0 scales (E, N, K / 32) (``kernels/moe/ref.py`` states the semantics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from unikv.kernels.backend import MoERepacked, RowsPlan


class MoE(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        *,
        w1_scales: torch.Tensor | None = None,
        w2_scales: torch.Tensor | None = None,
        b1: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        activation: str = "silu",
        gate_up: str = "concat",
        alpha: float = 1.702,
        limit: float = 7.0,
        sum_dtype: torch.dtype | None = None,
        rows: RowsPlan | None = None,
    ) -> torch.Tensor:
        """Each token's top-k experts, weighted by the router and summed. x (T, d);
        topk_weights (T, k); topk_ids (T, k) int32/int64 in [0, E); b1 (E, N1), b2
        (E, d) or None; activation "silu", "gpt_oss" or "relu2"; gate_up "concat" or
        "interleaved"; rows: the step's ``RowsPlan`` (the dense table or sparse loop,
        the kernel's bucket; None: by T). Returns (T, d) in x's dtype."""
        ...


class MoERepackedRun(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        frags: object,
        *,
        b1: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        activation: str = "silu",
        gate_up: str = "concat",
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> torch.Tensor:
        """``MoE`` over experts re-packed at load (``frags``: what the variant's
        ``pack`` returned). Returns (T, d) in x's dtype."""
        ...


class MoERepack(Protocol):
    def __call__(self, dtype: torch.dtype, hidden: int, inter: int) -> MoERepacked | None:
        """The variant that runs an MXFP4 expert layer of (dtype, hidden,
        intermediate) on experts re-packed at load, or None (``MoE`` on the
        checkpoint's layout). Asked once per layer, at load."""
        ...
