"""DeepSeek-V2 / V3 mixture-of-experts block: a top-k router, routed SwiGLU experts
and always-on shared experts (``mlp.gate``, ``mlp.experts.{e}``, ``mlp.shared_experts``,
the checkpoints' names; transformers' ``DeepseekV2Moe`` / ``DeepseekV3MoE``).

Routing, in fp32 on fp32 logits ``x @ gate.weight^T`` (E experts, k per token):

- V2 ``greedy``: softmax over experts, top-k; ``group_limited_greedy``: the experts
  fall in ``n_group`` groups, a group scores its best expert, only the
  ``topk_group`` best groups compete (the others' scores are zeroed), then top-k.
  Weights are the softmax scores times ``routed_scaling_factor`` (transformers 5.17
  does not renormalise V2's weights, whatever ``norm_topk_prob`` says).
- V3: sigmoid scores; the choice adds ``e_score_correction_bias`` (kept fp32); a
  group scores the sum of its two best; the ``topk_group`` best groups compete
  (others at -inf); top-k; weights are the sigmoid scores (without the bias) of
  the chosen experts, renormalised (sum + 1e-20) when ``norm_topk_prob``, times
  ``routed_scaling_factor``.

The routed experts run in the model's backend's fused MoE (``models/moe.RoutedExperts``:
the Triton MoE on the Triton backend; on the torch backend the reference loop, which
adds the experts in index order, as transformers does).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from unikv.kernels.backend import KernelBackend
from unikv.models.config import ModelConfig
from unikv.models.layers import GatedMLP
from unikv.models.moe import RoutedExperts
from unikv.models.parallel import reduce_partial

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


class TopkRouter(nn.Module):
    """``mlp.gate``: ``weight`` (E, hidden) and, for V3, ``e_score_correction_bias`` (E,)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e = config.extra
        self.version, self.top_k = e["version"], e["num_experts_per_tok"]
        self.num_experts, self.num_groups = e["n_routed_experts"], e["n_group"]
        self.topk_group, self.scaling = e["topk_group"], e["routed_scaling_factor"]
        self.method, self.norm_topk_prob = e["topk_method"], e["norm_topk_prob"]
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        if self.version == 3:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts))

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """(T, G) group scores -> (T, E) bool: experts of the ``topk_group`` best groups."""
        chosen = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0)  # (T, G)
        per_group = self.num_experts // self.num_groups
        return mask[:, :, None].expand(-1, -1, per_group).reshape(-1, self.num_experts).bool()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) -> (weights (T, k) fp32, expert indices (T, k) int64)."""
        logits = nn.functional.linear(x.float(), self.weight.float())  # (T, E) fp32
        t, groups = x.shape[0], self.num_groups
        if self.version == 2:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.method == "group_limited_greedy":  # a host str fixed by the config
                best = scores.view(t, groups, -1).max(dim=-1).values  # (T, G)
                scores = scores.masked_fill(~self._group_mask(best), 0.0)
            weights, indices = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
            return weights * self.scaling, indices
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        best = choice.view(t, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # (T, G)
        choice = choice.masked_fill(~self._group_mask(best), float("-inf"))
        indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices


class DeepseekMoE(nn.Module):
    """Routed experts plus shared experts (one SwiGLU of ``n_shared_experts *
    moe_intermediate_size``), added to every token; ``ops``: the backend (None:
    ``model_ops()``).

    With ``tp``: the router replicated; the routed experts and the shared SwiGLU both
    sharded on their intermediate dim, their partial sums added, then ONE all-reduce
    (the shared down bias, V2's ``mlp_bias``, added by rank 0 only)."""

    def __init__(self, config: ModelConfig, ops: KernelBackend | None = None, tp=None) -> None:
        super().__init__()
        e = config.extra
        self.gate = TopkRouter(config)
        routed = dataclasses.replace(
            config, intermediate_size=e["moe_intermediate_size"], mlp_bias=False
        )
        self.experts = RoutedExperts(
            e["n_routed_experts"], config.hidden_size, routed.intermediate_size, ops=ops, tp=tp
        )
        shared = dataclasses.replace(
            config,
            intermediate_size=e["moe_intermediate_size"] * e["n_shared_experts"],
            mlp_bias=e["mlp_bias"],
        )
        self.shared_experts = GatedMLP(shared, tp, ops=ops, reduce=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        weights, indices = self.gate(x)
        out = self.experts(x, weights, indices) + self.shared_experts(x)
        return reduce_partial(self.tp, out)


def check_moe_fields(extra: dict, model_type: str) -> None:
    """ValueError for a routing the block cannot run (host-side, at config time)."""
    experts, groups = extra["n_routed_experts"], extra["n_group"]
    if extra["version"] == 2 and extra["topk_method"] not in V2_TOPK_METHODS:
        raise ValueError(
            f"{model_type} topk_method {extra['topk_method']!r} is not supported; transformers "
            f"and unikv run {list(V2_TOPK_METHODS)}: fix config.json"
        )
    if experts % groups or extra["topk_group"] > groups:
        raise ValueError(
            f"{model_type}: n_routed_experts ({experts}) must split into n_group ({groups}) equal "
            f"groups and topk_group ({extra['topk_group']}) must be <= n_group: fix config.json"
        )
    if extra["version"] == 3 and experts // groups < 2:
        raise ValueError(
            f"{model_type}: V3 routing scores a group by its two best experts, so every group "
            f"needs >= 2 experts; got {experts} experts in {groups} groups: fix config.json"
        )
