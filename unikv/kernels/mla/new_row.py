"""The step's new latent row inside MLA decode (``store_mla_attention``: the latent store
and the decode in one launch).

With split-KV, every head block (and V part) of the split holding a request's last key
reads the page of the new token's row, and no program may wait for another. So none
reads that row from memory: each takes it from the step's inputs, rounded to the cache
dtype as the store rounds it, in place of the key at position ``seq_len - 1`` (its load
is masked off), and one program, head block 0 (V part 0) of that split, writes it to
the pool at the token's write id. The output and the pool's bytes are those of
``store_mla`` then ``mla_attention``, provided the write id is the kernel id of the
request's position ``seq_len - 1`` (the step planner's contract).
"""

from __future__ import annotations

import triton
import triton.language as tl

from unikv.kernels.runtime.ids import kernel_offset


@triton.jit
def new_row(
    lat_new, rope_new, write_ids, tok, ln_st, rn_st, cache, c_sn, lo, hi, seq, cols0, cols1,
    offs_p, RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, first_program,
):  # fmt: skip
    """((position, c[cols0], c[cols1], k_rope) of token ``tok``'s row in the cache dtype,
    1 where keys ``[lo, hi)`` hold its position else 0); written to the pool at
    ``write_ids[tok]`` by the split that holds it where ``first_program``."""
    pos = seq - 1
    holds = (lo <= pos) & (pos < hi)
    dt = cache.dtype.element_ty
    m0, m1, mp = cols0 < RANK, cols1 < RANK, offs_p < ROPE
    src = lat_new + tok * ln_st
    c0 = tl.load(src + cols0, mask=m0, other=0.0).to(dt)
    c1 = tl.load(src + cols1, mask=m1, other=0.0).to(dt)
    kr = tl.load(rope_new + tok * rn_st + offs_p, mask=mp, other=0.0).to(dt)
    writer = holds & first_program
    dst = cache + kernel_offset(tl.load(write_ids + tok), PAGE_SIZE, PAGE_SIZE * c_sn, c_sn)
    tl.store(dst + cols0, c0, mask=m0 & writer)
    tl.store(dst + cols1, c1, mask=m1 & writer)
    tl.store(dst + RANK + offs_p, kr, mask=mp & writer)
    return (pos, c0, c1, kr), holds.to(tl.int32)
