"""The signatures of the linear, elementwise and sampling ops, stated once
(``KernelBackend``'s fields are typed by these; ``kernels/attention/protocols.py`` says
how a variant may extend one, and ``tests/kernels/test_kernel_protocols.py`` checks it).

Shapes: T rows (tokens), N features; a linear's weight is (out, in), as ``F.linear``'s.
The rounding of each op is its torch reference's (``kernels/linear/ref.py``).

``rows``: the step's ``RowsPlan`` (``PlanRows``), made once per step by the step
planner: the variant its row count takes (the GEMV or cuBLAS, the FP8 GEMM's tiles);
None (a direct call) derives it from x's rows by the same rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from unikv.kernels.backend import RowsPlan
    from unikv.kernels.linear.fp8_gemm_ref import Fp8Quant


class RMSNorm(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        offset: float = 0.0,
        weight_in_fp32: bool = False,
    ) -> torch.Tensor:
        """RMSNorm over the last dim of x (..., N) by weight (N,) (+ offset), fp32
        statistics. Returns a new (..., N) tensor in x's dtype."""
        ...


class AddRMSNorm(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        offset: float = 0.0,
        weight_in_fp32: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual) for x, residual (T, N); the sum is
        rounded to their dtype first."""
        ...


class AddRMSNormQuant(Protocol):
    def __call__(
        self,
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
        """(xq, xs, x + residual) for x, residual (T, N) 16-bit (residual None: the norm
        of x, x returned): ``AddRMSNorm``'s normed rows quantised per row and ``group``
        columns to float8_e4m3fn xq (T, N) with fp32 scales xs (T, ceil(N / group)),
        M-major (strides (1, T)) where ``m_major``; ``group`` a power of two."""
        ...


class SandwichRMSNorm(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        post_weight: torch.Tensor,
        pre_weight: torch.Tensor,
        eps: float,
        *,
        offset: float = 0.0,
        weight_in_fp32: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + rms_norm(x, post_weight), pre_weight), that sum) for x,
        residual (T, N): a block's post-norm, the residual add and the next block's
        pre-norm; the post-norm's output and the sum are rounded to the dtype first."""
        ...


class RopeQK(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """NeoX rope of the first R dims of q (T, Hq, D) and k (T, H, D) at positions
        (T,) int64, from fp32 cos / sin (P, R / 2). Returns the rotated (q, k)."""
        ...


class RopePairs(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        layout: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's rope of interleaved pairs of q (T, Hq, R) and k (T, Hk, R) at
        positions (T,), from fp32 cos / sin (P, R / 2); layout "complex" (fp32,
        interleaved out) or "interleave" (model dtype, ``[evens' | odds']`` out).
        Returns new rotated (q, k)."""
        ...


class SiluMul(Protocol):
    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a (T, 2I) ``[gate | up]`` row. Returns (T, I)."""
        ...


class GeluTanhMul(Protocol):
    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` of a (T, 2I) ``[gate | up]`` row (Gemma's MLP).
        Returns (T, I)."""
        ...


class QKRMSNorm(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        *,
        offset: float = 0.0,
        weight_in_fp32: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q (T, Hq, D) by q_weight (D,) and of k (T, Hk, D) by
        k_weight, rounded as ``RMSNorm``. Returns new (q, k)."""
        ...


class SigmoidMul(Protocol):
    def __call__(
        self, x: torch.Tensor, gate: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x * sigmoid(gate)``, plus ``add`` where given: x (T, N) or (T, H, D); gate
        and add of x's shape and dtype; any strides (a strided view, a zero-stride
        broadcast). Returns a new contiguous tensor of x's shape."""
        ...


class ReluSquare(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(x) ** 2`` of x (T, N), any strides. Returns a new contiguous (T, N)."""
        ...


class GatedRMSNorm(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        z: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        group_size: int,
        norm_before_gate: bool = True,
        weight_mode: str = "dtype_after_gate",
    ) -> torch.Tensor:
        """RMSNorm over groups of ``group_size`` of x (T, I), gated by silu(z) (T, I);
        weight (I,) or (group_size,); ``weight_mode`` picks the families' rounding.
        Returns a new (T, I) tensor in x's dtype."""
        ...


class Argmax(Protocol):
    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) float logits -> (B,) int64, the first index of each row's maximum."""
        ...


class PlanRows(Protocol):
    def __call__(self, rows: int) -> RowsPlan:
        """The row-shaped ops' plan for a step whose ops see ``rows`` rows (host ints
        only): made once per step by the step planner, a CUDA graph's at its captured
        size; every linear, MoE and FP8 GEMM of the step takes it as ``rows``."""
        ...


class Linear(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        rows: RowsPlan | None = None,
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: x (T, K), weight (N, K) -> (T, N)."""
        ...


class ReluSquareLinear(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        rows: RowsPlan | None = None,
    ) -> torch.Tensor:
        """relu2 then the down projection: ``linear(relu_square(x), weight, bias)``."""
        ...


class SiluMulLinear(Protocol):
    def __call__(
        self,
        gate_up: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        rows: RowsPlan | None = None,
    ) -> torch.Tensor:
        """SwiGLU then the down projection: ``linear(silu_mul(gate_up), weight, bias)``."""
        ...


class AddRMSNormLinear(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        offset: float = 0.0,
        weight_in_fp32: bool = False,
        rows: RowsPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm then a linear: (linear(rms_norm(x + residual)), x + residual);
        with residual None, (linear(rms_norm(x)), x)."""
        ...


class EmbedRMSNormLinear(Protocol):
    def __call__(
        self,
        ids: torch.Tensor,
        table: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        offset: float = 0.0,
        weight_in_fp32: bool = False,
        feedback: torch.Tensor | None = None,
        rows: RowsPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding, the first pre-norm and the linear after it:
        (linear(rms_norm(table[ids])), table[ids]); ids (T,), placeholder ids
        resolved from ``feedback`` first."""
        ...


class AddRMSNormLinearArgmax(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        offset: float = 0.0,
        weight_in_fp32: bool = False,
        out: torch.Tensor | None = None,
        rows: RowsPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``AddRMSNormLinear``'s (logits, summed) and each row's greedy token
        (logits.argmax(-1), written into ``out`` when given)."""
        ...


class Fp8Linear(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale_inv: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        block: tuple[int, int],
        rows: RowsPlan | None = None,
        out_features: int | None = None,
    ) -> torch.Tensor:
        """x (..., K) @ W^T (+ bias) -> (..., N) in x's dtype, W the block-scaled FP8
        weight (N, K) float8_e4m3fn times ``scale_inv`` (ceil(N / bn), ceil(K / bk))
        fp32 per block ``(bn, bk)``. ``out_features``: the real rows of a weight held
        padded (``Fp8PaddedRows``; zero rows past them): the result is (..., out_features),
        possibly a view with the padded row stride."""
        ...


class Fp8ActQuant(Protocol):
    def __call__(
        self,
        m: int,
        n: int,
        k: int,
        block: tuple[int, int],
        dtype: torch.dtype,
        rows: RowsPlan | None = None,
    ) -> Fp8Quant | None:
        """How ``Fp8Linear`` of x (m, k) in ``dtype`` on a weight held as (n, k) in blocks
        ``block`` quantises x at the step's rows (``rows``; None: by m): the group and
        scale layout, or None (x multiplied as it is). Host values only."""
        ...


class Fp8LinearQuantized(Protocol):
    def __call__(
        self,
        xq: torch.Tensor,
        xs: torch.Tensor,
        weight: torch.Tensor,
        scale_inv: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        block: tuple[int, int],
        out_dtype: torch.dtype,
        rows: RowsPlan | None = None,
        out_features: int | None = None,
    ) -> torch.Tensor:
        """``Fp8Linear`` from x quantised as ``Fp8ActQuant`` said: xq (M, K)
        float8_e4m3fn, xs its fp32 scales (M, ceil(K / group)) -> (M, N) in ``out_dtype``
        (``out_features`` as ``Fp8Linear``'s)."""
        ...


class Fp8PaddedRows(Protocol):
    def __call__(self, n: int, k: int, block: tuple[int, int]) -> int:
        """The rows (>= n) to hold an FP8 weight (n, k) in blocks ``block`` in, so the
        backend's fastest prefill variant takes it (n: held as it is); asked once per
        layer at load."""
        ...


class MoEFp8(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w1: torch.Tensor,
        w1_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        *,
        block: tuple[int, int],
        activation: str = "silu",
        sum_dtype: torch.dtype | None = None,
        rows: RowsPlan | None = None,
    ) -> torch.Tensor:
        """The fused MoE over block-scaled FP8 experts: w1 (E, N1, d) float8_e4m3fn with
        ``w1_scale`` per block ``(bn, bk)`` of each of gate and up, w2 (E, d, I) with
        ``w2_scale``; x (T, d), topk (T, k) as in ``kernels/moe/protocols.MoE``.
        Returns (T, d) in x's dtype."""
        ...
