"""The fused elementwise ops (``unikv/kernels/linear/elementwise.py``) against their torch
references (``elementwise_ref.py``), and the references against transformers'
own unfused modules and functions (LlamaRMSNorm, GptOssRMSNorm, Gemma2RMSNorm,
apply_rotary_pos_emb of Llama and Qwen3-Next, LlamaMLP's and Gemma2MLP's activations).

Shapes are small and odd (non-power-of-two rows, heads and widths, strided
views of one fused GEMM output), in fp32 and bf16, under Triton's CPU
interpreter. Tolerances: the references equal transformers exactly (same ops in
the same order); Triton equals the references within 1e-5 in fp32 (reduction
order, rsqrt), and in bf16 within one bf16 ulp with >= 97 % of the elements
bit-equal (every intermediate rounding of the reference is reproduced).
"""

from __future__ import annotations

import pytest
import torch

from unikv.kernels.backend import get_backend
from unikv.kernels.linear import ref

TRITON = get_backend("cpu", "triton")
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=_gen(seed))).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Triton vs reference: see the module docstring for the tolerances."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    equal = (got == want).float().mean().item()
    assert equal >= 0.97, f"only {equal:.3f} of the bf16 elements are bit-equal"


# -- references against transformers ------------------------------------------------


def test_rms_norm_references_are_transformers_norms():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in DTYPES:
        x, w = _randn(7, 45, dtype=dtype, seed=1), _randn(45, dtype=dtype, seed=2)
        forms = [
            (LlamaRMSNorm(45, EPS), {}),
            (GptOssRMSNorm(45, EPS), {"weight_in_fp32": True}),
            (Gemma2RMSNorm(45, EPS), {"weight_in_fp32": True, "offset": 1.0}),
        ]
        for module, kwargs in forms:
            module = module.to(dtype)
            module.weight.data.copy_(w)
            with torch.no_grad():
                want = module(x)
            assert torch.equal(ref.rms_norm(x, w, EPS, **kwargs), want), type(module).__name__


def test_add_rms_norm_reference_is_the_residual_add_then_the_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, r = _randn(9, 30, dtype=torch.bfloat16, seed=3), _randn(9, 30, dtype=torch.bfloat16, seed=4)
    module = LlamaRMSNorm(30, EPS).to(torch.bfloat16)
    module.weight.data.copy_(_randn(30, seed=5))
    with torch.no_grad():
        normed, residual = ref.add_rms_norm(x, r, module.weight, EPS)
        assert torch.equal(residual, r + x)  # transformers: residual + hidden_states
        assert torch.equal(normed, module(r + x))


def _hf_cos_sin(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype):
    """transformers' (T, R) cos/sin rows: the half tables repeated (cat(freqs, freqs))."""
    c, s = cos[positions], sin[positions]
    return torch.cat((c, c), -1).to(dtype), torch.cat((s, s), -1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_reference_is_transformers_rope(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

    positions = torch.tensor([0, 5, 3, 40, 17])
    q, k = _randn(5, 3, 20, dtype=dtype, seed=6), _randn(5, 2, 20, dtype=dtype, seed=7)
    for half, hf in ((10, llama_rope), (4, apply_rotary_pos_emb)):  # full, partial (R 8 of 20)
        cos, sin = _randn(41, half, seed=8), _randn(41, half, seed=9)
        c, s = _hf_cos_sin(cos, sin, positions, dtype)
        # transformers: (B, H, T, D) with unsqueeze_dim 1; here B = T tokens of one position
        want_q, want_k = hf(q[:, :, None], k[:, :, None], c[:, None], s[:, None], unsqueeze_dim=1)
        got_q, got_k = ref.rope_qk(q, k, cos, sin, positions)
        assert torch.equal(got_q, want_q[:, :, 0]) and torch.equal(got_k, want_k[:, :, 0])


def test_silu_mul_reference_is_llama_mlp_activation():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=13, num_attention_heads=2)).to(
        torch.bfloat16
    )
    g, u = _randn(6, 13, dtype=torch.bfloat16, seed=10), _randn(6, 13, dtype=torch.bfloat16)
    assert torch.equal(ref.silu_mul(torch.cat((g, u), -1)), mlp.act_fn(g) * u)


def test_gelu_tanh_mul_reference_is_gemma_mlp_activation():
    from transformers import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP

    cfg = Gemma2Config(hidden_size=8, intermediate_size=13, num_attention_heads=2, head_dim=4)
    mlp = Gemma2MLP(cfg).to(torch.bfloat16)
    g, u = _randn(6, 13, dtype=torch.bfloat16, seed=40), _randn(6, 13, dtype=torch.bfloat16)
    assert torch.equal(ref.gelu_tanh_mul(torch.cat((g, u), -1)), mlp.act_fn(g) * u)


# -- Triton against the references ---------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "form", [{}, {"weight_in_fp32": True}, {"weight_in_fp32": True, "offset": 1.0}]
)
def test_rms_norm_triton_matches_reference(dtype, form):
    x, w = _randn(7, 45, dtype=dtype, seed=11, scale=3.0), _randn(45, dtype=dtype, seed=12)
    _close(TRITON.rms_norm(x, w, EPS, **form), ref.rms_norm(x, w, EPS, **form))
    # per-head norm (Qwen3's q_norm) on a strided view of a fused q|k|v row
    qkv = _randn(5, 3 * 24 + 8, dtype=dtype, seed=13)
    q = qkv[:, : 3 * 24].view(5, 3, 24)
    wd = _randn(24, dtype=dtype, seed=14)
    _close(TRITON.rms_norm(q, wd, EPS, **form), ref.rms_norm(q, wd, EPS, **form))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_triton_matches_reference_and_updates_residual(dtype):
    x, r = _randn(11, 37, dtype=dtype, seed=15), _randn(11, 37, dtype=dtype, seed=16, scale=4.0)
    w = _randn(37, dtype=dtype, seed=17)
    for form in ({}, {"weight_in_fp32": True}):
        want_n, want_r = ref.add_rms_norm(x, r, w, EPS, **form)
        residual = r.clone()
        got_n, got_r = TRITON.add_rms_norm(x, residual, w, EPS, **form)
        assert got_r.data_ptr() == residual.data_ptr()  # in place
        assert torch.equal(got_r, want_r)  # one rounding of the same fp32 sum
        _close(got_n, want_n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("half", [6, 4])  # full rotary of D 12, partial (8 of 12)
def test_rope_triton_matches_reference_in_place_on_fused_views(dtype, half):
    t, hq, hk, d = 7, 5, 3, 12
    qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype, seed=18)
    cos, sin = _randn(50, half, seed=19), _randn(50, half, seed=20)
    positions = torch.randint(0, 50, (t,), generator=_gen(21))
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)
    want_q, want_k = ref.rope_qk(q, k, cos, sin, positions)
    v_before = v.clone()
    got_q, got_k = TRITON.rope_qk(q, k, cos, sin, positions)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    _close(got_q, want_q)
    _close(got_k, want_k)
    assert torch.equal(v, v_before)  # v, beside q and k in the same rows, untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_triton_matches_reference(dtype):
    gate_up = _randn(9, 2 * 1500, dtype=dtype, seed=22, scale=3.0)  # I 1500: two blocks
    _close(TRITON.silu_mul(gate_up), ref.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_triton_matches_reference(dtype):
    gate_up = _randn(9, 2 * 1500, dtype=dtype, seed=41, scale=3.0)  # I 1500: two blocks
    gate_up[0, :8] = torch.tensor([-40.0, -12.0, -3.0, -1e-3, 0.0, 1e-3, 12.0, 40.0])  # tails
    _close(TRITON.gelu_tanh_mul(gate_up), ref.gelu_tanh_mul(gate_up))


def test_empty_steps_and_bad_shapes():
    w = torch.ones(8)
    assert TRITON.rms_norm(torch.ones(0, 8), w, EPS).shape == (0, 8)
    assert TRITON.silu_mul(torch.ones(0, 6)).shape == (0, 3)
    assert TRITON.gelu_tanh_mul(torch.ones(0, 6)).shape == (0, 3)
    with pytest.raises(ValueError, match="weight must be"):
        TRITON.rms_norm(torch.ones(2, 9), w, EPS)
    with pytest.raises(ValueError, match="one .T, N. shape"):
        TRITON.add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), w, EPS)
    with pytest.raises(ValueError, match="gate.up"):
        TRITON.silu_mul(torch.ones(2, 7))
    with pytest.raises(ValueError, match="gelu_tanh_mul needs"):
        TRITON.gelu_tanh_mul(torch.ones(2, 7))
    with pytest.raises(ValueError, match="backend must be"):
        get_backend("cpu", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_shapes_on_cuda(dtype):
    """Llama-3.2-1B's decode shapes (B 256, hidden 2048, GQA 32/8, D 64, I 8192)."""
    ops, dev = get_backend("cuda"), "cuda"
    x, r = _randn(256, 2048, dtype=dtype).to(dev), _randn(256, 2048, dtype=dtype, seed=1).to(dev)
    w = _randn(2048, dtype=dtype, seed=2).to(dev)
    _close(ops.rms_norm(x, w, EPS).cpu(), ref.rms_norm(x, w, EPS).cpu())
    want = ref.add_rms_norm(x, r, w, EPS)
    got = ops.add_rms_norm(x, r.clone(), w, EPS)
    _close(got[0].cpu(), want[0].cpu())
    assert torch.equal(got[1], want[1])
    qkv = _randn(256, 48 * 64, dtype=dtype, seed=3).to(dev)
    q, k = qkv[:, : 32 * 64].view(256, 32, 64), qkv[:, 32 * 64 : 40 * 64].view(256, 8, 64)
    cos, sin = _randn(4096, 32, seed=4).to(dev), _randn(4096, 32, seed=5).to(dev)
    pos = torch.randint(0, 4096, (256,), generator=_gen(6)).to(dev)
    want_q, want_k = ref.rope_qk(q, k, cos, sin, pos)
    got_q, got_k = ops.rope_qk(q, k, cos, sin, pos)
    _close(got_q.cpu(), want_q.cpu())
    _close(got_k.cpu(), want_k.cpu())
    gate_up = _randn(256, 2 * 8192, dtype=dtype, seed=7).to(dev)
    _close(ops.silu_mul(gate_up).cpu(), ref.silu_mul(gate_up).cpu())
    _close(ops.gelu_tanh_mul(gate_up).cpu(), ref.gelu_tanh_mul(gate_up).cpu())
