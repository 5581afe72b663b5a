"""The FP8 linear's pre-norm with its activation quantisation in one pass
(``kernels/linear/norm_quant.py``, on CPU through the Triton interpreter), and the GEMM
that takes x so quantised (``fp8_gemm.fp8_linear_quantized``).

Oracle: today's two-kernel path, run op for op: the Triton ``add_rms_norm`` (or
``rms_norm`` without a residual), then the FP8 GEMM's own ``quantize_act``; and for the
GEMM, ``fp8_linear`` on the normed rows (which quantises them itself).

- the codes, the scales (values and layout: row-major, or M-major as cuBLAS reads them)
  and the updated residual equal the two-kernel path's bit for bit, on odd shapes: T
  not a multiple of any tile, a row width that is not a multiple of the group (its last
  group partial, zeros past the row counting for nothing) or narrower than one group,
  bf16 and fp16, Llama's and Gemma's weight rules, no residual, no rows; the torch
  reference gives the same bytes;
- ``fp8_linear_quantized`` on those codes equals ``fp8_linear`` on the normed rows bit
  for bit: the Triton w8a8 GEMM, and the ``scaled_mm`` variant through the stand-in for
  ``torch._scaled_mm`` (``test_kernels_fp8_pad.fake_scaled_mm``), on a weight held
  padded, with a bias; the reference's equals ``fp8_linear_w8a8``;
- ``fp8_act_quant`` says what ``plan`` does: M-major 128-groups where it picks
  ``scaled_mm``, row-major bk-groups for ``w8a8``, None for decode rows, fp32 and the
  torch backend; a step's ``RowsPlan`` decides over the rows given;
- refused: fp32 x, a group that is not a power of two, a residual of another shape,
  codes of the wrong width; scales in the other layout trip the GEMM's assert.
- compiled for sm_90a on this host (``tests/norm_layouts.py``, a subprocess without the
  interpreter), the fused kernel sums each row's squares in the register layout of
  ``_rms_norm_kernel`` at the models' widths, dtypes and weight rules: the order of the
  fp32 sum, which the interpreter cannot show (the H100 caught codes that differed at
  7,168 when the FP8 store widened the fused row to 16 elements a thread).
A GPU test checks the bit equality at DeepSeek-V3's width (7168) and 4096 rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_kernels_fp8_gemm import operands
from test_kernels_fp8_pad import fake_scaled_mm, held

from unikv.kernels import backend as kb
from unikv.kernels.linear import elementwise, fp8_gemm, fp8_gemm_ref, norm_quant
from unikv.kernels.linear import ref as elementwise_ref


def rows_of(t: int, n: int, dtype, seed: int, residual: bool):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, generator=g) * 3).to(dtype)
    if t > 1:
        x[1, : min(n, 32)] = 0  # with a zero residual row part: an all-zero group
    r = (torch.randn(t, n, generator=g) * 2).to(dtype) if residual else None
    if r is not None and t > 1:
        r[1, : min(n, 32)] = 0
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    return x, r, w


def two_kernels(x, r, w, eps, group, m_major, **kw):
    """Today's path: the Triton norm (the add in place), then ``quantize_act``."""
    if r is None:
        h, res = elementwise.rms_norm(x, w, eps, **kw), x
    else:
        h, res = elementwise.add_rms_norm(x, r, w, eps, **kw)
    xq, xs = fp8_gemm.quantize_act(h, group, m_major=m_major)
    return xq, xs, res, h


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# (T, N, group): T odd; N a multiple of the group, not one (a partial last group),
# narrower than one group; 128 as the checkpoints' blocks
SHAPES = [(7, 200, 128), (33, 256, 64), (5, 96, 32), (3, 64, 128), (18, 384, 128)]


@pytest.mark.parametrize("t, n, group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual", [True, False])
def test_codes_scales_and_residual_equal_norm_then_quantize_act(t, n, group, dtype, residual):
    x, r, w = rows_of(t, n, dtype, seed=t * n + group, residual=residual)
    for m_major in (False, True):
        r1 = None if r is None else r.clone()
        r2 = None if r is None else r.clone()
        xq, xs, res = norm_quant.add_rms_norm_quant(x, r1, w, 1e-6, group=group, m_major=m_major)
        wq, ws, want_res, h = two_kernels(x, r2, w, 1e-6, group, m_major)
        assert same_bytes(xq, wq) and torch.equal(xs, ws)
        assert xs.shape == (t, -(-n // group)) and xs.stride() == ws.stride()
        assert torch.equal(res, want_res)
        if r is not None:
            assert res.data_ptr() == r1.data_ptr()  # the sum written into residual
        else:
            assert res is x
        rq, rs, rres = elementwise_ref.add_rms_norm_quant(
            x, None if r is None else r.clone(), w, 1e-6, group=group, m_major=m_major
        )
        assert same_bytes(rq, xq) and torch.equal(rs, xs) and rs.stride() == xs.stride()
        assert torch.equal(rres, res)
        # and the codes are a quantisation of the normed rows: within e4m3's half step
        deq = fp8_gemm_ref.dequantize(xq, xs.contiguous(), (1, group))
        assert (deq - h.float()).abs().max() <= h.float().abs().max() * 2.0**-4


@pytest.mark.parametrize("kw", [{"offset": 1.0, "weight_in_fp32": True}, {"weight_in_fp32": True}])
def test_the_other_weight_rules_equal_norm_then_quantize_act(kw):
    x, r, w = rows_of(9, 160, torch.bfloat16, seed=9, residual=True)
    w = w.float() - 0.9  # Gemma's zero-centred weight, kept fp32
    xq, xs, res = norm_quant.add_rms_norm_quant(x, r.clone(), w, 1e-5, group=32, **kw)
    wq, ws, want_res, _ = two_kernels(x, r.clone(), w, 1e-5, 32, False, **kw)
    assert same_bytes(xq, wq) and torch.equal(xs, ws) and torch.equal(res, want_res)


def test_no_rows():
    x, r, w = rows_of(0, 128, torch.bfloat16, seed=0, residual=True)
    xq, xs, res = norm_quant.add_rms_norm_quant(x, r, w, 1e-6, group=128, m_major=True)
    assert xq.shape == (0, 128) and xs.shape == (0, 1) and res is r


def quantised_input(m, k, group, m_major, seed):
    x, r, w = rows_of(m, k, torch.bfloat16, seed=seed, residual=True)
    xq, xs, _ = norm_quant.add_rms_norm_quant(x, r.clone(), w, 1e-6, group=group, m_major=m_major)
    h, _ = elementwise.add_rms_norm(x, r.clone(), w, 1e-6)
    return xq, xs, h


@pytest.mark.parametrize("m, n, rows, k", [(20, 48, 48, 96), (37, 40, 80, 100)])
def test_w8a8_gemm_from_the_codes_equals_fp8_linear_on_the_normed_rows(m, n, rows, k):
    """The Triton w8a8 GEMM (its plan forced to small rows here), on a weight held in
    more rows than it has (``out_features``), with and without a bias."""
    block = (16, 32)
    _, w, s, b = operands(m, n, k, block, torch.bfloat16, seed=m + n)
    hw, hs = held(w, s, rows, block)
    cfg = fp8_gemm.Fp8Plan("w8a8", 16, 32, 32, 1, True, 4, 2)
    by_rows = kb.RowsPlan(rows=m, fp8=fp8_gemm.Fp8Rows(2, True, False))
    quant = fp8_gemm.fp8_act_quant(m, rows, k, block, torch.bfloat16, by_rows)
    assert quant == fp8_gemm_ref.Fp8Quant(32, False)
    xq, xs, h = quantised_input(m, k, quant.group, quant.m_major, seed=m)
    out = None if rows == n else n
    for bias in (None, b):
        want = fp8_gemm.fp8_linear(h, hw, hs, bias, block=block, config=cfg, out_features=out)
        got = fp8_gemm.fp8_linear_quantized(
            xq, xs, hw, hs, bias, block=block, out_dtype=h.dtype, rows=by_rows, out_features=out
        )
        assert torch.equal(got, want) and got.stride() == want.stride()
        ref = fp8_gemm_ref.fp8_linear_quantized(
            xq, xs, hw, hs, bias, block=block, out_dtype=h.dtype, out_features=out
        )
        assert torch.equal(ref, fp8_gemm_ref.fp8_linear_w8a8(h, w, s, bias, block=block))


@pytest.mark.parametrize("n, bias", [(576, False), (200, True), (256, True)])
def test_scaled_mm_from_the_codes_equals_fp8_linear_on_the_normed_rows(monkeypatch, n, bias):
    """The ``scaled_mm`` variant (through the stand-in), the weight held padded to whole
    128-row blocks as the loader holds it."""
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    block, m, k = (128, 128), fp8_gemm.SCALED_MM_MIN_ROWS + 3, 512
    _, w, s, b = operands(m, n, k, block, torch.bfloat16, seed=n)
    b = b if bias else None
    rows = fp8_gemm.padded_rows(n, k, block)
    hw, hs = held(w, s, rows, block)
    hw[n:] = 0
    quant = fp8_gemm.fp8_act_quant(m, rows, k, block, torch.bfloat16, scaled_mm=True)
    assert quant == fp8_gemm_ref.Fp8Quant(128, True)
    xq, xs, h = quantised_input(m, k, 128, True, seed=n)
    out = None if rows == n else n
    want = fp8_gemm.fp8_linear(h, hw, hs, b, block=block, scaled_mm=True, out_features=out)
    got = fp8_gemm.fp8_linear_quantized(
        xq, xs, hw, hs, b, block=block, out_dtype=h.dtype, out_features=out, scaled_mm=True
    )
    assert torch.equal(got, want) and got.shape == (m, n)
    with pytest.raises(AssertionError, match="M-major"):
        fp8_gemm.fp8_linear_quantized(xq, xs.contiguous(), hw, hs, block=block,
                                      out_dtype=h.dtype, out_features=out, scaled_mm=True)  # fmt: skip


def test_act_quant_says_what_the_plan_does():
    block, k, bf16 = (128, 128), 7168, torch.bfloat16
    big, small = fp8_gemm.W8A8_MIN_ROWS, 16
    m_major, row_major = fp8_gemm_ref.Fp8Quant(128, True), fp8_gemm_ref.Fp8Quant(128, False)
    act_quant = fp8_gemm.fp8_act_quant
    assert act_quant(big, 2176, k, block, bf16, scaled_mm=True) == m_major
    assert act_quant(big, 2176, k, block, bf16) == row_major  # no _scaled_mm: Triton w8a8
    assert act_quant(big, 2112, k, block, bf16, scaled_mm=True) == row_major  # N cuts a block
    assert act_quant(small, 2176, k, block, bf16, scaled_mm=True) is None  # decode rows
    assert act_quant(big, 2176, k, block, torch.float32, scaled_mm=True) is None
    assert act_quant(big, 48, 72, (16, 24), bf16) is None  # bk 24: no FP8 x FP8 tile
    decode_plan = kb.RowsPlan(rows=1, fp8=fp8_gemm.row_choice(1, True))
    assert act_quant(big, 2176, k, block, bf16, decode_plan) is None  # the plan decides
    assert kb.get_backend("cpu", "torch").fp8_act_quant(big, 2176, k, block, bf16) is None
    triton = kb._triton(kb.Flags(cuda=True, fp8_scaled_mm=True))
    assert triton.fp8_act_quant(big, 2176, k, block, bf16) == m_major


def test_bad_input_is_refused():
    x, r, w = rows_of(4, 128, torch.bfloat16, seed=1, residual=True)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        norm_quant.add_rms_norm_quant(x.float(), r.float(), w, 1e-6, group=128)
    with pytest.raises(ValueError, match="power of two"):
        norm_quant.add_rms_norm_quant(x, r, w, 1e-6, group=48)
    with pytest.raises(ValueError, match="residual must be"):
        norm_quant.add_rms_norm_quant(x, r[:3], w, 1e-6, group=128)
    with pytest.raises(ValueError, match=r"weight must be \(128,\)"):
        norm_quant.add_rms_norm_quant(x, r, w[:64], 1e-6, group=128)
    block = (16, 32)
    _, wq, s, _ = operands(4, 48, 96, block, torch.bfloat16, seed=2)
    xq, xs, _ = quantised_input(4, 64, 32, False, seed=2)
    for fn in (fp8_gemm.fp8_linear_quantized, fp8_gemm_ref.fp8_linear_quantized):
        with pytest.raises(ValueError, match=r"xq must be float8_e4m3fn \(M, 96\)"):
            fn(xq, xs, wq, s, block=block, out_dtype=torch.bfloat16)


def test_sums_squares_in_the_norm_kernels_layout_when_compiled_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # real compiles, not another run's cache
    script = Path(__file__).resolve().parents[1] / "norm_layouts.py"
    env["PYTHONPATH"] = os.pathsep.join([str(script.parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    layouts: dict = {}
    for name, n, dt, has_res, w_fp32, layout in json.loads(run.stdout.splitlines()[-1]):
        layouts.setdefault((n, dt, has_res, w_fp32), {})[name] = layout
    assert len(layouts) == 5 * 2 * 2  # every width, dtype and (residual, weight rule)
    differ = {k: v for k, v in layouts.items() if len(v) != 2 or len(set(v.values())) != 1}
    assert not differ, differ
    # DeepSeek-V3's row: 16 warps, 8 elements a thread (the norm's 16-byte bf16 vectors)
    assert "sizePerThread = [8]" in layouts[7168, "bf16", True, False]["rms_norm"]
    assert "sizePerThread = [8]" in layouts[5120, "fp16", False, True]["add_rms_norm_quant"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m_major", [False, True])
def test_bit_equal_on_deepseek_width_gpu(m_major):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096 + 5, 7168, device="cuda", generator=g).bfloat16()
    r = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    w = (torch.rand(7168, device="cuda", generator=g) + 0.5).bfloat16()
    xq, xs, res = norm_quant.add_rms_norm_quant(x, r.clone(), w, 1e-6, group=128, m_major=m_major)
    wq, ws, want_res, _ = two_kernels(x, r.clone(), w, 1e-6, 128, m_major)
    assert same_bytes(xq, wq) and torch.equal(xs, ws) and xs.stride() == ws.stride()
    assert torch.equal(res, want_res)
