"""Plan, then run: the per-step metadata, translated once, read by every layer.

A step's batch is translated exactly once per sub-pool (DESIGN.md section 5):

    virtual ids of the new tokens --translate--> write kernel ids   (one per sub-pool)
    req_to_token + v2p ----build_block_table---> block table        (one per sub-pool)

Every layer of the model then reads the ``StepPlan``; no layer translates,
allocates or branches on the device. The attention functions below are the
``AttentionFn`` the model calls: ``DecodeAttention`` when every request feeds
one token, ``ExtendAttention`` otherwise; the choice is made once per step
when the plan is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unikv.ids import KernelIds


@dataclass(frozen=True)
class LayerCache:
    """Where one model layer keeps its K/V (built once at start-up).

    k: (N, H, D), v: (N, H, D) dense per-layer views of the pool indexed by
    kernel id; window: 0 = full attention, else the sliding window W."""

    subpool: str
    k: torch.Tensor
    v: torch.Tensor
    window: int
    page_size: int


@dataclass
class SubPoolStep:
    """One sub-pool's translated ids for one step.

    write_ids: kernel ids (T,) of the step's new tokens (where store_kv writes).
    block_table: (B, max_pages) int32 kernel page entries (0 = the sink)."""

    write_ids: KernelIds
    block_table: torch.Tensor


@dataclass
class StepPlan:
    """Everything a forward step reads, on the device.

    input_ids: (T,) int64 tokens of the step, requests in batch order.
    positions: (T,) int64 position of each token in its request.
    logits_indices: (B,) int64 row of each request's last token in the step.
    seq_lens: (B,) int32 tokens in the cache after the step (new ones included).
    q_indptr: (B+1,) int32 cumulative new-token counts.
    max_q_len: host int, the largest new-token count (a grid size, no sync).
    subpools: per sub-pool write ids and block table.
    """

    is_decode: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    seq_lens: torch.Tensor
    q_indptr: torch.Tensor
    max_q_len: int
    subpools: dict[str, SubPoolStep]


class DecodeAttention:
    """AttentionFn of a decode step: one query per request (q rows = requests)."""

    def __init__(self, layers: list[LayerCache], plan: StepPlan, backend, sm_scale: float):
        self.layers, self.plan, self.backend, self.sm_scale = layers, plan, backend, sm_scale

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
        )
