"""``moe.top_k_softmax``, the softmax routers' top-k (Qwen3-Next, Qwen3-MoE, Mixtral):
renormalised, it takes the softmax of the k largest logits (two launches) in place of
transformers' four ops (softmax over every expert in fp32, top-k, sum, divide). Against
that four-op form, written out here: the same experts in the same order, weights equal
within fp32 rounding (and within one ulp of the model dtype after the cast)."""

from __future__ import annotations

import pytest
import torch

from unikv.models.moe import top_k_softmax


def _transformers(logits, k, renormalise, dtype):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, indices = torch.topk(probs, k, dim=-1)
    if renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype), indices


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,k", [(4, 2), (60, 4), (512, 10)])
def test_top_k_softmax_equals_the_four_op_form(renormalise, dtype, experts, k):
    gen = torch.Generator().manual_seed(experts + k)
    logits = (3 * torch.randn(33, experts, generator=gen)).to(dtype)
    got, got_ids = top_k_softmax(logits, k, renormalise, dtype)
    want, want_ids = _transformers(logits, k, renormalise, dtype)
    assert torch.equal(got_ids, want_ids)
    assert got.dtype == dtype and got.shape == (33, k)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one ulp after the cast
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if renormalise:
        torch.testing.assert_close(got.float().sum(-1), torch.ones(33), rtol=tol, atol=tol)
