"""The signatures of the recurrent-state ops, stated once (``KernelBackend``'s fields are
typed by these; ``kernels/attention/protocols.py`` says how a variant may extend one, and
``tests/kernels/test_kernel_protocols.py`` checks it).

Every op runs request b's new tokens ``q_indptr[b]:q_indptr[b+1]`` (q_indptr (B+1,)
int32) through its recurrence from the state in ``state[slots[b]]`` (a strided per-layer
view of the Mamba sub-pool, slots (B,) int64, 0 the sink) and writes the final state back
in place. T new tokens; max_q_len a host int >= every request's count.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CausalConv1d(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        slots: torch.Tensor,
        q_indptr: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        max_q_len: int,
        activation: str | None,
    ) -> torch.Tensor:
        """Depthwise causal conv continuing each slot's last K inputs. x (T, C);
        conv_state (S, C, K), oldest first; weight (C, K); bias (C,) or None;
        activation None or "silu". Returns (T, C) in x's dtype."""
        ...


class GatedDeltaRule(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        q_indptr: torch.Tensor,
        *,
        max_q_len: int,
        scale: float,
        use_qk_l2norm: bool,
        gating: tuple[torch.Tensor, torch.Tensor] | None = None,
        draft_slots: torch.Tensor | None = None,
        ckpt_slots: torch.Tensor | None = None,
        chunks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gated DeltaNet (g (T, H) log decay) or Kimi Delta Attention (g (T, H, Dk),
        a decay per key channel). q, k (T, Hk, Dk), Hk dividing H; v (T, H, Dv);
        beta (T, H); state (S, H, Dk, Dv); gating (A_log, dt_bias) when g and beta are
        the raw gates; draft_slots (B, k) a verify step's per-position slots; ckpt_slots
        (B,) second destinations of the final states; chunks (NT, 2) fla-core's chunk
        list of q_indptr (a prefill step's, on CUDA). Returns (T, H, Dv) in v's dtype."""
        ...


class Mamba2SSD(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        q_indptr: torch.Tensor,
        *,
        max_q_len: int,
        dt_softplus: bool,
        dt_limit: tuple[float, float],
    ) -> torch.Tensor:
        """Mamba-2's selective scan. x (T, H, P); dt (T, H); A, D, dt_bias (H,);
        B, C (T, G, N), head h reading group h // (H // G); state (S, H, P, N).
        Returns (T, H, P) in x's dtype."""
        ...
