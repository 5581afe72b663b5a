"""The row-shaped ops take their variant from the step's ``RowsPlan`` (issue 43 item 5):
the GEMV routing, the MoE's dense table or sparse loop and its kernel bucket, the FP8
GEMM's variant by rows.

Oracles, per choice:

- the variant an op takes without a plan at R rows (its shape rule, the behaviour
  before plans), seen through a spy on that variant's kernel: the backend's
  ``plan_rows(R)`` makes the op take the same one, on both sides of the threshold
  (and the two sides differ, so the threshold is crossed);
- a plan that names the other variant makes the op run it (the spy sees it), with the
  numbers of the torch reference (``F.linear``, a naive per-token MoE loop, the FP8
  references).

Triton kernels run on CPU through the interpreter (``TRITON_INTERPRET=1``, conftest).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from unikv.kernels.backend import RowsPlan, get_backend
from unikv.kernels.linear import fp8_gemm, fp8_gemm_ref, gemv
from unikv.kernels.moe import fused
from unikv.kernels.moe import ref as moe_ref


def spy(monkeypatch, module, name: str, stub=None) -> list:
    """Record each call of ``module.name`` (its first argument's rows); ``stub``
    replaces it (else the real one runs)."""
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append((args[0].shape[0], kwargs))
        return (stub or real)(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(1.0, want.float().abs().max().item()), err


# -- the GEMV routing ----------------------------------------------------------------


def test_the_gemv_plan_names_the_variant_the_rows_took(monkeypatch):
    tri = get_backend("cpu", "triton")
    calls = spy(monkeypatch, gemv, "gemv")
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    took = {}
    for rows in (gemv.ROUTE_ROWS, gemv.ROUTE_ROWS + 1):
        x = torch.randn(rows, 64).bfloat16()
        tri.linear(x, w)  # no plan: the op's shape rule
        unplanned = len(calls)
        tri.linear(x, w, rows=tri.plan_rows(rows))
        assert len(calls) - unplanned == unplanned, rows  # the same variant
        assert tri.plan_rows(rows).gemv == bool(unplanned)
        took[rows] = unplanned
        calls.clear()
    assert took == {gemv.ROUTE_ROWS: 1, gemv.ROUTE_ROWS + 1: 0}  # both sides


@pytest.mark.parametrize("rows, forced", [(1, False), (3, True)])
def test_the_linear_ops_follow_a_forced_gemv_plan(rows, forced, monkeypatch):
    """One row forced to cuBLAS, three rows (more than ROUTE_ROWS) forced to the GEMV:
    each linear op takes the plan's variant and gives the reference's numbers."""
    tri, ref = get_backend("cpu", "triton"), get_backend("cpu", "torch")
    plan = dataclasses.replace(tri.plan_rows(rows), gemv=forced)
    assert plan.gemv != tri.plan_rows(rows).gemv  # the other variant than the rule's
    calls = spy(monkeypatch, gemv, "gemv")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(24, 64, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    gu = torch.randn(rows, 128, generator=g).bfloat16()
    nw = torch.rand(64, generator=g).bfloat16() + 0.5
    for op, args in (
        ("linear", (x, w)),
        ("silu_mul_linear", (gu, w)),
        ("add_rms_norm_linear", (x, None, nw, 1e-6, w)),
    ):
        before = len(calls)
        got = getattr(tri, op)(*args, rows=plan)
        want = getattr(ref, op)(*args)
        got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
        assert (len(calls) > before) == forced, op
        close(got, want, 1e-2)


# -- the MoE: dense table or sparse loop (reference), bucket (fused) --------------------


def moe_case(t: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    e, d, i, k = 4, 8, 6, 2
    x = torch.randn(t, d, generator=g).to(dtype)
    weights = torch.rand(t, k, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w1 = (torch.randn(e, 2 * i, d, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(e, d, i, generator=g) * 0.3).to(dtype)
    return x, weights, ids, w1, w2


def naive_moe(x, weights, ids, w1, w2) -> torch.Tensor:
    """Token by token, slot by slot, from the definition (SwiGLU experts, fp32)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w1[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, j].float() * (w2[e].float() @ (F.silu(gate) * up))
    return out


def expert_rows(monkeypatch) -> list:
    """The rows each expert evaluation of the reference MoE gets (dense: every token)."""
    return spy(monkeypatch, moe_ref, "_expert")


def test_the_moe_plan_names_the_loop_the_rows_took(monkeypatch):
    ref = get_backend("cpu", "torch")
    rows = expert_rows(monkeypatch)
    dense = {}
    for t in (moe_ref.DENSE_MAX_TOKENS, moe_ref.DENSE_MAX_TOKENS + 1):
        case = moe_case(t, seed=t)
        moe_ref.fused_moe(*case)  # no plan: the shape rule
        unplanned = [r for r, _ in rows]
        rows.clear()
        moe_ref.fused_moe(*case, rows=ref.plan_rows(t))
        assert [r for r, _ in rows] == unplanned  # the same loop, expert by expert
        rows.clear()
        dense[t] = all(r == t for r in unplanned)
        assert ref.plan_rows(t).moe_dense == dense[t]
    assert dense == {moe_ref.DENSE_MAX_TOKENS: True, moe_ref.DENSE_MAX_TOKENS + 1: False}


@pytest.mark.parametrize("t, forced", [(6, False), (moe_ref.DENSE_MAX_TOKENS + 4, True)])
def test_the_reference_moe_follows_a_forced_plan(t, forced, monkeypatch):
    ref = get_backend("cpu", "torch")
    plan = dataclasses.replace(ref.plan_rows(t), moe_dense=forced)
    assert plan.moe_dense != ref.plan_rows(t).moe_dense
    rows = expert_rows(monkeypatch)
    case = moe_case(t, seed=7)
    got = ref.moe(*case, rows=plan)
    assert all(r == t for r, _ in rows) == forced  # dense: every expert on every token
    close(got, naive_moe(*case), 1e-5)


def test_the_fused_moe_takes_the_plans_bucket(monkeypatch):
    """The Triton MoE's config is its table's at the plan's bucket: the same as the
    shape rule's at 8 and 9 tokens (buckets 8 and 16), and a forced bucket's config
    where the plan names another; a forced plan's numbers equal the naive loop."""
    tri = get_backend("cpu", "triton")
    seen = spy(monkeypatch, fused, "fused_moe")
    for t in (8, 9):
        case = moe_case(t, seed=t, dtype=torch.bfloat16)
        tri.moe(*case)
        tri.moe(*case, rows=tri.plan_rows(t))
        (_, unplanned), (_, planned) = seen
        assert planned["config"] == unplanned["config"] == fused.TABLE[fused.bucket(t), False]
        seen.clear()
    assert fused.TABLE[8, False] != fused.TABLE[16, False]  # the two sides differ
    case = moe_case(9, seed=3, dtype=torch.bfloat16)
    forced = dataclasses.replace(tri.plan_rows(9), moe_bucket=1)
    got = tri.moe(*case, rows=forced)
    assert seen[-1][1]["config"] == fused.TABLE[1, False] != fused.TABLE[16, False]
    close(got, naive_moe(*case), 3e-2)


# -- the FP8 GEMM's variant by rows ---------------------------------------------------

BLOCK = (16, 32)


def fp8_operands(m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n, k = 32, 64
    w = (torch.randn(n, k, generator=g) * 80).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1]), generator=g) * 0.02 + 1e-3
    return torch.randn(m, k, generator=g).bfloat16(), w, s


class Planned(Exception):
    """Raised by the plan spy once the launch plan is known (no kernel needed)."""


def launch_plan(monkeypatch, op, x, w, s, **kw) -> fp8_gemm.Fp8Plan:
    """The ``Fp8Plan`` the FP8 op launches for ``x`` (stopped before the launch)."""
    seen, real = [], fp8_gemm.plan

    def stop(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        raise Planned

    monkeypatch.setattr(fp8_gemm, "plan", stop)
    with pytest.raises(Planned):
        op(x, w, s, block=BLOCK, **kw)
    monkeypatch.setattr(fp8_gemm, "plan", real)
    return seen[0]


@pytest.mark.parametrize("scaled_mm", [False, True])
def test_the_fp8_plan_names_the_variant_the_rows_took(scaled_mm, monkeypatch):
    """At each row threshold (16 / 17 and 64 / 65: the tiles; 255 / 256: w8a8 and
    ``_scaled_mm`` where the backend has it) the plan's launch equals the shape rule's."""
    op = fp8_gemm.fp8_linear
    plan_rows = get_backend("cpu", "triton").plan_rows
    if scaled_mm:  # a backend whose probe found _scaled_mm usable (the CPU has none)
        op = lambda *a, **k: fp8_gemm.fp8_linear(*a, scaled_mm=True, **k)
        plan_rows = lambda r: dataclasses.replace(
            get_backend("cpu", "triton").plan_rows(r), fp8=fp8_gemm.row_choice(r, True)
        )
    launches = {}
    for m in (16, 17, 64, 65, 255, 256):
        x, w, s = fp8_operands(m, seed=m)
        unplanned = launch_plan(monkeypatch, op, x, w, s)
        assert launch_plan(monkeypatch, op, x, w, s, rows=plan_rows(m)) == unplanned, m
        launches[m] = unplanned
    for low, high in ((16, 17), (64, 65), (255, 256)):
        assert launches[low] != launches[high], (low, high)  # both sides of each threshold
    # a 128 x 128-block shape _scaled_mm takes: its choice by rows at 255 / 256
    n, k, block = 128, 512, (128, 128)
    for m in (255, 256):
        got = fp8_gemm.plan(m, n, k, block, False, scaled_mm, plan_rows(m).fp8)
        assert got == fp8_gemm.plan(m, n, k, block, False, scaled_mm), m
    want = "scaled_mm" if scaled_mm else "w8a8"
    assert fp8_gemm.plan(256, n, k, block, False, scaled_mm, plan_rows(256).fp8).variant == want


def test_the_fp8_gemm_follows_a_forced_plan(monkeypatch):
    """Four rows planned as a prefill (w8a8: x quantised per token group) and as the
    widest w8a16 tile: the op runs that variant, with its reference's numbers; a plan
    naming ``_scaled_mm`` goes to it (stubbed: the CPU has no block-scaled one)."""
    tri = get_backend("cpu", "triton")
    x, w, s = fp8_operands(4, seed=5)
    quantised = spy(monkeypatch, fp8_gemm, "quantize_act")
    base = tri.plan_rows(4)
    assert base.fp8 == fp8_gemm.row_choice(4) and not base.fp8.w8a8
    w8a8 = dataclasses.replace(base, fp8=fp8_gemm.Fp8Rows(2, True, False))
    got = tri.fp8_linear(x, w, s, block=BLOCK, rows=w8a8)
    assert len(quantised) == 1
    close(got, fp8_gemm_ref.fp8_linear_w8a8(x, w, s, block=BLOCK), 8e-3)
    wide = dataclasses.replace(base, fp8=fp8_gemm.Fp8Rows(2, False, False))
    assert launch_plan(monkeypatch, tri.fp8_linear, x, w, s, rows=wide)[:3] == ("w8a16", 64, 128)
    got = tri.fp8_linear(x, w, s, block=BLOCK, rows=wide)
    assert len(quantised) == 1  # not quantised: the widened-weight variant
    close(got, fp8_gemm_ref.fp8_linear(x, w, s, block=BLOCK), 1e-2)
    stubbed = spy(
        monkeypatch,
        fp8_gemm,
        "scaled_mm_linear",
        stub=lambda x2, w, s, b: x2 @ w.T.float().to(x2.dtype),
    )
    shape_ok = torch.zeros(4, 512).bfloat16(), torch.zeros(128, 512).to(torch.float8_e4m3fn)
    scaled = dataclasses.replace(base, fp8=fp8_gemm.Fp8Rows(0, False, True))
    tri.fp8_linear(*shape_ok, torch.ones(1, 4), block=(128, 128), rows=scaled)
    assert [r for r, _ in stubbed] == [4]


def test_a_plan_is_host_ints_and_the_torch_backend_plans_no_kernel():
    ref = get_backend("cpu", "torch")
    plan = ref.plan_rows(3)
    assert plan == RowsPlan(3, gemv=False, moe_dense=True, moe_bucket=0, fp8=None)
    assert ref.plan_rows(moe_ref.DENSE_MAX_TOKENS + 1).moe_dense is False
