"""Matrix-vector products for decode steps of few requests: y = x @ W^T (+ b) in Triton.

At one row (a single request's decode step) a linear layer is a weight stream: every
byte of W (N, K), contiguous along K, is read once and used once. Each program owns
BLOCK_N output features and walks K in BLOCK_K tiles, multiplying in fp32 and
reducing each row once at the end; rows of x are few (M <= MAX_ROWS), so x is
re-read from L2 per tile. With ACT 1 the input is a (M, 2K) ``[gate | up]`` row and the
kernel multiplies ``silu(gate) * up`` (``elementwise.silu_mul``'s rounding) as it
loads it: SwiGLU fused into the down projection; with ACT 2 it squares ``relu(x)``
(``activation.relu_square``'s rounding): NemotronH's relu2 MLP. With NORM the input is a pre-norm's
``x (+ residual)``: the residual add and RMSNorm happen in the same loads (``gemv``'s
``norm``), and program 0 writes the summed residual. On Hopper the kernel is launched
with programmatic dependent launch (``kernels/runtime/pdl.py``): it may start while the kernel
before it drains, waits before its first load, and lets the next kernel launch once
its K loop is done. (Loading the first one or two weight tiles before the wait lost on
the H200: one request's ITL 0.978 / 0.965 ms against 0.906, docs/perf.md; removed.)

    grid (cdiv(N, BLOCK_N),)   program n: y[:, n * BLOCK_N : (n + 1) * BLOCK_N]

With GATHER, x is an embedding table and row m is token ``ids[m]``'s: the model's
embedding inside its first GEMV's loads (program 0 writes the rows out, the residual).
With ARGMAX (the LM head of a greedy step), each program also packs its best logit
and index into row m's key (``argmax.pack_key``, one atomic max a program); one
launch after the GEMV unpacks the keys into tokens (``argmax.finish_keys``), in place
of the argmax's two launches over the logits.

``linear`` / ``silu_mul_linear`` / ``relu_square_linear`` / ``add_rms_norm_linear`` / ``embed_rms_norm_linear`` /
``add_rms_norm_linear_argmax`` are the backend ops: the kernel for 2-D 16-bit
inputs of at most ``ROUTE_ROWS`` rows (the rows the H200 measured it faster than
cuBLAS at, ``benchmarks/bench_gemv.py``; ``route_rows``), ``F.linear`` otherwise: the
step's ``RowsPlan`` (``rows``, made once per step by the step planner; a CUDA graph's
is its captured batch size's) says it by rows, the op checks the layer's dtypes and
strides; a call without a plan applies ``route_rows`` to x's rows. The torch references are
``elementwise_ref``'s ``linear``, ``silu_mul_linear`` and ``add_rms_norm_linear``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from unikv.env import FLAGS
from unikv.kernels.linear import argmax as greedy
from unikv.kernels.linear.activation import relu_square
from unikv.kernels.linear.elementwise import _silu_mul_f32, add_rms_norm, rms_norm, silu_mul
from unikv.kernels.linear.ref import resolve_feedback
from unikv.kernels.runtime import pdl
from unikv.kernels.runtime.interpret import patch_interpreter

if TYPE_CHECKING:
    from unikv.kernels.backend import RowsPlan

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
    # deeper pipelines and narrower row blocks (more bytes in flight per SM)
    (8, 512, 4, 4),
    (8, 512, 4, 5),
    (8, 256, 4, 6),
    (4, 512, 4, 4),
    (4, 1024, 4, 3),
    (4, 512, 2, 4),
    (2, 1024, 4, 3),
    (16, 512, 8, 4),
    # around the first chain sweep's picks (docs/perf.md)
    (4, 1024, 4, 4),
    (4, 2048, 4, 2),
    (4, 1024, 8, 3),
    (2, 2048, 4, 3),
    (16, 256, 4, 4),
    (16, 128, 4, 4),
    (32, 128, 4, 3),
    (16, 256, 8, 3),
    (8, 256, 4, 3),
    (8, 256, 2, 3),
]
# per weight shape (N, K): the config the decode chain ran fastest at (bench_gemv
# --chain-sweep); other shapes take CONFIG. UNIKV_GEMV_TABLE='{"N,K": [cfg], ...}'
# replaces it (fixed at import: the A/B switch).
TABLE: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (16384, 2048): (16, 256, 4, 3),  # Llama-3.2-1B's gate/up: chain 1.027x CONFIG's (docs/perf.md)
    (2048, 8192): (4, 1024, 4, 3),  # its down (SwiGLU inside): 1.035x
}


def _table_from(text: str) -> dict[tuple[int, int], tuple[int, int, int, int]]:
    """``UNIKV_GEMV_TABLE``'s JSON ({"N,K": [block_n, block_k, warps, stages]}) parsed."""
    try:
        table = {tuple(int(v) for v in key.split(",")): tuple(int(v) for v in cfg)
                 for key, cfg in json.loads(text).items()}  # fmt: skip
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(
            f'UNIKV_GEMV_TABLE must be JSON like {{"2048,8192": [4, 1024, 4, 3]}} (weight '
            f"N,K -> block_n, block_k, num_warps, num_stages); got {text!r}: {exc}"
        ) from None
    bad = {k: c for k, c in table.items() if len(k) != 2 or len(c) != 4}
    if bad:
        raise ValueError(f"UNIKV_GEMV_TABLE entries need 'N,K' keys and 4-int configs; got {bad}")
    return table


if FLAGS.gemv_table:
    TABLE = _table_from(FLAGS.gemv_table)
MAX_ROWS = 4
# the first layer's GEMV gathers its embedding rows itself (UNIKV_GEMV_EMBED=0: an
# embedding launch before it; fixed at import, the A/B switch)
EMBED = FLAGS.gemv_embed
ROUTE_ROWS = 1  # rows the backend ops send to the kernel (measured: bench_gemv)
DTYPES = (torch.bfloat16, torch.float16)


def route_rows(rows: int) -> bool:
    """The rule: ``rows`` rows take the GEMV (rows <= ``ROUTE_ROWS``), else cuBLAS.
    The step planner applies it once per step (``RowsPlan.gemv``)."""
    return rows <= ROUTE_ROWS


@triton.jit
def _summed(x_ptr, r_ptr, ks, k_ok, dt: tl.constexpr, HAS_RES: tl.constexpr):
    """x (+ the residual, rounded to dt) at columns ``ks``, in dt."""
    xv = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
    if HAS_RES:
        xv = (tl.load(r_ptr + ks, mask=k_ok, other=0.0).to(tl.float32) + xv.to(tl.float32)).to(dt)
    return xv


@triton.jit(do_not_specialize=["N"])
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, r_out_ptr, ids_ptr, keys_ptr,
                 feed_ptr, N, K, s_xm, s_wn, s_ym, s_rm, eps, offset,
                 M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ACT: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                 GATHER: tl.constexpr, FEED: tl.constexpr, ARGMAX: tl.constexpr,
                 PDL: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * s_wn
    dt = y_ptr.dtype.element_ty
    pdl.wait(PDL)
    for m in tl.static_range(M):
        x_row, r_row = x_ptr + m * s_xm, r_ptr + m * s_rm
        if GATHER:  # x is an embedding table: row m is token ids[m]'s
            tok = tl.load(ids_ptr + m).to(tl.int64)
            if FEED:  # a placeholder -(1 + lane): the previous step's token of that lane
                fed = tl.load(feed_ptr + tl.maximum(-1 - tok, 0)).to(tl.int64)
                tok = tl.where(tok < 0, fed, tok)
            x_row = x_ptr + tok * s_xm
        sq = tl.zeros((BLOCK_K,), tl.float32)  # NORM: the row's sum of squares
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
            else:
                w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:  # h * norm weight now, times 1 / rms after the loop: one pass
                hv = _summed(x_row, r_row, ks, k_ok, dt, HAS_RES)
                if HAS_RES or GATHER:  # program 0 writes the summed residual (or the row)
                    tl.store(r_out_ptr + m * s_rm + ks, hv, mask=k_ok & (pid == 0))
                x = hv.to(tl.float32)
                sq += x * x
                x *= tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32) + offset
            else:
                x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
            if ACT == 1:  # x is the gate half; the up half follows K columns later
                up = tl.load(x_row + K + ks, mask=k_ok, other=0.0).to(tl.float32)
                x = _silu_mul_f32(x, up, dt).to(tl.float32)
            elif ACT == 2:  # relu(x) ** 2, rounded to dt as ``activation.relu_square``
                x = tl.where(x < 0.0, 0.0, x)
                x = (x * x).to(dt).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        if m == M - 1:  # the weight stream is issued: the next kernel may launch
            pdl.trigger(PDL)
        y = tl.sum(acc, axis=1)
        if NORM:
            y *= tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * s_ym + rows, y.to(dt), mask=row_ok)
        if ARGMAX:  # this block's best logit (as stored) into row m's key
            v = tl.where(row_ok, y.to(dt).to(tl.float32), float("-inf"))
            tl.atomic_max(keys_ptr + m, greedy.pack_key(v, rows, N), sem="relaxed")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple | None = None, *, silu_mul_input: bool = False,
         relu_square_input: bool = False,
         norm: tuple | None = None, gather: torch.Tensor | None = None,
         argmax_out: torch.Tensor | None = None,
         feedback: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x (M, K) with M <= MAX_ROWS, weight (N, K) contiguous along K, bias (N,) or
    None, same dtype -> x @ weight^T + bias (M, N) in x's dtype (fp32 products and
    sums, one rounding). silu_mul_input: x is (M, 2K) ``[gate | up]`` and the product
    is of ``silu(gate) * up`` (rounded as ``elementwise.silu_mul`` rounds it).
    relu_square_input: x is (M, K) and the product is of ``relu(x) ** 2`` (rounded as
    ``activation.relu_square`` rounds it; NemotronH's MLP).
    norm: ``(residual or None, norm_weight, eps, offset)``: the product is of
    ``rms_norm(x + residual)`` and the call returns (y, x + residual) (x itself without
    a residual). The sum is rounded to the dtype as ``add_rms_norm`` rounds it; the
    norm is not: ``W (h * w) / rms(h)`` in fp32 in one pass over K (the statistics need
    the whole row, and a first pass over it would hold up the weight stream), so bf16
    outputs differ from norm-then-GEMM within bf16 rounding, whichever order the
    weight product takes there (``weight_in_fp32``). gather: (M,) integer token ids,
    with a norm without residual: x is an embedding table (V, K) and the rows are
    ``x[gather]`` (returned as the second output): the embedding inside the loads.
    argmax_out: an (M,) int64 tensor that receives each row's greedy token, the first
    index of its maximum over the rounded outputs (``argmax.argmax`` of y), from
    the programs' packed keys (``argmax.pack_key``) and one launch after.
    feedback: with gather, an int64 tensor of the previous step's tokens: an id
    -(1 + lane) (a placeholder) is token ``feedback[lane]`` (``resolve_feedback``)."""
    if gather is not None:
        if norm is None or norm[0] is not None or gather.dim() != 1 or gather.is_floating_point():
            raise ValueError(
                "gemv's gather needs (M,) integer token ids and a norm without residual (the "
                f"first layer's); got ids {tuple(gather.shape)} {gather.dtype}, norm "
                f"{'None' if norm is None else 'with a residual'}"
            )
        if feedback is not None and (feedback.dtype != torch.int64 or feedback.dim() != 1):
            raise ValueError(
                f"gemv's feedback must be 1-D int64 tokens; got {tuple(feedback.shape)} "
                f"{feedback.dtype}"
            )
        if not 1 <= gather.numel() <= MAX_ROWS:
            raise ValueError(f"gemv gathers 1..{MAX_ROWS} rows; got {gather.numel()} ids")
    k = weight.shape[-1]
    want_k = 2 * k if silu_mul_input else k
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != want_k:
        raise ValueError(
            f"gemv needs x (M, {'2K' if silu_mul_input else 'K'}) and weight (N, K); got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not (1 <= x.shape[0] <= MAX_ROWS or gather is not None) or x.stride(1) != 1 or (
            weight.stride(1) != 1):  # fmt: skip
        raise ValueError(
            f"gemv takes 1..{MAX_ROWS} rows with unit last strides; got x {tuple(x.shape)} "
            f"{x.stride()}, weight {weight.stride()}: use F.linear"
        )
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(
            f"gemv needs x, weight (and a ({weight.shape[0]},) bias) of one dtype; got "
            f"{x.dtype}, {weight.dtype}, bias {None if bias is None else tuple(bias.shape)}"
        )
    m, n = (x.shape[0] if gather is None else gather.numel()), weight.shape[0]
    residual, norm_w, eps, offset = norm or (None, None, 0.0, 0.0)
    if norm is not None and (norm_w.shape != (k,) or silu_mul_input or relu_square_input or (
            residual is not None and (residual.shape != x.shape or residual.stride(1) != 1))):  # fmt: skip
        raise ValueError(
            f"gemv's norm needs a ({k},) weight and a residual of x's shape {tuple(x.shape)} "
            f"with unit last stride (and no activation input); got {tuple(norm_w.shape)}, "
            f"{None if residual is None else tuple(residual.shape)}"
        )
    if argmax_out is not None and (argmax_out.shape != (m,) or argmax_out.dtype != torch.int64
                                   or argmax_out.device != x.device):  # fmt: skip
        raise ValueError(
            f"gemv's argmax_out must be ({m},) int64 on {x.device}; got "
            f"{tuple(argmax_out.shape)} {argmax_out.dtype} on {argmax_out.device}"
        )
    block_n, block_k, warps, stages = config or config_for(n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    keys = greedy.argmax_keys(m, x.device) if argmax_out is not None else weight
    if gather is not None:  # the gathered rows come back in a buffer of their own
        r_out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    else:
        r_out = torch.empty_like(x) if residual is not None else x
    r_in = residual if residual is not None else r_out
    on = pdl.enabled(x)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, r_in,
        norm_w if norm_w is not None else weight, r_out,
        gather if gather is not None else weight, keys,
        feedback if feedback is not None else weight, n, k, x.stride(0),
        weight.stride(0), y.stride(0), r_in.stride(0), float(eps), float(offset),
        M=m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, ACT=1 if silu_mul_input else 2 if relu_square_input else 0,
        NORM=norm is not None,
        HAS_RES=residual is not None, GATHER=gather is not None,
        FEED=gather is not None and feedback is not None, ARGMAX=argmax_out is not None,
        PDL=on, num_warps=warps, **pdl.launch_options(on),
    )  # fmt: skip
    if argmax_out is not None:
        greedy.finish_keys(keys, argmax_out)
    return y if norm is None else (y, r_out)


def config_for(n: int, k: int) -> tuple[int, int, int, int]:
    """The GEMV's config for an (N, K) weight: its ``TABLE`` entry, else ``CONFIG``."""
    return TABLE.get((n, k), CONFIG)


def _routes(x: torch.Tensor, weight: torch.Tensor, plan: RowsPlan | None,
            num_rows: int | None = None) -> bool:  # fmt: skip
    """Whether the backend ops take the kernel for the 2-D x: the step's ``plan`` says
    so by rows (None: ``route_rows`` of ``num_rows``, else of x's) and the layer's
    dtypes and strides allow it (host ints and dtypes only)."""
    if x.dim() != 2:
        return False
    by_rows = (
        route_rows(x.shape[0] if num_rows is None else num_rows) if plan is None else plan.gemv
    )
    return (by_rows and x.dtype in DTYPES and x.dtype == weight.dtype and x.stride(-1) == 1
            and weight.stride(-1) == 1)  # fmt: skip


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           rows: RowsPlan | None = None):  # fmt: skip
    """``F.linear(x, weight, bias)``: the GEMV for few 16-bit rows, else cuBLAS."""
    if _routes(x, weight, rows) and x.shape[0] > 0:
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                        eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        *, offset: float = 0.0, weight_in_fp32: bool = False,
                        rows: RowsPlan | None = None):  # fmt: skip
    """(F.linear(rms_norm(x + residual)), x + residual) (residual None: of x, and x):
    the norm inside the GEMV's loads for few 16-bit rows, else the two kernels."""
    if (
        _routes(x, weight, rows)
        and x.shape[0] > 0
        and (residual is None or residual.stride(-1) == 1)
    ):
        return gemv(x, weight, bias, norm=(residual, norm_weight, eps, offset))
    kw = {"offset": offset, "weight_in_fp32": weight_in_fp32}
    if residual is None:
        return F.linear(rms_norm(x, norm_weight, eps, **kw), weight, bias), x
    h, residual = add_rms_norm(x, residual, norm_weight, eps, **kw)
    return F.linear(h, weight, bias), residual


def add_rms_norm_linear_argmax(x: torch.Tensor, residual: torch.Tensor | None,
                               norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                               bias: torch.Tensor | None = None, *, offset: float = 0.0,
                               weight_in_fp32: bool = False, out: torch.Tensor | None = None,
                               rows: RowsPlan | None = None):  # fmt: skip
    """``add_rms_norm_linear``'s (logits, x + residual) and each row's greedy token
    (the first index of its maximum, int64; written into ``out`` when given): the
    argmax inside the GEMV's epilogue (``ARGMAX``) where the GEMV runs (one request's
    LM head), else ``argmax.argmax`` after the product."""
    if (
        _routes(x, weight, rows)
        and x.shape[0] > 0
        and (residual is None or residual.stride(-1) == 1)
    ):
        tokens = out if out is not None else torch.empty(x.shape[0], dtype=torch.int64,
                                                          device=x.device)  # fmt: skip
        y, summed = gemv(x, weight, bias, norm=(residual, norm_weight, eps, offset),
                         argmax_out=tokens)  # fmt: skip
        return y, summed, tokens
    y, summed = add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias, offset=offset,
                                    weight_in_fp32=weight_in_fp32, rows=rows)  # fmt: skip
    tokens = greedy.argmax(y)
    return y, summed, tokens if out is None else out.copy_(tokens)


def embed_rms_norm_linear(ids: torch.Tensor, table: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          *, offset: float = 0.0, weight_in_fp32: bool = False,
                          feedback: torch.Tensor | None = None,
                          rows: RowsPlan | None = None):  # fmt: skip
    """(F.linear(rms_norm(table[ids])), table[ids]): a model's embedding, its first
    pre-norm and the GEMM after it, the gather inside the GEMV's loads for few 16-bit
    rows (``EMBED``), else the embedding then ``add_rms_norm_linear``. feedback: the
    previous step's tokens, which placeholder ids -(1 + lane) stand for
    (``elementwise_ref.resolve_feedback``; inside the gather where it runs)."""
    if EMBED and ids.dim() == 1 and ids.numel() > 0 and _routes(table, weight, rows, ids.numel()):
        return gemv(table, weight, bias, norm=(None, norm_weight, eps, offset), gather=ids,
                    feedback=feedback)  # fmt: skip
    h = F.embedding(resolve_feedback(ids, feedback), table)
    return add_rms_norm_linear(h, None, norm_weight, eps, weight, bias, offset=offset,
                               weight_in_fp32=weight_in_fp32, rows=rows)  # fmt: skip


def relu_square_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       *, rows: RowsPlan | None = None):  # fmt: skip
    """``F.linear(relu_square(x), weight, bias)``, relu2 fused into the GEMV's loads for
    few 16-bit rows (NemotronH's MLP down projection)."""
    if _routes(x, weight, rows) and x.shape[0] > 0:
        return gemv(x, weight, bias, relu_square_input=True)
    return F.linear(relu_square(x), weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    *, rows: RowsPlan | None = None):  # fmt: skip
    """``F.linear(silu_mul(gate_up), weight, bias)``, SwiGLU fused into the GEMV's
    loads for few 16-bit rows."""
    if _routes(gate_up, weight, rows) and gate_up.shape[0] > 0:
        return gemv(gate_up, weight, bias, silu_mul_input=True)
    return F.linear(silu_mul(gate_up), weight, bias)
