"""Matrix-vector products for decode steps of one request: y = x @ W^T in Triton.

At one row (a single request's decode step) a linear layer is a weight stream: every
byte of W (N, K), contiguous along K, is read once and used once. Each program owns
BLOCK_N output features and walks K in BLOCK_K tiles, multiplying in fp32 and
reducing each row once at the end; rows of x are few (M <= 4), so x is re-read from
L2 per tile. The torch reference is ``torch.nn.functional.linear``.

    grid (cdiv(N, BLOCK_N),)   program n: y[:, n * BLOCK_N : (n + 1) * BLOCK_N]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels._interpret import patch_interpreter

patch_interpreter()  # run-time loop bounds under TRITON_INTERPRET=1 (no-op otherwise)

# (block_n, block_k, num_warps, num_stages); the benchmark sweeps these
CONFIG = (8, 512, 4, 3)
CANDIDATES = [
    (8, 512, 4, 3),
    (16, 256, 4, 3),
    (16, 512, 8, 3),
    (4, 1024, 4, 2),
    (8, 1024, 8, 2),
    (32, 256, 8, 3),
]
MAX_ROWS = 4


@triton.jit(do_not_specialize=["N"])
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, s_xm, s_wn, s_ym,
                 M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * s_wn
    for m in tl.static_range(M):
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
                x = tl.load(x_ptr + m * s_xm + ks)
            else:
                k_ok = ks < K
                w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_ptr + m * s_xm + ks, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + m * s_ym + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """x (M, K) with M <= MAX_ROWS, weight (N, K) contiguous along K, same dtype ->
    x @ weight^T (M, N) in x's dtype (fp32 products and sums, one rounding)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"gemv needs x (M, K) and weight (N, K); got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"gemv takes 1..{MAX_ROWS} rows with unit last strides; got x {tuple(x.shape)} "
            f"{x.stride()}, weight {weight.stride()}: use F.linear"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}: cast one")
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, warps, stages = config or CONFIG
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, n, k, x.stride(0), weight.stride(0), y.stride(0),
        M=m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, EVEN_K=k % block_k == 0,
        num_warps=warps,
    )  # fmt: skip
    return y
