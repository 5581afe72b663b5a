"""The W8A8 fused MoE over block-scaled FP8 experts (``kernels/moe/fp8.py``'s prefill
variant): activations quantised to float8_e4m3fn per row and group of 128 columns, FP8 x
FP8 dots scaled per K tile. On CPU through the Triton interpreter, which runs FP8 x FP8
``tl.dot`` (tried: an e4m3 (16, 32) x (32, 16) dot equals the fp64 product of the same
FP8 values to fp32 rounding), so the kernel's own FP8 dot is what runs here.

Experts as ``test_kernels_moe_fp8_tile.py`` makes them (E 4, top-k 2, 128 x 128 blocks,
multipliers 2^-15..2^-9), odd token counts.

Oracles:
- the W8A8 torch reference (``fp8_gemm_ref.moe_fp8_w8a8``: x and the activation
  quantised by ``quantize_act`` and dequantised, fp32 products against the dequantised
  experts, written from its definition): max error <= 8e-3 x max |reference|. The two
  use the same FP8 operands and fp32 sums (in another order); the output's bf16 rounding
  is <= 2^-8 of the largest element (3.9e-3), and an intermediate rounded to bf16 one ulp
  apart can move its FP8 code by one step. Observed <= 1e-6. The reference differs from
  the 16-bit-activation reference by > 1 % rms, so this oracle tells the two apart;
- the 16-bit-activation path (``fp8_gemm_ref.moe_fp8``): relative rms error <= sqrt(3)
  x 2^-4 = 0.108. An e4m3 value carries 3 mantissa bits, so rounding moves each
  quantised element by <= 2^-4 of itself; the errors of different elements are
  independent, so a dot product's error has rms <= 2^-4 of the dot's own rms (the
  products' rms). Three quantised operands feed the output in series (x into gate and
  up, which share it; the activation into down; silu's gain on gate's error is <= 1.1),
  their errors independent: sqrt(3) x 2^-4. Observed 0.04-0.05 (a rounding error
  uniform over the ulp has rms ~0.4 x 2^-4);
- the step's ``RowsPlan.moe_w8a8`` decides, seen through a spy on the quantiser; a
  plan naming the other variant runs it (with its reference's numbers).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_kernels_moe_fp8_tile import BLOCK, _case, _gpu_operands, _rel

from unikv.kernels.backend import get_backend
from unikv.kernels.linear import fp8_gemm_ref
from unikv.kernels.moe import fp8, fused

C = fused.Config
BOUND_VS_16_BIT = math.sqrt(3) * 2.0**-4
CONFIGS = {
    "plan": None,  # bucket 8's 16-bit table entry: swapped, a K tile of one whole block
    "two-k-tiles-a-block": C(16, 64, 64, 1, 4, 3),
    "n-tile-spans-two-scale-rows": C(16, 256, 128, 1, 4, 3),
    "swap-rows-by-mean": C(0, 64, 128, 1, 4, 3, True),
    "split-k-runs-unsplit": C(16, 32, 128, 2, 4, 3),
}


def _rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _bf16_case(tokens, d, inter, activation="silu", seed=0):
    x, weights, ids, experts = _case(tokens, d, inter, activation, seed=seed)
    return x.bfloat16(), weights.bfloat16(), ids, experts


def spy_quantiser(monkeypatch) -> list:
    """Each call of the launcher's activation quantiser: (rows, columns, group)."""
    calls, real = [], fused.quantize_act

    def wrapper(x, group):
        calls.append((*x.shape, group))
        return real(x, group)

    monkeypatch.setattr(fused, "quantize_act", wrapper)
    return calls


@pytest.mark.parametrize("name", list(CONFIGS))
def test_w8a8_kernel_matches_its_reference(name, monkeypatch):
    """Each config's W8A8 against the reference. An N tile of whole 128-column groups
    (the plan's 128, and 256: two groups a program) quantises the activation in the
    gate/up kernel's epilogue, so the launcher's quantiser runs once (x); narrower N
    tiles quantise it in a second pass."""
    x, weights, ids, experts = _bf16_case(5, 256, 128, seed=len(name))
    calls = spy_quantiser(monkeypatch)
    got = fp8.moe_fp8(x, weights, ids, *experts, block=BLOCK, config=CONFIGS[name], w8a8=True)
    want = fp8_gemm_ref.moe_fp8_w8a8(x, weights, ids, *experts, block=BLOCK)
    assert _rel(got, want) <= 8e-3
    assert _rms(want, fp8_gemm_ref.moe_fp8(x, weights, ids, *experts, block=BLOCK)) > 1e-2
    block_n = (CONFIGS[name] or fp8.plan(5, torch.bfloat16, w8a8=True)).block_n
    assert calls[0] == (5, 256, 128) and len(calls) == (1 if block_n % 128 == 0 else 2)


@pytest.mark.parametrize(
    "tokens, d, inter, activation, cfg",
    [(1, 128, 256, "silu", None), (17, 256, 192, "silu", C(16, 128, 128, 1, 4, 3)),
     (17, 256, 192, "silu", C(16, 64, 128, 1, 4, 3)), (7, 256, 128, "relu2", None)],
)  # fmt: skip
def test_w8a8_shapes_activations_and_up_rows_starting_mid_block(tokens, d, inter, activation, cfg):
    """One token; 17 tokens over an intermediate of 192 (up's scale rows start at 2, its
    rows mid-block; the activation's last group 64 columns wide, quantised in the
    epilogue and in the second pass); relu2 (one part)."""
    x, weights, ids, experts = _bf16_case(tokens, d, inter, activation, seed=tokens)
    kw = {"block": BLOCK, "activation": activation}
    got = fp8.moe_fp8(x, weights, ids, *experts, w8a8=True, config=cfg, **kw)
    assert _rel(got, fp8_gemm_ref.moe_fp8_w8a8(x, weights, ids, *experts, **kw)) <= 8e-3


def test_w8a8_stays_within_its_bound_of_the_16_bit_activation_path(monkeypatch):
    """21 tokens, d 256, I 256: the relative rms distance to the 16-bit-activation
    kernel and to its reference is within sqrt(3) x 2^-4 (module docstring); x is
    quantised once per token (21 rows, not 42 assignments) and (the plan's N tile of 64:
    a second pass) the activation once per sorted row, both in groups of 128 columns."""
    x, weights, ids, experts = _bf16_case(21, 256, 256, seed=3)
    calls = spy_quantiser(monkeypatch)
    got = fp8.moe_fp8(x, weights, ids, *experts, block=BLOCK, w8a8=True)
    assert calls[0] == (21, 256, 128) and calls[1][1:] == (256, 128) and len(calls) == 2
    assert calls[1][0] >= 42  # every assignment's row, padded per expert
    a16 = fp8.moe_fp8(x, weights, ids, *experts, block=BLOCK, w8a8=False)
    assert len(calls) == 2  # the 16-bit path quantises nothing
    assert _rms(got, a16) <= BOUND_VS_16_BIT
    assert (
        _rms(got, fp8_gemm_ref.moe_fp8(x, weights, ids, *experts, block=BLOCK)) <= BOUND_VS_16_BIT
    )


def test_the_rows_plan_decides_w8a8_on_both_sides_of_the_threshold(monkeypatch):
    """With the threshold at 3 tokens: the backend's plan for 2 and 3 rows says what the
    op's own rule says without a plan, and the op follows the plan either way (a plan
    naming the other variant runs it, with that variant's reference numbers)."""
    monkeypatch.setattr(fp8, "W8A8_MIN_TOKENS", 3)
    tri = get_backend("cpu", "triton")
    assert get_backend("cpu", "torch").plan_rows(4096).moe_w8a8 is False
    calls = spy_quantiser(monkeypatch)
    for rows in (2, 3):
        x, weights, ids, experts = _bf16_case(rows, 128, 128, seed=rows)
        plan = tri.plan_rows(rows)
        assert plan.moe_w8a8 == fp8.w8a8_rows(rows) == (rows == 3)
        for forced in (plan.moe_w8a8, not plan.moe_w8a8):
            calls.clear()
            step = dataclasses.replace(plan, moe_w8a8=forced)
            got = tri.moe_fp8(x, weights, ids, *experts, block=BLOCK, rows=step)
            assert bool(calls) == forced, (rows, forced)  # x quantised, or nothing
            # W8A8: its reference's bound; 16-bit activations: the per-tile kernel's
            # (test_kernels_moe_fp8_tile.py)
            ref, tol = (fp8_gemm_ref.moe_fp8_w8a8, 8e-3) if forced else (fp8_gemm_ref.moe_fp8, 3e-2)
            assert _rel(got, ref(x, weights, ids, *experts, block=BLOCK)) <= tol
        calls.clear()
        tri.moe_fp8(x, weights, ids, *experts, block=BLOCK)  # no plan: x's rows
        assert bool(calls) == (rows == 3)


def test_fp32_and_tiles_across_scale_blocks_keep_16_bit_activations(monkeypatch):
    """A plan saying W8A8 over fp32 x, or over a layer whose tile's K spans two scale
    blocks (256 over 128), runs the 16-bit-activation kernel (fp32: the reference's
    numbers to 1e-5); forcing W8A8 there is refused, naming the K tile."""
    x, weights, ids, experts = _case(3, 256, 128, seed=2)
    step = dataclasses.replace(get_backend("cpu", "triton").plan_rows(3), moe_w8a8=True)
    calls = spy_quantiser(monkeypatch)
    got = fp8.moe_fp8(x, weights, ids, *experts, block=BLOCK, rows=step)
    assert (
        not calls
        and _rel(got, fp8_gemm_ref.moe_fp8(x, weights, ids, *experts, block=BLOCK)) <= 1e-5
    )
    wide = C(16, 64, 256, 1, 4, 3)
    monkeypatch.setattr(fp8, "TABLE", {(8, True): wide})
    xb, wb = x.bfloat16(), weights.bfloat16()
    got = fp8.moe_fp8(xb, wb, ids, *experts, block=BLOCK, rows=step)
    assert not calls and _rel(got, fp8_gemm_ref.moe_fp8(xb, wb, ids, *experts, block=BLOCK)) <= 3e-2
    with pytest.raises(ValueError, match="block_k 256") as err:
        fp8.moe_fp8(xb, wb, ids, *experts, block=BLOCK, w8a8=True)
    assert "block_k dividing 128" in str(err.value)
    with pytest.raises(ValueError, match="torch.float32"):
        fp8.moe_fp8(x, weights, ids, *experts, block=BLOCK, w8a8=True)


def test_plan_takes_the_variants_entry_else_the_16_bit_activations_one(monkeypatch):
    a16, w8 = C(16, 64, 128, 1, 4, 3), C(64, 128, 128, 1, 8, 3)
    monkeypatch.setattr(fp8, "TABLE", {(8, False): a16, (2048, True): w8})
    assert fp8.plan(5, torch.bfloat16, w8a8=True) is a16  # no (8, True): the 16-bit one
    assert fp8.plan(300, torch.bfloat16, w8a8=True) is w8
    assert fp8.plan(300, torch.bfloat16, at=8, w8a8=True) is a16  # the step's bucket
    assert fp8.plan(300, torch.bfloat16) == fused.TABLE[2048, False]
    assert fp8.plan(300, torch.float32, w8a8=True) is fused.FP32_CONFIG


def test_the_sweep_candidates_keep_their_k_tile_in_one_block():
    """Every candidate the FP8 sweep times is a valid Config whose K tile lies inside a
    128-column block (W8A8 needs it; for 16-bit activations it is the fast FP8 mode)."""
    for configs in fp8.SWEEP.values():
        for cfg in configs:
            fused.check_config(cfg)
            assert BLOCK[1] % cfg.block_k == 0, cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [300, 2048])
def test_gpu_w8a8_matches_its_reference(tokens):
    """Compiled (FP8 wgmma, the plan's tiles at prefill buckets): E 8, top-2, d 1024,
    I 512: the kernel and the fp32 reference each within ``W8A8_RMS_BOUND`` (overall) and
    ``W8A8_ROW_BOUND`` (worst row) of the exact description (``moe_fp8_w8a8(exact=True)``; the
    max error over max |reference| <= 1e-2 used here before is a tail statistic that the
    FP8 MMA's own accumulation crosses at T 2048 with neither side wrong:
    ``test_kernels_moe_w8a8_exact.py``), and the 16-bit-activation kernel within the bound."""
    x, weights, ids, w1, s1, w2, s2 = _gpu_operands(tokens)
    plan = get_backend("cuda", "triton").plan_rows(tokens)
    assert plan.moe_w8a8
    got = fp8.moe_fp8(x, weights, ids, w1, s1, w2, s2, block=BLOCK, rows=plan)
    want = fp8_gemm_ref.moe_fp8_w8a8(x, weights, ids, w1, s1, w2, s2, block=BLOCK)
    exact = fp8_gemm_ref.moe_fp8_w8a8(x, weights, ids, w1, s1, w2, s2, block=BLOCK, exact=True)
    for side in (got, want):
        rms, worst_row = fp8_gemm_ref.w8a8_errors(side, exact)
        assert rms <= fp8_gemm_ref.W8A8_RMS_BOUND and worst_row <= fp8_gemm_ref.W8A8_ROW_BOUND
    a16 = fp8.moe_fp8(x, weights, ids, w1, s1, w2, s2, block=BLOCK, w8a8=False)
    assert _rms(got, a16) <= BOUND_VS_16_BIT
