"""DeepSeek's rope of interleaved pairs in one launch (``kernels/linear/rope_pairs.py``,
Triton under the CPU interpreter and on the GPU) against an independent torch
description of the same numbers: each pair (x[2i], x[2i+1]) rotated as a complex
product ``(x[2i] + j x[2i+1]) * (cos_i + j sin_i)`` (torch's complex multiply, fp32:
"complex"), or as two real rotations rounded to the model dtype after every op and
written ``[evens' | odds']`` ("interleave"). Bit for bit; rope widths 6 and 40, odd
head counts, q and k strided views of one projection output, as the MLA layer has
them."""

from __future__ import annotations

import pytest
import torch

from unikv.kernels import get_backend

TRITON = get_backend("cpu", "triton")
TORCH = get_backend("cpu", "torch")


def _inputs(dtype, heads, rope, tokens=7, seed=0, device="cpu"):
    """q (T, H, rope) and k (T, 1, rope) as strided views of one (T, width) output (q
    heads after a nope part, as ``q.view(t, heads, -1).split``), tables of 50 rows."""
    gen = torch.Generator().manual_seed(seed)
    nope = 5
    proj = torch.randn(tokens, heads * (nope + rope) + 3 + rope, generator=gen).to(dtype)
    q = proj[:, : heads * (nope + rope)].view(tokens, heads, nope + rope)[..., nope:]
    k = proj[:, heads * (nope + rope) + 3 :][:, None, :]
    cos, sin = torch.randn(50, rope // 2, generator=gen), torch.randn(50, rope // 2, generator=gen)
    pos = torch.randint(0, 50, (tokens,), generator=gen)
    return [t.to(device) for t in (q, k, cos, sin, pos)]


def _complex(x, c, s):
    """fp32 complex product of each pair, kept interleaved."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * torch.complex(c, s)).flatten(-2).to(x.dtype)


def _real(x, c, s):
    """Each pair rotated in x's dtype, op by op, evens' then odds'."""
    c, s = c.to(x.dtype), s.to(x.dtype)
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.cat([torch.sub(e * c, o * s), torch.add(o * c, e * s)], dim=-1)


def _oracle(q, k, cos, sin, pos, layout):
    c, s = cos[pos][:, None], sin[pos][:, None]
    rot = _complex if layout == "complex" else _real
    return rot(q, c, s), rot(k, c, s)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["complex", "interleave"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,rope", [(3, 6), (1, 40), (5, 40)])
def test_rope_pairs_equals_the_oracle(backend, layout, dtype, heads, rope):
    q, k, cos, sin, pos = _inputs(dtype, heads, rope)
    before = (q.clone(), k.clone())
    got_q, got_k = get_backend("cpu", backend).rope_pairs(q, k, cos, sin, pos, layout)
    want_q, want_k = _oracle(q, k, cos, sin, pos, layout)
    if layout == "complex" and dtype == torch.float32:  # torch's complex product may fuse
        torch.testing.assert_close(got_q, want_q, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(got_k, want_k, rtol=2e-6, atol=2e-6)
    else:
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # inputs kept


@pytest.mark.parametrize("layout", ["complex", "interleave"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_the_reference_bit_for_bit(layout, dtype):
    q, k, cos, sin, pos = _inputs(dtype, 4, 40, tokens=9, seed=2)
    got = TRITON.rope_pairs(q, k, cos, sin, pos, layout)
    want = TORCH.rope_pairs(q, k, cos, sin, pos, layout)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    empty = TRITON.rope_pairs(q[:0], k[:0], cos, sin, pos[:0], layout)
    assert empty[0].shape == (0, 4, 40) and empty[1].shape == (0, 1, 40)


def test_rope_pairs_rejects_bad_input():
    q, k, cos, sin, pos = _inputs(torch.float16, 2, 6)
    with pytest.raises(ValueError, match="layout must be one of"):
        TRITON.rope_pairs(q, k, cos, sin, pos, "neox")
    with pytest.raises(ValueError, match="rope_pairs needs q"):
        TRITON.rope_pairs(q, k, cos[:, :2], sin[:, :2], pos, "complex")
    with pytest.raises(ValueError, match="one dtype"):
        TRITON.rope_pairs(q, k.float(), cos, sin, pos, "complex")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["complex", "interleave"])
@pytest.mark.parametrize("tokens", [1, 300])
def test_rope_pairs_on_the_gpu_equals_the_reference(layout, tokens):
    """DeepSeek-V3's widths (128 heads, rope 64), bf16, bit for bit with the torch
    reference run on the GPU (contraction off in the kernel)."""
    q, k, cos, sin, pos = _inputs(torch.bfloat16, 128, 64, tokens=tokens, device="cuda")
    got = get_backend("cuda").rope_pairs(q, k, cos, sin, pos, layout)
    want = TORCH.rope_pairs(q, k, cos, sin, pos, layout)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
