"""Triton alignment of a fused MoE's assignments by expert: one launch, one program.

The output is ``moe.align_by_expert_torch``'s, element for element: sorted_ids
(num_blocks * BLOCK_M,) int32 holds the assignment ids ``t * k + j`` grouped by
expert in ascending id order within an expert (a stable sort), each expert's run
padded to BLOCK_M with the sentinel M = T * k; block_experts (num_blocks,) int32 is
the expert of each BLOCK_M rows, -1 past the last used block.

The torch form is about twenty launches a layer (a stable radix sort, scatters,
scans, searchsorted): 0.25 of gpt-oss's 2.86 ms decode step at B 256 on the H200
(a breakdown, docs/perf.md). Here one program walks the assignments twice, CHUNK at a
time, over a (CHUNK, E) one-hot of their experts:

    pass 1  counts per expert -> padded run lengths -> run starts (a cumsum over E);
            sorted_ids filled with M, block_experts from the run ends
    pass 2  each assignment's rank among earlier ones of its expert (a cumsum down
            the one-hot, plus the counts of earlier chunks) -> its slot

For small M x E only (``moe.ALIGN_KERNEL_MAX_WORK``; prefill chunks and many-expert
models at large batches keep the torch form, where one program would walk too far).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unikv.kernels.runtime.checks import next_pow2

ONE_HOT_ELEMS = 8192  # CHUNK x BLOCK_E of one pass-2 step


@triton.jit(do_not_specialize=["m", "num_blocks"])  # one compile for every T
def _align_kernel(ids_ptr, sorted_ptr, experts_ptr, m, num_experts, num_blocks,
                  BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    offs_e = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, m, CHUNK):
        e = tl.load(ids_ptr + c0 + lanes, mask=c0 + lanes < m, other=BLOCK_E).to(tl.int32)
        counts += tl.sum((e[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    for s0 in range(0, num_blocks * BLOCK_M, CHUNK):  # every slot: the sentinel first
        slot = s0 + lanes
        tl.store(sorted_ptr + slot, tl.full([CHUNK], 0, tl.int32) + m,
                 mask=slot < num_blocks * BLOCK_M)  # fmt: skip
    live_e = offs_e < num_experts
    for b0 in range(0, num_blocks, CHUNK):  # searchsorted(ends, block start, right=True)
        blk = b0 + lanes
        before = (ends[None, :] <= (blk * BLOCK_M)[:, None]) & live_e[None, :]
        expert = tl.sum(before.to(tl.int32), axis=1)
        tl.store(experts_ptr + blk, tl.where(expert < num_experts, expert, -1),
                 mask=blk < num_blocks)  # fmt: skip
    tl.debug_barrier()  # the sentinel stores land before the slots overwrite them
    seen = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, m, CHUNK):
        idx = c0 + lanes
        e = tl.load(ids_ptr + idx, mask=idx < m, other=BLOCK_E).to(tl.int32)
        hot = (e[:, None] == offs_e[None, :]).to(tl.int32)  # (CHUNK, BLOCK_E)
        before = tl.cumsum(hot, axis=0) - hot  # earlier rows of the chunk, per expert
        slot = tl.sum(hot * (before + (starts + seen)[None, :]), axis=1)
        tl.store(sorted_ptr + slot, idx, mask=idx < m)
        seen += tl.sum(hot, axis=0)


def align_by_expert_kernel(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_experts) of ``moe.align_by_expert_torch`` for topk_ids (T, k)
    in [0, num_experts), in one launch; num_blocks: the host bound on the blocks."""
    flat = topk_ids.reshape(-1)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    experts = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    block_e = next_pow2(max(num_experts, 2))
    chunk = max(16, ONE_HOT_ELEMS // block_e)
    _align_kernel[(1,)](
        flat, sorted_ids, experts, flat.numel(), num_experts, num_blocks,
        BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=chunk, num_warps=8,
    )  # fmt: skip
    return sorted_ids, experts
