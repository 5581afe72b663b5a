"""Triton kernels of the decode step's elementwise work, one launch each, with
the signatures and rounding of their torch references (``elementwise_ref.py``):

- ``rms_norm`` / ``add_rms_norm``: one program per row, fp32 statistics; the
  residual add is fused in (the sum is rounded to the model dtype, written back
  into ``residual`` in place, and normalised from the rounded value).
- ``rope_qk``: one program per token rotates every q and k head in place,
  reading cos/sin by position from the fp32 tables (no gather or cast kernels).
- ``silu_mul``, ``gelu_tanh_mul``: ``act(gate) * up`` over a concatenated
  ``[gate | up]`` row (Llama's SwiGLU; Gemma's GeGLU).
- ``qk_rms_norm``: attention's per-head q and k norms (two weights) in one launch,
  one program per (token, head) of q and k.
- ``gated_rms_norm``: one program per (row, group): the recurrent mixers' gated
  output norm in one launch (the unfused formula is about ten kernels).

Each intermediate the unfused torch formula rounds to the model dtype is
rounded here too, so bf16 outputs agree with the references to the last bit
up to fp32 reduction order; in fp32 they agree to ~1 ulp. Floating-point
contraction (FMA) is left off for the same reason.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.checks import check_same_device, next_pow2
from unikv.kernels.runtime.interpret import patch_interpreter

patch_interpreter()  # the interpreter's bf16 casts round as the GPU's do

MAX_ROW = 65536  # widest row one rms_norm program holds in registers


@triton.jit
def rms_normed(h, w, cols, mask, N, eps, offset, dt: tl.constexpr, W_FP32: tl.constexpr):
    """RMSNorm of the fp32 row ``h`` (lanes past N hold 0) by the weight at ``w``, in
    ``dt``: ``(h * (offset + w)).to(dt)`` with W_FP32, else ``(offset + w) * h.to(dt)``,
    each rounding the torch reference takes (every row norm here and ``sandwich.py``)."""
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    wv = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32) + offset
    if W_FP32:
        y = h * wv
    else:
        y = wv.to(dt).to(tl.float32) * h.to(dt).to(tl.float32)
    return y.to(dt)


@triton.jit
def _rms_norm_kernel(
    x,
    res,
    w,
    out,
    n1,
    sx0,
    sx1,
    sr0,
    N,
    eps,
    offset,
    HAS_RES: tl.constexpr,
    W_FP32: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dt = out.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    xv = tl.load(x + (row // n1) * sx0 + (row % n1) * sx1 + cols, mask=mask, other=0.0)
    if HAS_RES:
        rv = tl.load(res + row * sr0 + cols, mask=mask, other=0.0)
        xv = (rv.to(tl.float32) + xv.to(tl.float32)).to(dt)
        tl.store(res + row * sr0 + cols, xv, mask=mask)
    y = rms_normed(xv.to(tl.float32), w, cols, mask, N, eps, offset, dt, W_FP32)
    tl.store(out + row * N + cols, y, mask=mask)


def _norm(x, residual, weight, eps, offset, weight_in_fp32) -> torch.Tensor:
    n = x.shape[-1]
    assert x.stride(-1) == 1 and x.dim() in (2, 3), "rms_norm rows: 2-D or 3-D, unit last stride"
    if weight.shape != (n,) or n > MAX_ROW:
        raise ValueError(f"weight must be ({n},) with {n} <= {MAX_ROW}, got {tuple(weight.shape)}")
    check_same_device(x, residual, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = out.numel() // n
    if rows == 0:
        return out
    n1, sx1 = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    block = next_pow2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out,
        n1, x.stride(0), sx1, residual.stride(0) if residual is not None else 0,
        n, float(eps), float(offset),
        HAS_RES=residual is not None, W_FP32=bool(weight_in_fp32), BLOCK=block,
        num_warps=min(16, max(1, block // 256)), enable_fp_fusion=False,
    )  # fmt: skip
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dim (see ``elementwise_ref.rms_norm``).

    x: (T, N) or (T, H, N) float, unit stride on N (rows/heads may be strided);
    weight: (N,); other shapes or strides are flattened to (rows, N) first.
    Returns a new contiguous tensor of x's shape and dtype."""
    if x.dim() in (2, 3) and x.stride(-1) == 1:
        return _norm(x, None, weight, eps, offset, weight_in_fp32)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    return _norm(flat, None, weight, eps, offset, weight_in_fp32).view(x.shape)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), one pass (``elementwise_ref.add_rms_norm``).

    x, residual: (T, N), one dtype, unit stride on N. ``residual`` is
    overwritten with the sum and returned; the normed rows are a new tensor."""
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm needs x and residual of one (T, N) shape and dtype, got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}"
        )
    if residual.stride(-1) != 1:
        raise ValueError(f"residual needs unit stride on N, got strides {residual.stride()}")
    return _norm(x, residual, weight, eps, offset, weight_in_fp32), residual


@triton.jit
def _rotated(x, xp, c, sn):
    """x * cos + its rotate-half partner xp * sn (sn = -sin for the first half, +sin
    for the second), each product rounded to x's dtype and the sum too: the roundings
    ``elementwise_ref.rope_qk`` takes. fp32 models need the launch's fp fusion off."""
    dt = x.dtype
    a = (x.to(tl.float32) * c).to(dt).to(tl.float32)
    return (a + (xp.to(tl.float32) * sn).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _rotate_heads(ptr, s_head, H, c, s, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, HALF):
    """Rotate one token's heads in place (dims [0, 2 * HALF)), each product rounded to
    the dtype as the reference rounds it; returns (mask, rotated first half, rotated
    second half), which ``rope_store.py`` also writes into the cache (``_rotated``)."""
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_R)
    mask = (heads < H)[:, None] & (offs < HALF)[None, :]
    p1 = ptr + heads.to(tl.int64)[:, None] * s_head + offs[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    a = _rotated(x1, x2, c[None, :], -s[None, :])
    b = _rotated(x2, x1, c[None, :], s[None, :])
    tl.store(p1, a, mask=mask)
    tl.store(p1 + HALF, b, mask=mask)
    return mask, a, b


@triton.jit
def _cos_sin(cos, sin, pos, t, sc0, HALF, BLOCK_R: tl.constexpr, dt):
    """(cos, sin) of token ``t``: its table rows rounded to the model dtype
    ``dt`` (as the reference casts them), in fp32; lanes past HALF read 0."""
    p = tl.load(pos + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_R)
    c = tl.load(cos + p * sc0 + offs, mask=offs < HALF, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin + p * sc0 + offs, mask=offs < HALF, other=0.0).to(dt).to(tl.float32)
    return c, s


@triton.jit
def _rope_kernel(
    q,
    k,
    cos,
    sin,
    pos,
    sq0,
    sq1,
    sk0,
    sk1,
    sc0,
    HQ,
    HK,
    HALF,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c, s = _cos_sin(cos, sin, pos, t, sc0, HALF, BLOCK_R, q.dtype.element_ty)
    _rotate_heads(q + t * sq0, sq1, HQ, c, s, BLOCK_HQ, BLOCK_R, HALF)
    _rotate_heads(k + t * sk0, sk1, HK, c, s, BLOCK_HK, BLOCK_R, HALF)


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope of q and k at ``positions``, in place (``elementwise_ref.rope_qk``).

    q: (T, Hq, D), k: (T, H, D), one float dtype, unit stride on D; cos, sin:
    (P, R/2) fp32, unit last stride; positions: (T,) int. Returns (q, k), the
    same tensors, their first R dims of every head rotated."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"rope_qk needs q (T, Hq, D) and k (T, H, D), got {tuple(q.shape)} {tuple(k.shape)}"
        )
    half = cos.shape[-1]
    if q.stride(2) != 1 or k.stride(2) != 1 or 2 * half > q.shape[2] or q.dtype != k.dtype:
        raise ValueError(
            f"rope_qk needs unit stride on D, one dtype and 2 * {half} rotated dims <= D; got "
            f"q {q.stride()} {q.dtype}, k {k.stride()} {k.dtype}, D {q.shape[2]}"
        )
    check_same_device(q, k, cos, sin, positions)
    if q.shape[0] == 0:
        return q, k
    _rope_kernel[(q.shape[0],)](
        q, k, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        q.shape[1], k.shape[1], half,
        BLOCK_HQ=next_pow2(q.shape[1]), BLOCK_HK=next_pow2(k.shape[1]),
        BLOCK_R=next_pow2(half), num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return q, k


@triton.jit
def _act_mul_kernel(gu, out, inter, s_gu, BLOCK: tl.constexpr, GELU: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dt = out.dtype.element_ty
    g = tl.load(gu + t * s_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + t * s_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        y = _gelu_tanh_mul_f32(g, u, dt)
    else:
        y = _silu_mul_f32(g, u, dt)
    tl.store(out + t * inter + offs, y, mask=mask)


@triton.jit
def _silu_mul_f32(g, u, dt: tl.constexpr):
    """silu(g) * u of fp32 gate/up values, in ``dt``: silu rounded to ``dt`` before
    the product, as ``F.silu(g) * u`` in that dtype (also the GEMV's fused input)."""
    a = tl.div_rn(g, 1.0 + tl.exp(-g)).to(dt).to(tl.float32)
    return (a * u).to(dt)


@triton.jit
def _gelu_tanh_mul_f32(g, u, dt: tl.constexpr):
    """gelu_tanh(g) * u of fp32 gate/up values, in ``dt``: the activation rounded to
    ``dt`` before the product, as ``F.gelu(g, approximate="tanh") * u``, in torch's
    form 0.5 g (1 + tanh y) (its rounding, cancellation included); tanh |y| as
    1 - 2 / (exp(2|y|) + 1), signed after (no overflow to NaN at either end)."""
    y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    t = 1.0 - tl.div_rn(2.0, tl.exp(2.0 * tl.abs(y)) + 1.0)
    th = tl.where(y >= 0, t, -t)
    a = (0.5 * g * (1.0 + th)).to(dt).to(tl.float32)
    return (a * u).to(dt)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2I) ``[gate | up]``, unit last stride -> new (T, I)
    ``silu(gate) * up`` in gate_up.dtype (``elementwise_ref.silu_mul``)."""
    return _act_mul(gate_up, "silu_mul", gelu=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2I) ``[gate | up]``, unit last stride -> new (T, I)
    ``gelu_tanh(gate) * up`` in gate_up.dtype (``elementwise_ref.gelu_tanh_mul``)."""
    return _act_mul(gate_up, "gelu_tanh_mul", gelu=True)


def _act_mul(gate_up: torch.Tensor, name: str, gelu: bool) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"{name} needs a (T, 2I) gate|up tensor with unit last stride, got "
            f"{tuple(gate_up.shape)} strides {gate_up.stride()}"
        )
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(SILU_BLOCK, next_pow2(inter))
    grid = (t, triton.cdiv(inter, block))
    _act_mul_kernel[grid](
        gate_up, out, inter, gate_up.stride(0), BLOCK=block, GELU=gelu, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out


_GATED_MODES = {"dtype_after_gate": 0, "fp32": 1, "dtype_before_gate": 2}


@triton.jit
def _gated_rms_norm_kernel(
    x, z, w, out, sx, sz, I, G, eps,
    NORM_BEFORE_GATE: tl.constexpr, MODE: tl.constexpr, SHARED_W: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1).to(tl.int64)
    dt = out.dtype.element_ty
    cols = grp * G + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < G
    h = tl.load(x + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    zf = tl.load(z + row * sz + cols, mask=mask, other=0.0).to(tl.float32)
    gate = zf * tl.sigmoid(zf)
    if not NORM_BEFORE_GATE:
        h = h * gate
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / G + eps)
    if SHARED_W:  # one (G,) weight for every group
        wv = tl.load(w + tl.arange(0, BLOCK), mask=mask, other=0.0)
    else:
        wv = tl.load(w + cols, mask=mask, other=0.0)
    if MODE == 2:  # w * h.to(dt) in dt, then times the fp32 gate
        y = (wv.to(tl.float32) * h.to(dt).to(tl.float32)).to(dt).to(tl.float32) * gate
    elif MODE == 1:  # fp32 weight, then the gate
        y = wv.to(tl.float32) * h
        if NORM_BEFORE_GATE:
            y = y * gate
    else:  # the gate, cast, then the weight in dt
        if NORM_BEFORE_GATE:
            h = h * gate
        y = wv.to(tl.float32) * h.to(dt).to(tl.float32)
    tl.store(out + row * I + cols, y.to(dt), mask=mask)


def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    group_size: int,
    norm_before_gate: bool = True,
    weight_mode: str = "dtype_after_gate",
) -> torch.Tensor:
    """Gated grouped RMSNorm (``elementwise_ref.gated_rms_norm``), one launch.

    x, z: (T, I), unit stride on I (rows may be strided); weight: (I,) or
    (group_size,). Returns a new contiguous (T, I) tensor in x.dtype."""
    t, dim = x.shape
    if z.shape != x.shape or weight.shape not in ((dim,), (group_size,)) or dim % group_size:
        raise ValueError(
            f"gated_rms_norm needs x, z of one (T, I) shape, weight (I,) or (group_size,) and "
            f"I a multiple "
            f"of group_size {group_size}; got {tuple(x.shape)}, {tuple(z.shape)}, "
            f"{tuple(weight.shape)}"
        )
    if weight_mode not in _GATED_MODES:
        raise ValueError(f"weight_mode must be one of {sorted(_GATED_MODES)}, got {weight_mode!r}")
    if weight_mode == "dtype_before_gate" and not norm_before_gate:
        raise ValueError("weight_mode 'dtype_before_gate' normalises before the gate")
    check_same_device(x, z, weight)
    x = x if x.stride(-1) == 1 else x.contiguous()
    z = z if z.stride(-1) == 1 else z.contiguous()
    out = torch.empty((t, dim), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = next_pow2(group_size)
    _gated_rms_norm_kernel[(t, dim // group_size)](
        x, z, weight, out, x.stride(0), z.stride(0), dim, group_size, float(eps),
        NORM_BEFORE_GATE=bool(norm_before_gate), MODE=_GATED_MODES[weight_mode],
        SHARED_W=weight.shape[0] != dim, BLOCK=block,
        num_warps=min(8, max(1, block // 256)), enable_fp_fusion=False,
    )  # fmt: skip
    return out


@triton.jit
def _norm_row(src, w, dst, N, eps, offset, W_FP32: tl.constexpr, BLOCK: tl.constexpr):
    """One row's RMSNorm, rounded as ``_rms_norm_kernel`` rounds it (no residual)."""
    dt = dst.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    h = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + cols, rms_normed(h, w, cols, mask, N, eps, offset, dt, W_FP32), mask=mask)


@triton.jit
def _qk_norm_kernel(
    q, k, wq, wk, oq, ok, HQ, HK, sq0, sq1, sk0, sk1, N, eps, offset,
    W_FP32: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0).to(tl.int64)
    t, j = p // (HQ + HK), p % (HQ + HK)
    if j < HQ:
        _norm_row(q + t * sq0 + j * sq1, wq, oq + (t * HQ + j) * N, N, eps, offset, W_FP32, BLOCK)
    else:
        j -= HQ
        _norm_row(k + t * sk0 + j * sk1, wk, ok + (t * HK + j) * N, N, eps, offset, W_FP32, BLOCK)


def qk_rms_norm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(q, q_weight), rms_norm(k, k_weight)) in one launch
    (``elementwise_ref.qk_rms_norm``): attention's per-head q and k norms.

    q: (T, Hq, D), k: (T, Hk, D), one dtype, unit stride on D (rows and heads may be
    strided: views of one GEMM output); weights (D,). Returns new contiguous tensors."""
    d = q.shape[-1]
    if q.dim() != 3 or k.dim() != 3 or k.shape[::2] != q.shape[::2] or k.dtype != q.dtype:
        raise ValueError(
            f"qk_rms_norm needs q (T, Hq, D) and k (T, Hk, D) of one dtype, got "
            f"{tuple(q.shape)} {q.dtype} and {tuple(k.shape)} {k.dtype}"
        )
    if q_weight.shape != (d,) or k_weight.shape != (d,) or d > MAX_ROW:
        raise ValueError(
            f"qk_rms_norm needs weights ({d},) with {d} <= {MAX_ROW}, got "
            f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)}"
        )
    check_same_device(q, k, q_weight, k_weight)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    oq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ok = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rows = q.shape[0] * (q.shape[1] + k.shape[1])
    if rows == 0:
        return oq, ok
    block = next_pow2(d)
    _qk_norm_kernel[(rows,)](
        q, k, q_weight, k_weight, oq, ok, q.shape[1], k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), d, float(eps), float(offset),
        W_FP32=bool(weight_in_fp32), BLOCK=block,
        num_warps=min(16, max(1, block // 256)), enable_fp_fusion=False,
    )  # fmt: skip
    return oq, ok
