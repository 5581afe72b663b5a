"""Kimi Delta Attention: the gated delta rule with a decay per key channel, g (T, H, Dk).

- the torch reference (``recurrent_ref.gated_delta_rule``) against transformers'
  ``recurrent_kimi_delta_attention`` (its own per-token loop), one request at a time,
  continuing a random initial state;
- the Triton kernel (``recurrent.gated_delta_rule``, interpreter on CPU) against the
  reference on a mixed batch (decode and multi-token lanes, a padded lane on the
  sink slot), outputs and the states written back into the slots;
- g of the wrong shape is refused naming the expected shape.
"""

from __future__ import annotations

import pytest
import torch

from unikv.kernels.recurrent import ref as recurrent_ref
from unikv.kernels.recurrent import triton_ops as recurrent

H, DK, DV = 3, 12, 10


def _batch(lens, seed):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k = torch.randn(t, H, DK, generator=g), torch.randn(t, H, DK, generator=g)
    v = torch.randn(t, H, DV, generator=g)
    decay = -torch.rand(t, H, DK, generator=g) * 2  # log decay per channel, <= 0
    beta = torch.rand(t, H, generator=g)
    state = torch.randn(6, H, DK, DV, generator=g)
    q_indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, decay, beta, state, q_indptr


def test_reference_matches_transformers_kda_loop():
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        recurrent_kimi_delta_attention,
    )

    lens = [5, 1, 7]
    q, k, v, decay, beta, state, q_indptr = _batch(lens, seed=1)
    slots = torch.tensor([2, 4, 1])
    before = state.clone()
    out = recurrent_ref.gated_delta_rule(
        q, k, v, decay, beta, state, slots, q_indptr, max_q_len=max(lens),
        scale=DK**-0.5, use_qk_l2norm=True,
    )  # fmt: skip
    for b, n in enumerate(lens):
        rows = slice(int(q_indptr[b]), int(q_indptr[b + 1]))
        want, final = recurrent_kimi_delta_attention(
            q[None, rows], k[None, rows], v[None, rows], decay[None, rows], beta[None, rows],
            initial_state=before[slots[b]][None].clone(), output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        assert (out[rows] - want[0]).abs().max() < 1e-5, b
        assert (state[slots[b]] - final[0]).abs().max() < 1e-5, b
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("lens", [[1, 1, 1], [4, 1, 6, 0]])
def test_triton_kernel_matches_the_reference(lens):
    q, k, v, decay, beta, state, q_indptr = _batch(lens, seed=len(lens))
    slots = torch.tensor([3, 5, 1, 0][: len(lens)])  # 0: the sink (an empty lane)
    ref_state = state.clone()
    kw = {"max_q_len": max(lens), "scale": DK**-0.5, "use_qk_l2norm": True}
    want = recurrent_ref.gated_delta_rule(q, k, v, decay, beta, ref_state, slots, q_indptr, **kw)
    got = recurrent.gated_delta_rule(q, k, v, decay, beta, state, slots, q_indptr, **kw)
    assert (got - want).abs().max() < 1e-5
    assert (state - ref_state).abs().max() < 1e-5


def test_g_of_the_wrong_shape_is_refused():
    q, k, v, decay, beta, state, q_indptr = _batch([2, 1], seed=5)
    slots = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=rf"g must have shape \(3, {H}, {DK}\)"):
        recurrent.gated_delta_rule(
            q, k, v, decay[..., :-1], beta, state, slots, q_indptr, max_q_len=2,
            scale=1.0, use_qk_l2norm=True,
        )  # fmt: skip
