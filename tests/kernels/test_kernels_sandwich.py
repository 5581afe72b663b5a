"""The sandwich norm (``unikv/kernels/linear/sandwich.py``: a block's post-norm, the
residual add and the next block's pre-norm in one launch) against its torch reference
(``ref.sandwich_rms_norm``), and the reference against transformers' own Gemma-3 layer
steps (``Gemma3RMSNorm`` post-norm, ``residual + hidden_states``, the next
``Gemma3RMSNorm``) and Llama's norms.

Widths 40, 72 and 1000 (none a power of two; 1000 spans several warps), fp32 and bf16,
x a strided view of a wider output, under Triton's CPU interpreter. Tolerances: the
reference equals transformers bit for bit; Triton equals the reference within 1e-5 in
fp32 (reduction order, rsqrt) and, in bf16, within one bf16 ulp of the normed rows
(plus the ulps of the post-norm's output the sum carries) with >= 97 % of the elements
bit-equal.
"""

from __future__ import annotations

import pytest
import torch

from unikv.kernels.backend import get_backend
from unikv.kernels.linear import ref

TRITON = get_backend("cpu", "triton")
DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [40, 72, 1000]
EPS = 1e-6
GEMMA = {"weight_in_fp32": True, "offset": 1.0}
FORMS = [GEMMA, {}, {"weight_in_fp32": True}]


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-6)
    equal = (got == want).float().mean().item()
    assert equal >= 0.97, f"only {equal:.3f} of the bf16 elements are bit-equal"


def _inputs(t, n, dtype, seed=0):
    """x (T, N) as a strided view of a (T, N + 5) output, residual (T, N) of a larger
    scale (a residual stream), two weights away from zero."""
    wide = _randn(t, n + 5, dtype=dtype, seed=seed, scale=3.0)
    x = wide[:, 2 : n + 2]
    r = _randn(t, n, dtype=dtype, seed=seed + 1, scale=8.0)
    wa = _randn(n, dtype=dtype, seed=seed + 2, scale=0.5)
    wb = _randn(n, dtype=dtype, seed=seed + 3, scale=0.5)
    return x, r, wa, wb


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_transformers_gemma3_sandwich(dtype):
    """Gemma-3's decoder layer between its attention output and the MLP input
    (post_attention_layernorm, the residual add, pre_feedforward_layernorm)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    x, r, wa, wb = _inputs(9, 72, dtype, seed=4)
    post, pre = Gemma3RMSNorm(72, EPS).to(dtype), Gemma3RMSNorm(72, EPS).to(dtype)
    post.weight.data.copy_(wa)
    pre.weight.data.copy_(wb)
    with torch.no_grad():
        summed = r + post(x)  # transformers: residual + hidden_states
        want = pre(summed)
    got, got_r = ref.sandwich_rms_norm(x, r, wa, wb, EPS, **GEMMA)
    assert torch.equal(got_r, summed) and torch.equal(got, want)


def test_reference_is_two_llama_norms_and_the_add():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, r, wa, wb = _inputs(5, 40, torch.bfloat16, seed=8)
    post, pre = LlamaRMSNorm(40, EPS).to(torch.bfloat16), LlamaRMSNorm(40, EPS).to(torch.bfloat16)
    post.weight.data.copy_(wa)
    pre.weight.data.copy_(wb)
    with torch.no_grad():
        summed = r + post(x)
        want = pre(summed)
    got, got_r = ref.sandwich_rms_norm(x, r, wa, wb, EPS)
    assert torch.equal(got_r, summed) and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("form", FORMS, ids=["gemma", "llama", "fp32_weight"])
def test_triton_matches_reference_and_updates_residual(dtype, n, form):
    x, r, wa, wb = _inputs(7, n, dtype, seed=n)
    want, want_r = ref.sandwich_rms_norm(x, r, wa, wb, EPS, **form)
    residual = r.clone()
    got, got_r = TRITON.sandwich_rms_norm(x, residual, wa, wb, EPS, **form)
    assert got_r.data_ptr() == residual.data_ptr()  # the sum written in place
    assert got.is_contiguous()
    _close(got_r, want_r)
    _close(got, want)


def test_gemma_weights_in_fp32_take_the_fp32_path():
    """A Gemma checkpoint kept in fp32 norms under a bf16 model (weights of another
    dtype than x): the weight is read as it is stored."""
    x, r, wa, wb = _inputs(3, 72, torch.bfloat16, seed=2)
    wa, wb = wa.float() + 1e-3, wb.float() - 1e-3  # not representable in bf16
    want, want_r = ref.sandwich_rms_norm(x, r, wa, wb, EPS, **GEMMA)
    got, got_r = TRITON.sandwich_rms_norm(x, r.clone(), wa, wb, EPS, **GEMMA)
    _close(got_r, want_r)
    _close(got, want)


def test_empty_rows_and_bad_input_are_refused_clearly():
    x, r, wa, wb = _inputs(4, 40, torch.float32)
    out, res = TRITON.sandwich_rms_norm(x[:0], r[:0], wa, wb, EPS)
    assert out.shape == (0, 40) and res.shape == (0, 40)
    with pytest.raises(ValueError, match=r"x and residual of one \(T, N\) shape"):
        TRITON.sandwich_rms_norm(x, r[:, :39], wa, wb, EPS)
    with pytest.raises(ValueError, match=r"x and residual of one \(T, N\) shape and dtype"):
        TRITON.sandwich_rms_norm(x, r.double(), wa, wb, EPS)
    with pytest.raises(ValueError, match=r"post and pre weights \(40,\)"):
        TRITON.sandwich_rms_norm(x, r, wa[:39], wb, EPS)
    with pytest.raises(ValueError, match="unit stride on N"):
        TRITON.sandwich_rms_norm(x, r.t().contiguous().t(), wa, wb, EPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1152, 2304, 3840, 1000])  # Gemma-3 1B, Gemma-2 2B, Gemma-3 12B
@pytest.mark.parametrize("rows", [1, 3, 256])
def test_on_the_gpu_equals_the_reference(n, rows):
    """bf16 Gemma widths (and an odd one) on the GPU against the reference run there."""
    x, r, wa, wb = (t.cuda() for t in _inputs(rows, n, torch.bfloat16, seed=rows))
    want, want_r = ref.sandwich_rms_norm(x, r, wa, wb, EPS, **GEMMA)
    got, got_r = get_backend("cuda").sandwich_rms_norm(x, r.clone(), wa, wb, EPS, **GEMMA)
    _close(got_r.cpu(), want_r.cpu())
    _close(got.cpu(), want.cpu())
