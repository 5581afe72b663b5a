"""The step objects the model calls: every layer reads the StepPlan, nothing more.

``DecodeAttention`` when every request feeds one token, ``ExtendAttention``
otherwise; the runner picks one per step from the plan. Both are the model's
``AttentionFn`` and, for recurrent layers (Gated DeltaNet, Mamba-2), its
``StateFn``: the state ops read and update each request's state slot in place
through the layer's pool views. For MLA layers (DeepSeek-V2/V3) ``mla`` stores
the step's latent rows and attends over the layer's latent view of the MLA
sub-pool in the absorbed form. No layer translates, allocates or branches on the
device; decode attention's launch plan is the planner's (``StepPlan.decode``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unikv.engine.plan import StepPlan
from unikv.kernels.backend import KernelBackend


@dataclass(frozen=True)
class LayerCache:
    """Where one model layer keeps its K/V (built once at start-up).

    k: (N, H, D), v: (N, H, D) dense per-layer views of the pool indexed by
    kernel id; window: 0 = full attention, else the sliding window W;
    soft_cap: attention logit soft-cap ``cap * tanh(x / cap)`` (0 = off, Gemma-2)."""

    subpool: str
    k: torch.Tensor
    v: torch.Tensor
    window: int
    page_size: int
    soft_cap: float = 0.0


@dataclass(frozen=True)
class MLALayerCache:
    """Where one MLA model layer keeps its latent rows (built once at start-up).

    latent: (N, kv_lora_rank + rope) dense per-layer view of the MLA sub-pool
    indexed by kernel id; V is its first kv_lora_rank columns."""

    subpool: str
    latent: torch.Tensor
    page_size: int


@dataclass(frozen=True)
class LayerState:
    """Where one recurrent model layer keeps its state (built once at start-up).

    conv: (S, C, K) and temporal: (S, *shape) per-layer views of the Mamba
    sub-pool, indexed by physical state slot."""

    conv: torch.Tensor
    temporal: torch.Tensor


class DecodeAttention:
    """AttentionFn and StateFn of a decode step: one query per request (q rows =
    requests). ``layers[i]`` / ``states[i]``: model layer i's K/V cache or
    recurrent state (None where the layer has none)."""

    def __init__(
        self,
        layers: list[LayerCache | None],
        plan: StepPlan,
        backend: KernelBackend,
        sm_scale: float,
        states: list[LayerState | None] | None = None,
    ):
        self.layers, self.plan, self.backend, self.sm_scale = layers, plan, backend, sm_scale
        self.states = states

    # -- recurrent state (StateFn) ----------------------------------------------------

    def causal_conv1d(self, layer, x, weight, bias, activation):
        """x: (T, C) -> (T, C); the layer's conv state continues in its slot."""
        plan = self.plan
        return self.backend.causal_conv1d(
            x,
            self.states[layer].conv,
            plan.state_slots,
            plan.q_indptr,
            weight,
            bias,
            max_q_len=plan.max_q_len,
            activation=activation,
        )

    def gated_delta_rule(self, layer, q, k, v, g, beta, *, scale, use_qk_l2norm):
        """q, k: (T, H, Dk), v: (T, H, Dv), g, beta: (T, H) -> (T, H, Dv)."""
        plan = self.plan
        state = self.states[layer].temporal
        return self.backend.gated_delta_rule(
            q, k, v, g, beta, state, plan.state_slots, plan.q_indptr,
            max_q_len=plan.max_q_len, scale=scale, use_qk_l2norm=use_qk_l2norm,
        )  # fmt: skip

    def mamba2_ssd(self, layer, x, dt, A, B, C, D, dt_bias, *, dt_softplus, dt_limit):
        """x: (T, H, P), dt: (T, H), B, C: (T, G, N) -> (T, H, P)."""
        plan = self.plan
        state = self.states[layer].temporal
        return self.backend.mamba2_ssd(
            x, dt, A, B, C, D, dt_bias, state, plan.state_slots, plan.q_indptr,
            max_q_len=plan.max_q_len, dt_softplus=dt_softplus, dt_limit=dt_limit,
        )  # fmt: skip

    # -- multi-head latent attention (DeepSeek-V2/V3) ---------------------------------

    def mla(self, layer, q_latent, q_rope, latent, rope, sm_scale):
        """Store this step's latent rows of MLA ``layer`` and attend over them in the
        absorbed form. q_latent: (T, H, rank), q_rope: (T, H, rope); latent: (T, rank)
        (normalised c), rope: (T, rope) (rotated k_rope) -> (T, H, rank)."""
        cache, plan = self.layers[layer], self.plan
        step = plan.subpools[cache.subpool]
        self.backend.store_mla(cache.latent, step.write_ids.data, latent, rope)
        return self.backend.mla_attention(
            q_latent, q_rope, cache.latent, step.block_table, plan.q_indptr, plan.seq_lens,
            max_q_len=plan.max_q_len, page_size=cache.page_size, sm_scale=sm_scale,
        )  # fmt: skip

    # -- attention (AttentionFn) ------------------------------------------------------

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write the step's new K/V rows of ``layer`` at its sub-pool's write ids;
        returns the layer's cache and its sub-pool's step metadata."""
        cache = self.layers[layer]
        step = self.plan.subpools[cache.subpool]
        self.backend.store_kv(cache.k, cache.v, step.write_ids.data, k, v)
        return cache, step

    def __call__(self, layer, q, k, v, sinks=None):
        """q: (B, Hq, D), k/v: (B, H, D) -> (B, Hq, D)."""
        cache, step = self._store(layer, k, v)
        return self.backend.decode_attention(
            q,
            cache.k,
            cache.v,
            step.block_table,
            self.plan.seq_lens,
            page_size=cache.page_size,
            sm_scale=self.sm_scale,
            window=cache.window,
            sinks=sinks,
            soft_cap=cache.soft_cap,
            **self.plan.decode[cache.subpool].launch,  # splits, workspace: once per step
        )


class ExtendAttention(DecodeAttention):
    """AttentionFn of a step with ragged new tokens (prefill chunks, mixed with decodes)."""

    def __call__(self, layer, q, k, v, sinks=None):
        """q: (T, Hq, D), k/v: (T, H, D) -> (T, Hq, D)."""
        cache, step = self._store(layer, k, v)
        return self.backend.extend_attention(
            q,
            cache.k,
            cache.v,
            step.block_table,
            self.plan.q_indptr,
            self.plan.seq_lens,
            max_q_len=self.plan.max_q_len,
            page_size=cache.page_size,
            sm_scale=self.sm_scale,
            window=cache.window,
            sinks=sinks,
            soft_cap=cache.soft_cap,
        )
