"""Torch references of the decode step's fused elementwise ops (``elementwise.py``
holds the Triton kernels, with the same signatures).

These are the formulas unikv's models ran unfused, op for op, so the CPU path
stays token-exact against transformers:

- ``rms_norm``: fp32 statistics; ``weight_in_fp32=False`` casts the normalised
  row to the model dtype before the weight (Llama: ``w * h.to(dtype)``), True
  multiplies in fp32 and casts once (gpt-oss ``(w * h).to(dtype)``, Gemma and
  Qwen3.5 ``(h * (1 + w)).to(dtype)`` with ``offset=1``).
- ``add_rms_norm``: the residual add in the model dtype, then ``rms_norm`` of the sum.
- ``add_rms_norm_quant``: ``add_rms_norm`` (or ``rms_norm`` without a residual), then
  the FP8 linear's activation quantisation of the normed rows (``fp8_gemm_ref.
  quantize_act``, per row and group), its scales in the layout the GEMM reads.
- ``qk_rms_norm``: attention's q and k norms (Qwen3.5's gated attention), one op.
- ``rope_qk``: NeoX "rotate half" rope of the first ``rotary_dim`` dims of q and
  k, cos/sin read by position from fp32 tables and cast to the model dtype.
- ``silu_mul``: ``silu(gate) * up`` over a concatenated gate|up GEMM output.
- ``sigmoid_mul``, ``relu_square``: gated attention's output gate and NemotronH's
  relu2 (``activation.py`` holds their Triton kernels: ``ACTIVATION_OPS``).
- ``gated_rms_norm``: the recurrent mixers' output norm, RMSNorm over groups of
  the last dim gated by ``silu(z)`` (Gated DeltaNet, Mamba-2), in each family's
  order of casts (``weight_mode``).

Each returns new tensors and leaves its inputs unchanged; the Triton versions
may update some inputs in place (stated per op), so callers use only the
returned tensors.

The ops are fields of ``kernels.backend.KernelBackend`` (``ELEMENTWISE_OPS``, ``ACTIVATION_OPS``):
the model is built with the backend the engine chose, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from unikv.kernels.linear.fp8_gemm_ref import quantize_act

if TYPE_CHECKING:
    from unikv.kernels.backend import RowsPlan  # the linears take a step's plan, one path here


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dim.

    x: (..., N) float, any strides; weight: (N,) (the model dtype, or fp32).
    Returns a new (..., N) tensor in x.dtype: ``(h * (offset + w)).to(dtype)``
    when ``weight_in_fp32``, else ``(offset + w) * h.to(dtype)``, with
    ``h = x * rsqrt(mean(x**2) + eps)`` in fp32."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        w = weight.float() if offset == 0.0 else offset + weight.float()
        return (h * w).to(dtype)
    w = weight if offset == 0.0 else offset + weight
    return w * h.to(dtype)


GATED_WEIGHT_MODES = ("dtype_after_gate", "fp32", "dtype_before_gate")


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
    """RMSNorm over groups of ``group_size`` along the last dim, gated by silu(z).

    x, z: (T, I) (any strides), I a multiple of ``group_size``; weight: (I,), or
    (group_size,) shared by every group (Qwen3.5's per-head norm). In
    fp32, with gate = silu(z): h = x (times the gate first unless
    ``norm_before_gate``), normalised per group; then by ``weight_mode``:
    ``"dtype_after_gate"`` (Mamba-2, Zamba2): h * gate, cast, times w in x.dtype;
    ``"fp32"`` (Falcon-H1): w * h, times the gate, cast; ``"dtype_before_gate"``
    (Qwen3.5, Qwen3-Next): w * h.to(dtype) in x.dtype, times the gate, cast.
    Returns a new (T, I) tensor in x.dtype."""
    dtype, (t, dim) = x.dtype, x.shape
    shared = weight.shape[0] != dim
    if shared:  # Qwen3.5 lays the heads out as rows (T * H, Dv), as transformers does:
        x, z = x.reshape(-1, group_size), z.reshape(-1, group_size)  # the same fp32 ops
    h, gate = x.float(), torch.nn.functional.silu(z.float())
    if not norm_before_gate:
        h = h * gate
    h = h if shared else h.reshape(t, dim // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h if shared else h.view(t, dim)
    if weight_mode == "dtype_before_gate":
        out = ((weight * h.to(dtype)) * gate).to(dtype)
    else:
        if weight_mode == "fp32":
            h = weight * h
        if norm_before_gate:
            h = h * gate
        out = h.to(dtype) if weight_mode == "fp32" else weight * h.to(dtype)
    return out.reshape(t, dim)


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
    """Attention's per-head q and k norms: (rms_norm(q, q_weight), rms_norm(k,
    k_weight)) with one ``eps``, ``offset`` and rounding (``rms_norm``). q: (T, Hq, D),
    k: (T, Hk, D); weights (D,). Returns new (q, k)."""
    kw = {"offset": offset, "weight_in_fp32": weight_in_fp32}
    return rms_norm(q, q_weight, eps, **kw), rms_norm(k, k_weight, eps, **kw)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm of a residual block.

    x, residual: (T, N) in one float dtype; the sum is rounded to that dtype (as
    ``residual + x`` in the unfused model) and normalised from the rounded sum.
    Returns (normed (T, N), new residual (T, N))."""
    s = residual + x
    return rms_norm(s, weight, eps, offset=offset, weight_in_fp32=weight_in_fp32), s


def add_rms_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    group: int,
    m_major: bool = False,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xq, xs, x + residual): the pre-norm of a block whose GEMM is an FP8 linear's
    prefill variant, its input quantised here. The normed rows are ``add_rms_norm``'s
    (``rms_norm(x)`` with residual None, the residual out then x), rounded to the model
    dtype, then quantised per row and ``group`` columns (``fp8_gemm_ref.quantize_act``:
    the last group of a row whose width is not a multiple takes zeros past it): xq (T,
    N) float8_e4m3fn, xs (T, ceil(N / group)) fp32, M-major (strides (1, T)) with
    ``m_major``, else row-major."""
    kw = {"offset": offset, "weight_in_fp32": weight_in_fp32}
    if residual is None:
        h, residual = rms_norm(x, weight, eps, **kw), x
    else:
        h, residual = add_rms_norm(x, residual, weight, eps, **kw)
    xq, xs = quantize_act(h, group)
    if m_major:  # strides (1, T), as the kernel writes them
        xs = xs.new_empty(xs.shape[1], xs.shape[0]).t().copy_(xs)
    return xq, xs, residual


def sandwich_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    pre_weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's post-norm, the residual add and the next block's pre-norm (Gemma's
    sandwich norms): ``add_rms_norm(rms_norm(x, post_weight), residual, pre_weight)``,
    each rounded to the dtype as the unfused model rounds it.
    Returns (normed (T, N), new residual (T, N))."""
    kw = {"offset": offset, "weight_in_fp32": weight_in_fp32}
    return add_rms_norm(rms_norm(x, post_weight, eps, **kw), residual, pre_weight, eps, **kw)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rope of q and k at ``positions`` (NeoX layout).

    q: (T, Hq, D), k: (T, H, D), one float dtype, unit stride on D (rows and
    heads may be strided); cos, sin: (P, R/2) fp32 tables, R = rotary_dim <= D
    even; positions: (T,) int64 in [0, P). The first R dims of every head are
    rotated, ``[x1 c - x2 s, x2 c + x1 s]`` in the model dtype with c, s cast to
    it; dims R.. pass through. Returns new (q, k)."""
    c = cos[positions].to(q.dtype)[:, None, :]  # (T, 1, R/2)
    s = sin[positions].to(q.dtype)[:, None, :]
    r = 2 * cos.shape[-1]
    if r == q.shape[-1]:
        return _rotate(q, c, s), _rotate(k, c, s)
    q = torch.cat((_rotate(q[..., :r], c, s), q[..., r:]), dim=-1)
    k = torch.cat((_rotate(k[..., :r], c, s), k[..., r:]), dim=-1)
    return q, k


def rope_pairs(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's rope of interleaved pairs (x[2i], x[2i+1]) of q (T, Hq, R) and k
    (T, Hk, R) at ``positions`` (T,), from fp32 cos / sin (P, R/2). ``layout``
    "complex" (V2): rotated in fp32, kept interleaved, cast back; "interleave" (V3):
    rotated in the model dtype (c, s cast to it), written ``[evens' | odds']``.
    Returns new (q, k)."""
    c = cos[positions][:, None, :]  # (T, 1, R/2)
    s = sin[positions][:, None, :]
    if layout == "complex":
        return _pairs_fp32(q, c, s), _pairs_fp32(k, c, s)
    c, s = c.to(q.dtype), s.to(q.dtype)
    return _pairs_deinterleaved(q, c, s), _pairs_deinterleaved(k, c, s)


def _pairs_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) rotated in fp32, kept interleaved, cast back."""
    h = x.float()
    even, odd = h[..., 0::2], h[..., 1::2]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def _pairs_deinterleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x[2i], x[2i+1]) rotated in x's dtype, written [evens' | odds']."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2I) float, ``[gate | up]`` along the last dim (unit stride)
    -> new (T, I) ``silu(gate) * up`` in gate_up.dtype (silu rounded to the
    dtype before the product, as ``F.silu(g) * u``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2I) float, ``[gate | up]`` -> new (T, I) ``gelu_tanh(gate) * up``
    in gate_up.dtype (Gemma's MLP: transformers' ``gelu_pytorch_tanh``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def sigmoid_mul(
    x: torch.Tensor, gate: torch.Tensor, add: torch.Tensor | None = None
) -> torch.Tensor:
    """``x * sigmoid(gate)`` in x.dtype (the sigmoid rounded to the dtype before the
    product), plus ``add`` where given (the product rounded, then the sum): gated
    attention's output gate (Qwen3.5, Qwen3-Next), Qwen3-Next's shared-expert gate (its
    output added to the routed experts'). x: (T, N) or (T, H, D); gate and add: x's
    shape and dtype, any strides. Returns a new tensor of x's shape."""
    out = x * torch.sigmoid(gate)
    return out if add is None else add + out


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` in x.dtype (NemotronH's ``relu2``): x (T, N) -> new (T, N)."""
    return torch.relu(x).square()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           rows: RowsPlan | None = None):  # fmt: skip
    """The linear layer: ``F.linear`` (the Triton backend's GEMV reference)."""
    return torch.nn.functional.linear(x, weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    *, rows: RowsPlan | None = None):  # fmt: skip
    """SwiGLU then the down projection: ``F.linear(silu_mul(gate_up), weight, bias)``."""
    return torch.nn.functional.linear(silu_mul(gate_up), weight, bias)


def relu_square_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       *, rows: RowsPlan | None = None):  # fmt: skip
    """relu2 then the down projection: ``F.linear(relu_square(x), weight, bias)``."""
    return torch.nn.functional.linear(relu_square(x), weight, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                        eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        *, offset: float = 0.0, weight_in_fp32: bool = False,
                        rows: RowsPlan | None = None):  # fmt: skip
    """A pre-norm then a linear layer: (F.linear(rms_norm(x + residual)), x + residual);
    with residual None, (F.linear(rms_norm(x)), x) (a model's first layer)."""
    kw = {"offset": offset, "weight_in_fp32": weight_in_fp32}
    if residual is None:
        h, residual = rms_norm(x, norm_weight, eps, **kw), x
    else:
        h, residual = add_rms_norm(x, residual, norm_weight, eps, **kw)
    return torch.nn.functional.linear(h, weight, bias), residual


def add_rms_norm_linear_argmax(x: torch.Tensor, residual: torch.Tensor | None,
                               norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                               bias: torch.Tensor | None = None, *, offset: float = 0.0,
                               weight_in_fp32: bool = False, out: torch.Tensor | None = None,
                               rows: RowsPlan | None = None):  # fmt: skip
    """``add_rms_norm_linear``'s (logits, x + residual) and each row's greedy token:
    (logits, summed, logits.argmax(-1)), the tokens written into ``out`` when given."""
    y, summed = add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias, offset=offset,
                                    weight_in_fp32=weight_in_fp32)  # fmt: skip
    tokens = y.argmax(dim=-1)
    return y, summed, tokens if out is None else out.copy_(tokens)


def resolve_feedback(ids: torch.Tensor, feedback: torch.Tensor | None) -> torch.Tensor:
    """Token ids with each placeholder -(1 + lane) replaced by ``feedback[lane]``, the
    previous step's token of that lane (feedback None: ids as they are)."""
    if feedback is None:
        return ids
    return torch.where(ids < 0, feedback[(-1 - ids).clamp(min=0)], ids)


def embed_rms_norm_linear(ids: torch.Tensor, table: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          *, offset: float = 0.0, weight_in_fp32: bool = False,
                          feedback: torch.Tensor | None = None,
                          rows: RowsPlan | None = None):  # fmt: skip
    """A model's embedding, its first pre-norm and the linear layer after it:
    (F.linear(rms_norm(table[ids])), table[ids]), placeholder ids resolved from
    ``feedback`` first (``resolve_feedback``)."""
    h = torch.nn.functional.embedding(resolve_feedback(ids, feedback), table)
    return add_rms_norm_linear(h, None, norm_weight, eps, weight, bias, offset=offset,
                               weight_in_fp32=weight_in_fp32)  # fmt: skip
