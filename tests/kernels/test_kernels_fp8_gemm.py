"""The block-scaled FP8 GEMM (``kernels/linear/fp8_gemm.py``, on CPU through the Triton
interpreter) and its torch reference (``kernels/linear/fp8_gemm_ref.py``).

Oracles: a naive loop over blocks dequantising the weight one scalar scale at a time
(``test_models_fp8.naive_dequant``) times x in fp32 (``F.linear``); for the prefill
variant, the same with x quantised per token and group by a loop written here.

- the reference equals the naive oracle, for odd shapes and block sizes;
- the Triton kernel equals the reference: both w8a16 paths (K tile inside one scale
  block, and odd blocks dequantised per element), split K, bias, fp32 and bf16 x,
  leading dims, strided x, zero rows;
- the w8a8 (prefill) variant: activation quantisation bit for bit against the loop,
  and the GEMM against the w8a8 reference;
- ``plan`` picks w8a16 for decode rows and fp32, w8a8 for 16-bit prefill, from host
  ints only, and ``scaled_mm`` (``torch._scaled_mm``) for 16-bit prefill only where the
  backend allows it and the shape fits; the backend's ``fp8_linear`` is the kernel / the
  reference;
- bad operands are refused with what was expected and given.
GPU tests check the kernel on DeepSeek-V3 / Qwen3 shapes with 128 x 128 blocks, and the
``scaled_mm`` prefill variant (probed usable on sm_90+) against the w8a8 reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from unikv.kernels.backend import get_backend
from unikv.kernels.linear import fp8_gemm, fp8_gemm_ref

FP8_MAX = 448.0


def naive_dequant(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    bn, bk = block
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


def operands(m, n, k, block, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 80).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    s = torch.rand(math.ceil(n / block[0]), math.ceil(k / block[1]), generator=g) * 0.02 + 1e-3
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x.to(device), w.to(device), s.to(device), b.to(device)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize(
    "m, n, k, block", [(3, 40, 64, (16, 24)), (5, 33, 100, (7, 32)), (1, 16, 16, (16, 16))]
)
def test_reference_equals_the_naive_loop(m, n, k, block):
    x, w, s, b = operands(m, n, k, block, torch.float32, seed=m + n + k)
    want = F.linear(x, naive_dequant(w, s, block), b)
    got = fp8_gemm_ref.fp8_linear(x, w, s, b, block=block)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


# (m, n, k, block, plan): the K tile inside a scale block (per-column scales after the
# dot) or not (odd blocks: per-element dequantisation), split K, several N / M tiles
CASES = [
    (3, 40, 64, (16, 24), None),  # odd blocks, N and K tails
    (5, 70, 96, (16, 32), None),  # per-column scales, N tail
    (17, 33, 200, (8, 64), None),  # M over one tile, K tail
    (2, 40, 1100, (16, 32), None),  # the plan splits K
    (4, 24, 256, (8, 64), fp8_gemm.Fp8Plan("w8a16", 16, 16, 32, 3, True, 4, 2)),
    (4, 24, 256, (8, 48), fp8_gemm.Fp8Plan("w8a16", 16, 16, 32, 2, False, 4, 2)),
]


@pytest.mark.parametrize("m, n, k, block, cfg", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_kernel_matches_the_reference(m, n, k, block, cfg, dtype):
    x, w, s, b = operands(m, n, k, block, dtype, seed=m * n + k)
    if cfg is None:
        assert fp8_gemm.plan(m, n, k, block, dtype == torch.float32).variant == "w8a16"
    for bias in (None, b):
        want = fp8_gemm_ref.fp8_linear(x, w, s, bias, block=block)
        got = fp8_gemm.fp8_linear(x, w, s, bias, block=block, config=cfg)
        assert got.dtype == dtype and got.shape == (m, n)
        # fp32: rounding only; bf16: the output's rounding (the kernel widens the FP8
        # weight to bf16 exactly and scales in fp32)
        assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 8e-3)


def test_kernel_takes_leading_dims_strided_rows_and_no_rows():
    block = (16, 32)
    x, w, s, b = operands(6, 48, 64, block, torch.float32, seed=1)
    wide = torch.randn(6, 64 + 8)
    wide[:, 3 : 3 + 64] = x
    strided = wide[:, 3 : 3 + 64].reshape(2, 3, 64)
    got = fp8_gemm.fp8_linear(strided, w, s, b, block=block)
    want = fp8_gemm_ref.fp8_linear(x, w, s, b, block=block).view(2, 3, 48)
    assert got.shape == (2, 3, 48) and rel_err(got, want) <= 1e-5
    empty = fp8_gemm.fp8_linear(x[:0], w, s, b, block=block)
    assert empty.shape == (0, 48)


def test_activation_quantisation_equals_the_loop():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 80, generator=g) * 3).bfloat16()
    x[2, 32:64] = 0  # an all-zero group keeps a finite scale
    xq, xs = fp8_gemm.quantize_act(x, 32)
    for r in range(7):
        for grp in range(3):
            cols = slice(grp * 32, (grp + 1) * 32)
            amax = x[r, cols].float().abs().max().item()
            scale = max(amax / FP8_MAX, 1e-12)
            assert xs[r, grp].item() == pytest.approx(scale, rel=1e-7)
            want = (x[r, cols].float() / xs[r, grp]).to(torch.float8_e4m3fn)
            assert torch.equal(xq[r, cols].view(torch.uint8), want.view(torch.uint8))
    rq, rs = fp8_gemm_ref.quantize_act(x, 32)
    assert torch.equal(xs, rs) and torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("n, k, block", [(48, 96, (16, 32)), (40, 70, (16, 32))])
def test_w8a8_kernel_matches_its_reference(n, k, block):
    x, w, s, b = operands(20, n, k, block, torch.bfloat16, seed=n + k)
    cfg = fp8_gemm.Fp8Plan("w8a8", 16, 32, 32, 1, True, 4, 2)
    for bias in (None, b):
        want = fp8_gemm_ref.fp8_linear_w8a8(x, w, s, bias, block=block)
        got = fp8_gemm.fp8_linear(x, w, s, bias, block=block, config=cfg)
        assert rel_err(got, want) <= 8e-3  # the same FP8 operands; bf16 output rounding
    # and it approximates the exact product (x's FP8 rounding: ~2^-4 per element)
    assert rel_err(want, fp8_gemm_ref.fp8_linear(x, w, s, b, block=block)) <= 0.05


def test_plan_picks_by_rows_and_dtype():
    block = (128, 128)
    decode = fp8_gemm.plan(4, 7168, 2048, block, False)
    assert decode.variant == "w8a16" and decode.per_k_scale and decode.block_k == 128
    prefill = fp8_gemm.plan(4096, 7168, 2048, block, False)
    assert prefill.variant == "w8a8" and prefill.split_k == 1
    assert fp8_gemm.plan(4096, 7168, 2048, block, True).variant == "w8a16"  # fp32: exact
    assert fp8_gemm.plan(4096, 96, 2048, (16, 24), False).variant == "w8a16"  # odd block
    small_n = fp8_gemm.plan(1, 576, 7168, block, False)  # few tiles: K split
    assert small_n.split_k > 1


def test_plan_takes_scaled_mm_only_where_the_backend_allows_it():
    """The ``scaled_mm`` prefill variant: only when the backend says torch runs it, for
    16-bit rows from ``SCALED_MM_MIN_ROWS`` on, 128 x 128 blocks, N in whole blocks and
    K in whole groups of four; the rest plans as before. On the CPU the probe says no and
    the Triton backend's ``fp8_linear`` is the kernel itself."""
    block, big = (128, 128), fp8_gemm.SCALED_MM_MIN_ROWS
    assert fp8_gemm.plan(big, 7168, 2048, block, False, True).variant == "scaled_mm"
    assert fp8_gemm.plan(8192, 24576, 1536, block, False, True).variant == "scaled_mm"
    for m, n, k, blk, fp32 in [
        (big - 1, 7168, 2048, block, False),  # below the threshold: the Triton plans
        (16, 7168, 2048, block, False),  # decode
        (4096, 7168, 2048, block, True),  # fp32 stays exact
        (4096, 7168 + 64, 2048, block, False),  # N cuts a block
        (4096, 7168, 2048 + 128, block, False),  # K / 128 not a multiple of 4
        (4096, 7168, 2048, (128, 64), False),  # other blocks
    ]:
        got = fp8_gemm.plan(m, n, k, blk, fp32, True)
        assert got == fp8_gemm.plan(m, n, k, blk, fp32, False), (m, n, k)
        assert got.variant != "scaled_mm", (m, n, k)
    assert fp8_gemm.plan(4096, 7168, 2048, block, False).variant == "w8a8"  # not allowed
    assert not fp8_gemm.scaled_mm_supported(torch.device("cpu"))
    assert get_backend("cpu", "triton").fp8_linear is fp8_gemm.fp8_linear


def test_backend_ops_are_the_kernel_and_the_reference():
    block = (16, 32)
    x, w, s, b = operands(3, 40, 64, block, torch.float32, seed=2)
    want = fp8_gemm_ref.fp8_linear(x, w, s, b, block=block)
    for name in ("torch", "triton"):
        got = get_backend("cpu", name).fp8_linear(x, w, s, b, block=block)
        assert rel_err(got, want) <= 1e-5, name
    assert get_backend("cpu", "torch").fp8_linear is fp8_gemm_ref.fp8_linear


def test_bad_operands_are_refused():
    block = (16, 32)
    x, w, s, _ = operands(3, 40, 64, block, torch.float32, seed=3)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm_ref.fp8_linear(x, w.float(), s, block=block)
    with pytest.raises(ValueError, match=r"\(\.\.\., 64\)"):
        fp8_gemm_ref.fp8_linear(x[:, :60], w, s, block=block)
    with pytest.raises(ValueError, match=r"expected|\(3, 2\)"):
        fp8_gemm.fp8_linear(x, w, s[:, :1], block=block)
    with pytest.raises(ValueError, match="fp32"):
        fp8_gemm.fp8_linear(x, w, s.double(), block=block)


# -- GPU ------------------------------------------------------------------------------

REAL_SHAPES = [  # (name, N, K): DeepSeek-V3 and Qwen3 layers, 128 x 128 blocks
    ("dsv3.q_a_proj", 1536, 7168),
    ("dsv3.kv_a_proj_with_mqa", 576, 7168),
    ("dsv3.qkv_a_proj", 2112, 7168),  # q_a | kv_a packed
    ("dsv3.q_b_proj", 24576, 1536),
    ("dsv3.o_proj", 7168, 16384),
    ("dsv3.mlp.gate_up", 36864, 7168),
    ("dsv3.mlp.down", 7168, 18432),
    ("qwen3_8b.qkv", 6144, 4096),
    ("qwen3_8b.down", 4096, 12288),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 300, 4096])
@pytest.mark.parametrize("name, n, k", REAL_SHAPES)
def test_kernel_on_real_shapes_gpu(m, name, n, k):
    """bf16 x at decode and prefill rows against the reference (w8a16: the dequantised
    weight in fp32; w8a8: the same FP8 activations); fp32 x at decode rows, IEEE."""
    block = (128, 128)
    x, w, s, b = operands(m, n, k, block, torch.bfloat16, seed=m + n, device="cuda")
    cfg = fp8_gemm.plan(m, n, k, block, False)
    ref = fp8_gemm_ref.fp8_linear_w8a8 if cfg.variant == "w8a8" else fp8_gemm_ref.fp8_linear
    got = fp8_gemm.fp8_linear(x, w, s, b, block=block)
    assert rel_err(got, ref(x, w, s, b, block=block)) <= 1e-2, (name, cfg)
    if m <= 16:
        x32 = x.float()
        got = fp8_gemm.fp8_linear(x32, w, s, b, block=block)
        assert rel_err(got, fp8_gemm_ref.fp8_linear(x32, w, s, b, block=block)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [256, 4096])
@pytest.mark.parametrize("name, n, k", REAL_SHAPES)
def test_scaled_mm_variant_matches_the_reference_gpu(m, name, n, k):
    """On sm_90+ with this torch the backend found ``torch._scaled_mm``'s block scaling
    (probed at construction), its ``fp8_linear`` plans prefill rows to it, and the result
    equals the w8a8 reference (the same FP8 activations) on real shapes; N not in whole
    128-row blocks (576, 2112) runs on the weight held padded as the backend's
    ``fp8_padded_rows`` says (zero rows), sliced to N."""
    import torch.nn.functional as F

    device = torch.device("cuda")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("block-scaled _scaled_mm needs sm_90 or newer")
    assert fp8_gemm.scaled_mm_supported(device), "this torch's block-scaled _scaled_mm failed"
    backend = get_backend(device)
    block = (128, 128)
    rows = backend.fp8_padded_rows(n, k, block)
    assert fp8_gemm.scaled_mm_shape(n, k, block) == (rows == n)
    assert fp8_gemm.plan(m, rows, k, block, False, True).variant == "scaled_mm"
    x, w, s, b = operands(m, n, k, block, torch.bfloat16, seed=m + n, device="cuda")
    hw = torch.zeros(rows, k, dtype=w.dtype, device=device)
    hs = torch.ones(-(-rows // 128), s.shape[1], device=device)
    hw[:n], hs[: s.shape[0]] = w, s
    got = backend.fp8_linear(x, hw, hs, b, block=block, out_features=n)
    want = fp8_gemm_ref.fp8_linear_w8a8(x, w, s, b, block=block)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel_err(got, want) <= 1e-2, name
    dense = fp8_gemm_ref.dequantize(w, s, block).to(torch.bfloat16)  # a second derivation
    assert rel_err(got, F.linear(x, dense, b)) <= 5e-2, name
