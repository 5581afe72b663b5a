"""``gated_rms_norm``: the recurrent mixers' gated output norm as one op.

The torch reference against transformers' own modules with the same weights
(Qwen3_5RMSNormGated per head; FalconH1RMSNormGated with groups, before and after
the gate; NemotronH's Zamba2RMSNormGated), exactly; the Triton kernel (CPU
interpreter) against the reference: fp32 within 1e-5, bf16 within one ulp.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.falcon_h1 import modeling_falcon_h1 as hf_falcon
from transformers.models.nemotron_h import modeling_nemotron_h as hf_nemotron
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen

from unikv.kernels.linear import elementwise
from unikv.kernels.linear import ref as elementwise_ref

EPS = 1e-5
T, HEADS, DIM = 5, 3, 12  # odd rows, groups not a power of two


def _inputs(dtype, width, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(T, 2 * width + 3, generator=g).to(dtype)  # one GEMM's output
    x, z = y[:, :width], y[:, width + 3 :]  # strided views, as the mixers pass them
    w = (1 + 0.3 * torch.randn(width, generator=g)).to(dtype)
    return x, z, w


def _hf(module, weight):
    with torch.no_grad():
        module.weight.copy_(weight)
    return module.to(weight.dtype)


CASES = [  # (name, group size, norm_before_gate, weight_mode, transformers module factory)
    ("qwen3_5", DIM, True, "dtype_before_gate",
     lambda: hf_qwen.Qwen3_5RMSNormGated(DIM, eps=EPS)),
    ("falcon_h1 before gate", DIM, True, "fp32",
     lambda: hf_falcon.FalconH1RMSNormGated(HEADS * DIM, EPS, HEADS, norm_before_gate=True)),
    ("falcon_h1 after gate", DIM, False, "fp32",
     lambda: hf_falcon.FalconH1RMSNormGated(HEADS * DIM, EPS, HEADS, norm_before_gate=False)),
    ("nemotron_h", DIM, False, "dtype_after_gate",
     lambda: hf_nemotron.Zamba2RMSNormGated(HEADS * DIM, DIM, EPS)),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_transformers(case, dtype):
    name, group, before, mode, factory = case
    shared = name == "qwen3_5"  # one (Dv,) weight for every head
    x, z, w = _inputs(dtype, HEADS * DIM, seed=1)
    weight = w[:DIM] if shared else w
    got = elementwise_ref.gated_rms_norm(
        x, z, weight, EPS, group_size=group, norm_before_gate=before, weight_mode=mode
    )
    module = _hf(factory(), weight)
    if shared:  # transformers runs it per head row
        want = module(x.reshape(-1, DIM), z.reshape(-1, DIM)).reshape(T, -1)
    else:
        want = module(x, z)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_reference(case, dtype):
    name, group, before, mode, _ = case
    x, z, w = _inputs(dtype, HEADS * DIM, seed=2)
    weight = w[:DIM] if name == "qwen3_5" else w
    kw = {"group_size": group, "norm_before_gate": before, "weight_mode": mode}
    got = elementwise.gated_rms_norm(x, z, weight, EPS, **kw)
    want = elementwise_ref.gated_rms_norm(x, z, weight, EPS, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one bf16 ulp
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


def test_bad_shapes_are_refused():
    x, z, w = _inputs(torch.float32, HEADS * DIM, seed=3)
    with pytest.raises(ValueError, match="multiple of group_size 7"):
        elementwise.gated_rms_norm(x, z, w, EPS, group_size=7)
    with pytest.raises(ValueError, match="weight_mode must be one of"):
        elementwise.gated_rms_norm(x, z, w, EPS, group_size=DIM, weight_mode="bf16")
