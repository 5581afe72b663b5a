"""The output activations' kernels (``unikv/kernels/linear/activation.py``): gated
attention's ``x * sigmoid(gate)`` and NemotronH's ``relu(x) ** 2``, one launch each;
and gated attention's q and k norms as one launch (``elementwise.qk_rms_norm``).

The references against independent derivations: ``relu_square`` equals transformers'
own ``ACT2FN["relu2"]`` bit for bit; ``sigmoid_mul`` equals the product computed in
fp64 and rounded, within the dtype's rounding of the sigmoid and of the product, and
with an addend, that product rounded then added to it in fp64 and rounded. The
Triton kernels (CPU interpreter) against the references, at odd widths, on the strided
views the models pass (the gate read from the q|gate GEMM output, a (T, 1) gate
broadcast by a zero stride, a transposed x; Qwen3-Next's gate a column of the packed
router|gate GEMM output and the routed experts' sum as the addend), in fp32 and bf16: ``relu_square``
exactly (one fp32 product rounded once, as torch's), ``sigmoid_mul`` within 1e-6 in
fp32 and one bf16 ulp with >= 97 % of the elements bit-equal. ``qk_rms_norm``'s
reference equals transformers' ``Qwen3_5RMSNorm`` on q and on k exactly; its kernel
the reference as ``rms_norm``'s kernel does (1e-5 in fp32, one bf16 ulp).
"""

from __future__ import annotations

import pytest
import torch

from unikv.kernels.backend import get_backend
from unikv.kernels.linear import ref

TRITON = get_backend("cpu", "triton")
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, dtype=torch.float32, seed=0, scale=3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def _close_sigmoid(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    """``_close`` for a sigmoid product on a GPU. There Triton's ``exp`` is the
    hardware's ``ex2.approx`` (a few fp32 ulps), not torch's correctly rounded one,
    so in fp32 a sigmoid in (0, 1) may sit a few ulps of 1 off torch's: the product
    within ``2**-20 * |x|``, plus one rounding of the result."""
    got, want, x = got.cpu(), want.cpu(), x.cpu()
    if want.dtype != torch.float32:
        _close(got, want)
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    bound = 2.0**-20 * x.abs().expand_as(want) + 2.0**-23 * want.abs()
    worst = ((got - want).abs() - bound).max().item()
    assert worst <= 0, f"fp32 sigmoid product off by more than its bound ({worst:.3g} over)"


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    equal = (got == want).float().mean().item()
    assert equal >= 0.97, f"only {equal:.3f} of the bf16 elements are bit-equal"


def _close_norm(got: torch.Tensor, want: torch.Tensor) -> None:
    """A norm's kernel vs its reference: 1e-5 in fp32 (reduction order, rsqrt), else
    as ``_close``."""
    if want.dtype != torch.float32:
        return _close(got, want)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _gated_attention_output(dtype, t=5, heads=3, d=20):
    """Attention's (T, H, D) output and its gate as Qwen3.5 passes it: the second half
    of each head's 2D columns of the q|gate part of one GEMM output (a strided view)."""
    qkv = _randn(t, heads * 2 * d + 7, dtype=dtype, seed=1)
    gate = qkv[:, : heads * 2 * d].view(t, heads, 2 * d)[..., d:]
    return _randn(t, heads, d, dtype=dtype, seed=2), gate


# -- the references against independent derivations ------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_square_reference_is_transformers_relu2(dtype):
    from transformers.activations import ACT2FN

    x = _randn(6, 37, dtype=dtype)
    assert torch.equal(ref.relu_square(x), ACT2FN["relu2"](x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul_reference_is_the_rounded_fp64_product(dtype):
    x, gate = _gated_attention_output(dtype)
    want = (x.double() * torch.sigmoid(gate.double())).to(dtype)
    ulp = 2**-23 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(ref.sigmoid_mul(x, gate).float(), want.float(), rtol=3 * ulp, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul_add_reference_is_the_rounded_fp64_sum(dtype):
    x, gate = _gated_attention_output(dtype)
    add = _randn(*x.shape, dtype=dtype, seed=6)
    s = torch.sigmoid(gate.double()).to(dtype).double()  # rounded, then the product rounded
    want = (add.double() + (x.double() * s).to(dtype).double()).to(dtype)
    ulp = 2**-23 if dtype == torch.float32 else 2**-7
    got = ref.sigmoid_mul(x, gate, add).float()  # within the sigmoid's last-bit rounding
    torch.testing.assert_close(got, want.float(), rtol=ulp, atol=ulp * x.abs().max().item())


# -- Triton against the references ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [20, 1100])  # odd head dim; wider than one program's block
def test_sigmoid_mul_triton_reads_the_gate_in_place(dtype, d):
    x, gate = _gated_attention_output(dtype, d=d)
    before = gate.clone()
    _close(TRITON.sigmoid_mul(x, gate), ref.sigmoid_mul(x, gate))
    assert torch.equal(gate, before), "the gate is read, not written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul_triton_broadcast_and_transposed(dtype):
    shared = _randn(7, 37, dtype=dtype, seed=3)  # Qwen3-Next's shared expert output
    gate = _randn(7, 1, dtype=dtype, seed=4).expand_as(shared)  # one gate per row
    _close(TRITON.sigmoid_mul(shared, gate), ref.sigmoid_mul(shared, gate))
    xt = _randn(37, 7, dtype=dtype, seed=5).t()  # no unit stride anywhere
    _close(TRITON.sigmoid_mul(xt, gate), ref.sigmoid_mul(xt, gate))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, hidden, experts", [(1, 37, 5), (7, 1100, 3)])
def test_sigmoid_mul_add_triton_shared_expert(dtype, t, hidden, experts):
    """Qwen3-Next's ``routed + sigmoid(gate) * shared``: the gate the last column of the
    router|gate GEMM output (T, E + 1), broadcast; the routed sum read transposed."""
    logits = _randn(t, experts + 1, dtype=dtype, seed=3)
    shared = _randn(t, hidden, dtype=dtype, seed=4)
    gate = logits[:, experts:].expand_as(shared)
    routed = _randn(hidden, t, dtype=dtype, seed=5).t()
    before = (logits.clone(), shared.clone(), routed.clone())
    got = TRITON.sigmoid_mul(shared, gate, routed)
    _close(got, ref.sigmoid_mul(shared, gate, routed))
    assert not torch.equal(got, TRITON.sigmoid_mul(shared, gate)), "the addend is added"
    for a, b in zip((logits, shared, routed), before, strict=True):
        assert torch.equal(a, b), "the inputs are read, not written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [37, 1500])
def test_relu_square_triton_equals_reference(dtype, n):
    y = _randn(5, n + 9, dtype=dtype, seed=6)
    y[0, :4] = torch.tensor([float("nan"), 0.0, -0.0, float("-inf")])
    x = y[:, 3 : n + 3]  # strided rows, as a packed GEMM's view
    want = ref.relu_square(x)
    for view in (x, x.t().contiguous().t()):  # strided rows; column-major
        got = TRITON.relu_square(view)
        assert got.is_contiguous() and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_qk_rms_norm_reference_is_transformers_norms():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    q, k = _randn(4, 3, 24, seed=10), _randn(4, 1, 24, seed=11)
    wq, wk = 0.3 * _randn(24, seed=12, scale=1.0), 0.3 * _randn(24, seed=13, scale=1.0)
    norms = [Qwen3_5RMSNorm(24, eps=1e-6) for _ in range(2)]
    with torch.no_grad():
        norms[0].weight.copy_(wq), norms[1].weight.copy_(wk)
    got = ref.qk_rms_norm(q, k, wq, wk, 1e-6, offset=1.0, weight_in_fp32=True)
    assert torch.equal(got[0], norms[0](q)) and torch.equal(got[1], norms[1](k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", [{"offset": 1.0, "weight_in_fp32": True}, {}])
def test_qk_rms_norm_triton_on_the_gemm_views(dtype, form):
    """q and k as Qwen3.5 passes them: q every other D-block of the q|gate part, k the
    next columns of the same (T, ...) GEMM output; 3 q heads, 1 k head, D 24."""
    t, hq, hk, d = 5, 3, 1, 24
    qkv = _randn(t, hq * 2 * d + 2 * hk * d, dtype=dtype, seed=14)
    q = qkv[:, : hq * 2 * d].view(t, hq, 2 * d)[..., :d]
    k = qkv[:, hq * 2 * d : hq * 2 * d + hk * d].view(t, hk, d)
    wq = _randn(d, dtype=dtype, seed=15, scale=0.5)
    wk = _randn(d, dtype=dtype, seed=16, scale=0.5)
    got = TRITON.qk_rms_norm(q, k, wq, wk, 1e-6, **form)
    want = ref.qk_rms_norm(q, k, wq, wk, 1e-6, **form)
    for g, w in zip(got, want, strict=True):
        _close_norm(g, w)


def test_empty_steps_and_bad_shapes():
    assert TRITON.relu_square(torch.ones(0, 5)).shape == (0, 5)
    assert TRITON.sigmoid_mul(torch.ones(0, 2, 3), torch.ones(0, 2, 3)).shape == (0, 2, 3)
    with pytest.raises(ValueError, match="gate of its shape and dtype"):
        TRITON.sigmoid_mul(torch.ones(2, 6), torch.ones(2, 3))
    with pytest.raises(ValueError, match="gate of its shape and dtype"):
        TRITON.sigmoid_mul(torch.ones(2, 6), torch.ones(2, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="add of its shape and dtype"):
        TRITON.sigmoid_mul(torch.ones(2, 6), torch.ones(2, 6), torch.ones(2, 1))
    with pytest.raises(ValueError, match="relu_square needs a"):
        TRITON.relu_square(torch.ones(2, 3, 4))
    w = torch.ones(4)
    with pytest.raises(ValueError, match="qk_rms_norm needs q"):
        TRITON.qk_rms_norm(torch.ones(2, 3, 4), torch.ones(3, 1, 4), w, w, 1e-6)
    with pytest.raises(ValueError, match="qk_rms_norm needs weights"):
        TRITON.qk_rms_norm(torch.ones(2, 3, 4), torch.ones(2, 1, 4), w, torch.ones(3), 1e-6)
    q, k = TRITON.qk_rms_norm(torch.ones(0, 3, 4), torch.ones(0, 1, 4), w, w, 1e-6)
    assert q.shape == (0, 3, 4) and k.shape == (0, 1, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_decode_shapes_on_cuda(dtype):
    """Qwen3.5's gated attention at batch 26 (16 heads of 256, the gate inside the q|gate
    GEMM output; its q and k norms), Qwen3-Next's broadcast shared-expert gate (hidden
    2048), NemotronH's MLP activation at batch 22 (intermediate 21504) and, at one row,
    inside the down projection's GEMV (hidden 4096)."""
    ops, dev = get_backend("cuda"), "cuda"
    x, gate = (v.to(dev) for v in _gated_attention_output(dtype, t=26, heads=16, d=256))
    _close_sigmoid(ops.sigmoid_mul(x, gate), ref.sigmoid_mul(x, gate), x)
    shared = _randn(26, 2048, dtype=dtype, seed=7).to(dev)
    row_gate = _randn(26, 1, dtype=dtype, seed=8).to(dev).expand_as(shared)
    _close_sigmoid(ops.sigmoid_mul(shared, row_gate), ref.sigmoid_mul(shared, row_gate), shared)
    routed = _randn(26, 2048, dtype=dtype, seed=10).to(dev)
    got, want = ops.sigmoid_mul(shared, row_gate, routed), ref.sigmoid_mul(shared, row_gate, routed)
    _close_sigmoid(got, want, shared)
    up = _randn(22, 21504, dtype=dtype, seed=9).to(dev)
    assert torch.equal(ops.relu_square(up), ref.relu_square(up))
    if dtype == torch.bfloat16:  # one request's MLP down projection: relu2 inside the GEMV
        w = _randn(4096, 21504, dtype=dtype, seed=13, scale=0.02).to(dev)
        want = ref.relu_square_linear(up[:1], w).float()
        got = ops.relu_square_linear(up[:1], w).float()
        assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    qkv = _randn(26, 16 * 512 + 2 * 2 * 256, dtype=dtype, seed=10).to(dev)  # Hq 16, Hk 2
    q = qkv[:, : 16 * 512].view(26, 16, 512)[..., :256]
    k = qkv[:, 16 * 512 : 16 * 512 + 512].view(26, 2, 256)
    wq, wk = (_randn(256, dtype=dtype, seed=s, scale=0.5).to(dev) for s in (11, 12))
    form = {"offset": 1.0, "weight_in_fp32": True}
    got = ops.qk_rms_norm(q, k, wq, wk, 1e-6, **form)
    want = ref.qk_rms_norm(q, k, wq, wk, 1e-6, **form)
    for g, w in zip(got, want, strict=True):
        _close_norm(g.cpu(), w.cpu())


# -- relu2 inside the down projection's GEMV ---------------------------------------------


@pytest.mark.parametrize("m", [1, 2])
def test_gemv_fused_relu_square_matches_the_two_ops(m):
    """relu2 inside the GEMV's loads (``relu_square_linear``'s kernel path), with a bias,
    K 72 (not a multiple of the K tile): against ``F.linear(relu_square(x)) + b`` in
    fp32 (to 1e-5) and in bf16 (to 1e-2 of the largest output)."""
    from torch.nn import functional as F

    from unikv.kernels.linear import gemv

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        x = _randn(m, 72, dtype=dtype, seed=20 + m)
        w, b = _randn(40, 72, dtype=dtype, seed=22, scale=1.0), _randn(40, dtype=dtype, seed=23)
        want = F.linear(ref.relu_square(x).float(), w.float(), b.float())
        got = gemv.gemv(x, w, b, (16, 32, 4, 2), relu_square_input=True)
        assert (got.float() - want).abs().max() <= tol * want.abs().max()


def test_backend_relu_square_linear_routes_by_rows():
    """The Triton backend's ``relu_square_linear`` equals the torch backend's at one
    row (the GEMV) and past ``ROUTE_ROWS`` (relu2's kernel, then the GEMM)."""
    from unikv.kernels.linear import gemv

    torch_ops = get_backend("cpu", "torch")
    w = _randn(24, 64, dtype=torch.bfloat16, seed=24, scale=1.0)
    for rows in (1, gemv.ROUTE_ROWS + 3):
        x = _randn(rows, 64, dtype=torch.bfloat16, seed=25)
        want = torch_ops.relu_square_linear(x, w).float()
        got = TRITON.relu_square_linear(x, w).float()
        assert (got - want).abs().max() <= 1e-2 * want.abs().max(), rows
