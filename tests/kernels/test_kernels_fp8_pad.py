"""FP8 weights held padded to whole row blocks (``fp8_gemm.padded_rows``, the
``out_features`` of ``fp8_linear``) and the activation quantisation's tilings.

Oracle: the torch reference (``fp8_gemm_ref``) on the UNPADDED weight; the padded rows
hold garbage here (not zeros), so a variant that read them into the real columns fails.

- the reference, the Triton w8a16 and w8a8 variants (interpreter) and the ``scaled_mm``
  variant on a padded weight equal the reference on the unpadded one (bias, leading
  dims), and return the (M, N) view of an (M, N padded) buffer;
- the ``scaled_mm`` variant runs on CPU through a stand-in for ``torch._scaled_mm``
  written from cuBLAS's block-scaling definition (1 x 128 activation and 128 x 128
  weight scales, N a multiple of 128 or refused), so the padding, the scales' layouts
  and the slicing are checked without a GPU; the GPU test runs the real one on
  DeepSeek-V3's 576 / 2112-row shapes;
- ``padded_rows`` pads exactly the shapes ``scaled_mm`` lacks only N for; the backends'
  ``fp8_padded_rows`` is it where ``torch._scaled_mm`` runs, else no padding;
- ``quantize_act`` equals the reference bit for bit at every tiling (rows and groups a
  program; group counts and widths that are not powers of two), its scales row-major or
  M-major (cuBLAS's layout, written by the kernel: no transposing copy);
- on the GPU, at prefill sizes, too (IEEE divisions in the kernel);
- ``out_features`` outside 1..rows is refused.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_fp8_gemm import operands, rel_err

from unikv.kernels import backend as kb
from unikv.kernels.linear import fp8_gemm, fp8_gemm_ref


def held(w: torch.Tensor, s: torch.Tensor, rows: int, block) -> tuple:
    """w, s re-held in ``rows`` rows, the pad rows and scale rows filled with garbage."""
    n, k = w.shape
    hw = torch.full((rows, k), 200.0).to(torch.float8_e4m3fn)
    hs = torch.full((-(-rows // block[0]), s.shape[1]), 7.0)
    hw[:n], hs[: s.shape[0]] = w, s
    return hw, hs


def fake_scaled_mm(a, b, *, scale_a, scale_b, out_dtype):
    """cuBLAS's block-scaled GEMM by its definition: a (M, K) FP8 with scale_a (M, K /
    128) per 1 x 128, b (K, N) FP8 (column-major) with scale_b (K / 128, N / 128) per 128
    x 128; out = (a * scale_a) @ (b * scale_b) in fp32, cast to out_dtype."""
    (m, k), n = a.shape, b.shape[1]
    if n % 128 or k % 128 or b.stride(0) != 1:
        raise RuntimeError(f"block-scaled _scaled_mm: N {n} and K {k} in whole 128 blocks")
    assert scale_a.shape == (m, k // 128) and scale_b.shape == (k // 128, n // 128)
    assert scale_a.stride() == (1, m), "cuBLAS reads the activation scales M-major"
    ad = a.float() * scale_a.repeat_interleave(128, 1)
    bd = b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (ad @ bd).to(out_dtype)


def test_padded_rows_pads_only_what_scaled_mm_lacks_n_for():
    block = (128, 128)
    assert fp8_gemm.padded_rows(576, 7168, block) == 640  # kv_a_proj_with_mqa
    assert fp8_gemm.padded_rows(2112, 7168, block) == 2176  # q_a | kv_a
    assert fp8_gemm.padded_rows(1536, 7168, block) == 1536  # whole blocks already
    assert fp8_gemm.padded_rows(576, 7168 + 128, block) == 576  # K: not whole groups of 4
    assert fp8_gemm.padded_rows(40, 64, (16, 24)) == 40  # other blocks: no scaled_mm
    for n in (576, 2112):
        rows = fp8_gemm.padded_rows(n, 7168, block)
        assert not fp8_gemm.scaled_mm_shape(n, 7168, block)
        assert fp8_gemm.plan(4096, rows, 7168, block, False, True).variant == "scaled_mm"
    assert fp8_gemm_ref.padded_rows(576, 7168, block) == 576
    triton = kb._triton(kb.Flags(cuda=True, fp8_scaled_mm=True))
    assert triton.fp8_padded_rows is fp8_gemm.padded_rows
    for ops in (kb._triton(kb.Flags(cuda=True)), kb.get_backend("cpu", "torch")):
        assert ops.fp8_padded_rows(576, 7168, block) == 576


# (m, n, rows held, k, block, plan): w8a16 with split K, w8a8, odd blocks
CASES = [
    (5, 40, 64, 96, (16, 32), None),
    (3, 33, 48, 100, (16, 24), None),
    (2, 40, 80, 1100, (16, 32), None),  # the plan splits K: the sum lands in the view
    (20, 48, 80, 96, (16, 32), fp8_gemm.Fp8Plan("w8a8", 16, 32, 32, 1, True, 4, 2)),
]


@pytest.mark.parametrize("m, n, rows, k, block, cfg", CASES)
def test_padded_weight_gives_the_unpadded_product(m, n, rows, k, block, cfg):
    x, w, s, b = operands(m, n, k, block, torch.bfloat16, seed=m + n + rows)
    hw, hs = held(w, s, rows, block)
    ref = fp8_gemm_ref.fp8_linear_w8a8 if cfg is not None else fp8_gemm_ref.fp8_linear
    for bias in (None, b):
        want = ref(x, w, s, bias, block=block)
        got = fp8_gemm_ref.fp8_linear(x, hw, hs, bias, block=block, out_features=n)
        if cfg is None:  # the reference on the held weight: the same fp32 sums
            assert torch.equal(got, want)
        assert got.shape == (m, n)
        got = fp8_gemm.fp8_linear(x, hw, hs, bias, block=block, config=cfg, out_features=n)
        assert got.shape == (m, n) and got.stride() == (rows, 1)
        assert rel_err(got, want) <= 8e-3  # bf16 output rounding (as the unpadded tests)
    lead = fp8_gemm.fp8_linear(x.view(2, m // 2, k) if m % 2 == 0 else x[None], hw, hs,
                               block=block, config=cfg, out_features=n)  # fmt: skip
    assert lead.shape[-1] == n and rel_err(lead.reshape(m, n), ref(x, w, s, block=block)) <= 8e-3


@pytest.mark.parametrize("n, bias", [(576, False), (200, True)])
def test_scaled_mm_variant_on_a_padded_weight(monkeypatch, n, bias):
    """The ``scaled_mm`` variant through the stand-in: the unpadded weight is refused
    (N not whole blocks), the padded one gives the w8a8 reference's product in the
    real rows' view."""
    block, m, k = (128, 128), fp8_gemm.SCALED_MM_MIN_ROWS, 512
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    x, w, s, b = operands(m, n, k, block, torch.bfloat16, seed=n)
    b = b if bias else None
    with pytest.raises(RuntimeError, match="whole 128 blocks"):
        fp8_gemm.scaled_mm_linear(x, w, s, None)
    rows = fp8_gemm.padded_rows(n, k, block)
    hw, hs = held(w, s, rows, block)
    hw[n:] = 0  # as the loader holds it: zero rows (their scales stay garbage)
    got = fp8_gemm.fp8_linear(x, hw, hs, b, block=block, scaled_mm=True, out_features=n)
    want = fp8_gemm_ref.fp8_linear_w8a8(x, w, s, b, block=block)
    assert got.shape == (m, n) and rel_err(got, want) <= 8e-3
    if b is None:  # the view of the padded product, no copy
        assert got.stride() == (rows, 1)


@pytest.mark.parametrize("tile", [(16, 1, 4), (4, 8, 4), (1, 4, 1), (8, 2, 2), (2, 16, 8)])
@pytest.mark.parametrize("m, k, group", [(7, 80, 32), (5, 72, 24), (33, 640, 128)])
def test_activation_quantisation_tilings_equal_the_reference(tile, m, k, group):
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    x[1, :group] = 0  # an all-zero group keeps a finite scale
    rq, rs = fp8_gemm_ref.quantize_act(x, group)
    for m_major in (False, True):
        xq, xs = fp8_gemm.quantize_act(x, group, tile, m_major=m_major)
        assert xs.stride() == ((1, m) if m_major else (xs.shape[1], 1))
        assert torch.equal(xs, rs) and torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_activation_quantisation_on_the_gpu_equals_the_reference_at_prefill_sizes():
    """At DeepSeek-V3's prefill sizes the GPU kernel's divisions must round as torch's do:
    Triton's fp32 ``/`` is approximate on NVIDIA GPUs, and with it one element in some
    millions landed on the neighbouring e4m3 value (``bench_fp8_gemm`` on an H100, K 4096
    and up)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for k in (1536, 7168, 18432):
        x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16, generator=g)
        rq, rs = fp8_gemm_ref.quantize_act(x, 128)
        xq, xs = fp8_gemm.quantize_act(x, 128, m_major=True)
        assert torch.equal(xs, rs), k
        assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8)), k


def test_out_features_outside_the_rows_is_refused():
    block = (16, 32)
    x, w, s, _ = operands(3, 40, 64, block, torch.float32, seed=3)
    for bad in (0, 41):
        with pytest.raises(ValueError, match=r"out_features.*1\.\.40"):
            fp8_gemm.fp8_linear(x, w, s, block=block, out_features=bad)
        with pytest.raises(ValueError, match=r"out_features.*1\.\.40"):
            fp8_gemm_ref.fp8_linear(x, w, s, block=block, out_features=bad)
