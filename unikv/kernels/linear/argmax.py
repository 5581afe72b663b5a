"""Triton greedy sampling: the argmax of each row of the step's logits.

``torch.argmax`` over a (B, V) row runs one program a row: at B = 1 that is one
SM reading 128k logits (37 us on the H200 for Llama-3's vocabulary, against 0.1
us of bytes). Here each row is cut into S chunks (S from B and V only, so a
CUDA graph may hold it), one program a chunk keeps the best (value, first
index) of each lane, and a second launch picks, per row, the largest value and
the smallest index holding it: the first maximal index, as ``torch.argmax``
returns. With S == 1 the first launch writes the result itself.

A GEMV that computes the logits can take the first launch's place
(``gemv``'s ``argmax_out``, one request's LM head): each of its programs packs
its best (value, first index) into one int64 ``pack_key`` orders as the pair,
(value, then the smaller index), and ``atomic_max``-es it into a per-row key;
``finish_keys`` unpacks the keys into the tokens and resets them. The keys live
in ``argmax_keys``'s buffer, one per (device, rows), at ``KEY_INIT`` between
calls; calls on one device run on one stream (the engine's), never two at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime import pdl
from unikv.kernels.runtime.checks import device_sms

BLOCK = 1024  # logits a program reads per iteration
PROGRAMS_PER_SM = 8  # split rows until about this many programs per SM
MERGE_BLOCK = 128  # chunk results the merge reads per iteration
KEY_INIT = torch.iinfo(torch.int64).min  # below every packed key
LOW = tl.constexpr(0xFFFFFFFF)  # the packed key's low half: LOW - index


@triton.jit
def pack_key(v, idx, n):
    """The best (value, first index) of a block, packed into one int64 whose signed
    order is the pair's: the value's (-0.0 taken as +0.0), then the smaller index.
    v: fp32 candidates (-inf off the block), idx: their int32 indices, n: the
    vocabulary (a block without a lane equal to its maximum, a NaN, keeps n - 1)."""
    peak = tl.max(v, axis=0)
    first = tl.min(tl.where(v == peak, idx, n - 1), axis=0)
    peak = tl.where(peak == 0.0, 0.0, peak)
    bits = peak.to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed order of the floats
    return (order.to(tl.int64) << 32) + (LOW - first.to(tl.int64))


@triton.jit(do_not_specialize=["rows", "init"])
def _argmax_finish_kernel(keys, out, rows, init, BLOCK: tl.constexpr, PDL: tl.constexpr):
    i = tl.arange(0, BLOCK)
    mask = i < rows
    pdl.wait(PDL)
    key = tl.load(keys + i, mask=mask, other=0)
    tl.store(out + i, LOW - (key & LOW), mask=mask)
    tl.store(keys + i, tl.zeros([BLOCK], tl.int64) + init, mask=mask)


_KEYS: dict[tuple[torch.device, int], torch.Tensor] = {}


def argmax_keys(rows: int, device: torch.device) -> torch.Tensor:
    """The (rows,) int64 key buffer of fused argmaxes on ``device``, at ``KEY_INIT``
    (made on first use, which must not be inside a CUDA graph capture: warm up first)."""
    key = (torch.device(device), rows)
    keys = _KEYS.get(key)
    if keys is None:
        if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the fused argmax's key buffer for {rows} rows is made on first use, "
                "outside a CUDA graph capture; run the step once before capturing it"
            )
        keys = _KEYS[key] = torch.full((rows,), KEY_INIT, dtype=torch.int64, device=device)
    return keys


def finish_keys(keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (rows,) int64 = the indices packed in ``keys`` (``pack_key``), and the keys
    reset to ``KEY_INIT``: one launch after the kernel that filled them."""
    on = pdl.enabled(keys)
    _argmax_finish_kernel[(1,)](
        keys, out, keys.numel(), KEY_INIT, BLOCK=max(16, triton.next_power_of_2(keys.numel())),
        PDL=on, num_warps=1, **pdl.launch_options(on),
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["s_row", "V", "chunk", "splits"])  # one compile per DIRECT
def _argmax_chunk_kernel(x, s_row, V, chunk, best_v, best_i, out, splits,
                         DIRECT: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    pdl.wait(PDL)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, V)
    lanes = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    arg = lo + lanes  # a lane that sees only -inf keeps its first index
    for start in range(lo, hi, BLOCK):
        idx = start + lanes
        val = tl.load(x + row * s_row + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
        better = val > top  # strict: each lane keeps its first maximum
        top = tl.where(better, val, top)
        arg = tl.where(better, idx, arg)
    pdl.trigger(PDL)
    peak = tl.max(top, axis=0)
    first = tl.min(tl.where(top == peak, arg, V), axis=0)
    if DIRECT:
        tl.store(out + row, first.to(tl.int64))
    else:
        tl.store(best_v + row * splits + part, peak)
        tl.store(best_i + row * splits + part, first)


@triton.jit(do_not_specialize=["V", "splits"])
def _argmax_merge_kernel(best_v, best_i, out, V, splits, BLOCK_S: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pdl.wait(PDL)
    lanes = tl.arange(0, BLOCK_S)
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    arg = tl.full([BLOCK_S], V, tl.int32)
    for s0 in range(0, splits, BLOCK_S):  # chunks in index order: strict keeps the first
        offs = s0 + lanes
        mask = offs < splits
        val = tl.load(best_v + row * splits + offs, mask=mask, other=float("-inf"))
        idx = tl.load(best_i + row * splits + offs, mask=mask, other=V)
        better = (val > top) | ((val == top) & (idx < arg))
        top = tl.where(better, val, top)
        arg = tl.where(better, idx, arg)
    peak = tl.max(top, axis=0)
    first = tl.min(tl.where(top == peak, arg, V), axis=0)
    tl.store(out + row, first.to(tl.int64))


def choose_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Chunks per row: about PROGRAMS_PER_SM programs per SM, chunks >= BLOCK."""
    want = triton.cdiv(PROGRAMS_PER_SM * device_sms(device), max(rows, 1))
    return max(1, min(want, triton.cdiv(vocab, BLOCK)))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: (B, V) float, unit stride on V -> (B,) int64, the first index of
    each row's maximum (``logits.argmax(dim=-1)``; rows holding NaN are not
    specified)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"argmax needs (B, V) float logits with unit stride on V, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0 or vocab == 0:
        if vocab == 0 and rows:
            raise ValueError("argmax over an empty vocabulary (V = 0)")
        return out
    splits = choose_splits(rows, vocab, logits.device)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), BLOCK) * BLOCK
    splits = triton.cdiv(vocab, chunk)  # no empty chunk
    best_v = torch.empty(rows * splits if splits > 1 else 1, dtype=torch.float32,
                         device=logits.device)  # fmt: skip
    best_i = torch.empty(best_v.shape, dtype=torch.int32, device=logits.device)
    on = pdl.enabled(logits)
    _argmax_chunk_kernel[(rows, splits)](
        logits, logits.stride(0), vocab, chunk, best_v, best_i, out,
        splits, DIRECT=splits == 1, BLOCK=BLOCK, PDL=on, num_warps=4, **pdl.launch_options(on),
    )  # fmt: skip
    if splits > 1:
        _argmax_merge_kernel[(rows,)](
            best_v, best_i, out, vocab, splits, BLOCK_S=MERGE_BLOCK, PDL=on, num_warps=1,
            **pdl.launch_options(on),
        )  # fmt: skip
    return out
