"""gpt-oss's mixture-of-experts block: a top-k router and a plain torch loop
over experts, with gpt-oss's clamped SwiGLU (``alpha`` 1.702, ``limit`` 7).

The rest of gpt-oss (alternating sliding/full layers, attention sinks, yarn
rope, biased projections, fp32 norms) is the shared decoder in ``llama.py``.

Two loops, picked by the number of tokens (a host int, never a device value):
- dense (T <= ``DENSE_MAX_TOKENS``): every expert runs on every token and its
  output is weighted by the routing weight (zero when not selected). No host
  sync and fixed shapes, so decode steps can run under CUDA graphs.
- sparse (larger T, prefill): each expert runs on the tokens routed to it, as
  transformers does; it syncs the host (``nonzero``), acceptable for prefill.
Both accumulate the experts in index order, so they agree bit for bit on fp32
with each other and with transformers' loop up to matmul blocking.
"""

from __future__ import annotations

import torch
from torch import nn

from unikv.models.config import ModelConfig
from unikv.models.moe import DENSE_MAX_TOKENS  # one bound for every MoE family
from unikv.models.parallel import tp_size


class Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) -> (scores (T, k) softmax over the top-k logits,
        expert indices (T, k) int64)."""
        logits = nn.functional.linear(x, self.weight, self.bias)  # (T, E)
        top_values, top_indices = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.softmax(top_values, dim=1, dtype=top_values.dtype)
        return scores, top_indices


class Experts(nn.Module):
    """Weights in transformers' layout: ``gate_up_proj`` (E, hidden, 2I) with gate
    and up interleaved on the last dim, ``down_proj`` (E, I, hidden), biases.

    With ``tp`` every expert holds intermediate rows [r*I/tp, (r+1)*I/tp): a
    contiguous slice of 2I/tp gate_up columns keeps each (gate, up) pair whole.
    Outputs are partial sums (the MoE all-reduces once); only rank 0 adds the
    down bias, so it is counted once."""

    alpha = 1.702
    limit = 7.0

    def __init__(self, config: ModelConfig, tp=None) -> None:
        super().__init__()
        e, h = config.num_experts, config.hidden_size
        i = config.intermediate_size // tp_size(tp)
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))
        self.add_down_bias = tp is None or tp.rank == 0
        if tp is not None:
            self.tp_shards = {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x: (n, hidden) -> (n, hidden)."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        down = ((up + 1) * glu) @ self.down_proj[e]
        if self.add_down_bias:  # a host bool fixed at construction
            down = down + self.down_proj_bias[e]
        return down

    def forward_dense(self, x: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor):
        """x: (T, hidden); scores/indices: (T, k) -> (T, hidden)."""
        weights = torch.zeros(x.shape[0], self.num_experts, dtype=scores.dtype, device=x.device)
        weights.scatter_(1, indices, scores)  # (T, E), zero where not routed
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            out += (self.expert(e, x) * weights[:, e, None]).to(x.dtype)
        return out

    def forward_sparse(self, x: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor):
        """As ``forward_dense``, running each expert only on its tokens."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token_idx, slot = torch.where(indices == e)
            if token_idx.numel() == 0:
                continue
            y = self.expert(e, x[token_idx]) * scores[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(x.dtype))
        return out


class MoE(nn.Module):
    """gpt-oss MLP block: ``mlp.router`` (replicated under ``tp``) and
    ``mlp.experts`` (sharded on the intermediate dim, one all-reduce)."""

    def __init__(self, config: ModelConfig, tp=None) -> None:
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config, tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        scores, indices = self.router(x)
        if x.shape[0] <= DENSE_MAX_TOKENS:
            out = self.experts.forward_dense(x, scores, indices)
        else:
            out = self.experts.forward_sparse(x, scores, indices)
        return out if self.tp is None else self.tp.all_reduce(out)
