"""One launch for a decode step's lookups: every token sub-pool's block table
and the kernel id where each request's new token is written.

For request b (slot s, length L including the new token, at position L - 1)
and each target sub-pool k (v2p_k, blocks per page B_k, window W_k):

    table_k[b, j] = v2p_k[req_to_token[s, j*ps] // ps] * B_k   for live pages j
                    (j*ps < L and, when W_k > 0, (j+1)*ps > L - W_k), else 0
    loc_k[b]      = table_k[b, (L-1) // ps] * ps + (L-1) % ps

which is ``build_block_table`` (window W_k) plus ``translate_ids`` of the new
token's virtual id, fused: the page entries are looked up once and read from
``req_to_token`` rather than carried from the host. Tombstones, negative ids
and padding columns read 0 (the sink); ``v2p[-1]`` is never read.
``kernels/tables/ref.step_tables_ref`` is the torch reference, built from the unfused references.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.ids import kernel_row, page_entry, virtual_page
from unikv.kernels.runtime.launch import launcher
from unikv.kernels.tables.ref import StepTarget

MAX_TARGETS = 4
BLOCK_COLS = 128


@triton.jit
def _target(
    v2p, table, loc, window, row, col, ok, vpage, seq, here, pos, num_cols,
    PS: tl.constexpr, BPP: tl.constexpr,
):  # fmt: skip
    keep = ok & ((window <= 0) | ((col + 1) * PS > seq - window))
    phys = tl.load(v2p + vpage, mask=keep, other=-1)
    entry = page_entry(phys, BPP)
    tl.store(table + row + col, entry.to(tl.int32), mask=col < num_cols)
    new_entry = tl.sum(tl.where(here, entry, 0), axis=0)  # the new token's page
    has_new = tl.sum(here.to(tl.int32), axis=0) > 0
    tl.store(loc, kernel_row(new_entry, pos, PS).to(loc.dtype.element_ty), mask=has_new)


_STEP_ARGS = [
    "req_to_token", "req_slots", "seq_lens", "num_cols", "rt_stride", "out_stride",
    "v0", "v1", "v2", "v3", "t0", "t1", "t2", "t3", "l0", "l1", "l2", "l3", "w0", "w1", "w2", "w3",
]  # fmt: skip


@triton.jit(do_not_specialize=_STEP_ARGS, do_not_specialize_on_alignment=_STEP_ARGS)
def _step_tables_kernel(
    req_to_token, req_slots, seq_lens, num_cols, rt_stride, out_stride,
    v0, v1, v2, v3, t0, t1, t2, t3, l0, l1, l2, l3, w0, w1, w2, w3,
    NUM: tl.constexpr, PS: tl.constexpr,
    B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(req_slots + b).to(tl.int64)
    seq = tl.load(seq_lens + b)
    live = col * PS < seq
    virt = tl.load(req_to_token + slot * rt_stride + col.to(tl.int64) * PS, mask=live, other=-1)
    ok = live & (virt >= 0)
    vpage = virtual_page(virt, PS)  # -1 off the live prefix: page 0
    pos = seq - 1
    here = col == pos // PS
    row = b.to(tl.int64) * out_stride
    _target(v0, t0, l0 + b, w0, row, col, ok, vpage, seq, here, pos, num_cols, PS, B0)
    if NUM > 1:
        _target(v1, t1, l1 + b, w1, row, col, ok, vpage, seq, here, pos, num_cols, PS, B1)
    if NUM > 2:
        _target(v2, t2, l2 + b, w2, row, col, ok, vpage, seq, here, pos, num_cols, PS, B2)
    if NUM > 3:
        _target(v3, t3, l3 + b, w3, row, col, ok, vpage, seq, here, pos, num_cols, PS, B3)


_launch = launcher(_step_tables_kernel)


def step_tables(
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    targets: Sequence[StepTarget],
) -> None:
    """Fill every target's ``table[:B]`` and ``loc[:B]`` (module docstring).

    req_to_token: (R, max_ctx) int32; req_slots, seq_lens: (B,) int32 device
    tensors, seq_lens >= 1 and <= table columns * page_size (the caller checks);
    every table has the same shape and strides. One launch per 4 targets; no host sync."""
    prepare(req_to_token, page_size, targets)(req_slots, seq_lens)


def prepare(
    req_to_token: torch.Tensor, page_size: int, targets: Sequence[StepTarget]
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``step_tables`` with everything but the slots and lengths bound: returns
    ``run(req_slots, seq_lens)`` (int32 tensors), for callers that reuse buffers."""
    if req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token needs unit column stride, got {req_to_token.stride()}")
    if not targets:
        return lambda req_slots, seq_lens: None
    num_cols = targets[0].table.shape[1]
    head = (num_cols, req_to_token.stride(0), targets[0].table.stride(0))
    launches = []
    for base in range(0, len(targets), MAX_TARGETS):
        group = list(targets[base : base + MAX_TARGETS])
        pad = [None] * (MAX_TARGETS - len(group))
        bpp = [t.blocks_per_page for t in group] + [1] * len(pad)
        tail = (
            *[t.v2p for t in group], *pad, *[t.table for t in group], *pad,
            *[t.loc for t in group], *pad, *[t.window for t in group], *[0] * len(pad),
        )  # fmt: skip
        meta = {"NUM": len(group), "PS": page_size, "B0": bpp[0], "B1": bpp[1], "B2": bpp[2]}
        launches.append((tail, {**meta, "B3": bpp[3], "BLOCK": BLOCK_COLS}))
    blocks = triton.cdiv(num_cols, BLOCK_COLS)
    keys: list = [None] * len(launches)

    def run(req_slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
        bsz = req_slots.shape[0]
        if bsz == 0:
            return
        if req_slots.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise ValueError(
                f"req_slots and seq_lens must be int32, got {req_slots.dtype}, {seq_lens.dtype}"
            )
        for i, (tail, meta) in enumerate(launches):
            args = (req_to_token, req_slots, seq_lens, *head, *tail)
            if keys[i] is None:  # the dtypes are fixed from here on
                keys[i] = _launch.key(args, meta)
            _launch((bsz, blocks), *args, key=keys[i], **meta)

    return run
