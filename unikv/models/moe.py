"""The routed-expert loop shared by unikv's MoE families (Qwen3-Next, DeepSeek,
NemotronH): each token's top-k experts, weighted by the router, in expert order.

Two loops, picked by the number of tokens of the step (a host int, never a
device value):
- dense (T <= ``DENSE_MAX_TOKENS``): every expert runs on every token and its
  output is weighted by the routing weight (zero where not routed). No host
  sync and fixed shapes, so decode steps can run under CUDA graphs (the engine
  captures graphs up to this batch size).
- sparse (larger T, prefill): each expert runs on the tokens routed to it, as
  transformers' loops do; it syncs the host (``torch.where``).
Both add the experts in index order, so they agree with each other and with
transformers' loops up to matmul blocking.
"""

from __future__ import annotations

import torch
from torch import nn

DENSE_MAX_TOKENS = 256


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: nn.ModuleList,
    *,
    sum_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x: (T, d); weights: (T, k) routing weights; indices: (T, k) int64 expert ids
    -> (T, d) in x.dtype. ``sum_dtype``: the accumulator (None: x.dtype, each
    expert's weighted output rounded to it, as transformers' Qwen/DeepSeek loops;
    NemotronH sums in fp32)."""
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
