"""MXFP4 experts in the order Hopper's MMA reads them (``kernels/moe/hopper.py``).

The checkpoint's layout (``mxfp4_ref``): blocks (E, N, K / 32, 16), byte j of group g
holding k = 32g + 2j (low nibble) and 32g + 2j + 1 (high). The Hopper kernel keeps the
weights packed and decodes them in registers, straight into wgmma's A operand, so each
thread must load exactly the values its A fragment holds, in one 16-byte load. Here the
same codes are re-packed, once at load, into that order (same bytes per weight: 4
bits a value, plus one e8m0 scale per 32):

    rows in slabs of 16, K in blocks of 64; one (slab, K block) is 512 bytes,
    lane l (0..31) owning bytes 16 l .. 16 l + 15. Byte i = i0 + 2 i1 + 4 i2 + 8 i3 of
    lane l = 4 lq + lr holds, at row 8 i1 + lq of the slab and k' = i0 + 2 lr + 8 i2 +
    16 i3 of the block, the code of k = k' in its low nibble and of k = 32 + k' in its
    high nibble (wgmma's A fragment of m64 x k16 for 16-bit types: a lane holds rows
    lq and lq + 8 and k pairs 2 lr, 2 lr + 1 and + 8; k' + 16 is the next k16 step)
    scales per (slab, K block): 32 bytes, lane quad lq's four at 4 lq .. 4 lq + 3:
    (row lq, group 0), (row lq, group 1), (row lq + 8, group 0), (row lq + 8, group 1)

So the low nibbles of a block are its first 32 k (one scale group) and the high nibbles
its last 32: the kernel dots each half with the activation columns that hold them.
"""

from __future__ import annotations

import torch

ROWS_PER_SLAB = 16
K_PER_BLOCK = 64


def check_fragment_shape(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless blocks (E, N, G, 16) / scales (E, N, G) uint8 with N a multiple
    of 16 and G even (K a multiple of 64)."""
    ok = blocks.dtype == torch.uint8 and scales.dtype == torch.uint8 and blocks.dim() == 4
    ok = ok and blocks.shape[-1] == 16 and blocks.shape[:3] == scales.shape
    if not ok or blocks.shape[1] % ROWS_PER_SLAB or blocks.shape[2] % 2:
        raise ValueError(
            "fragment packing needs MXFP4 blocks (E, N, K/32, 16) and scales (E, N, K/32), "
            f"uint8, with N a multiple of {ROWS_PER_SLAB} and K a multiple of {K_PER_BLOCK}; "
            f"got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}"
        )


def pack_fragments(
    blocks: torch.Tensor, scales: torch.Tensor, row_order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint MXFP4 (blocks (E, N, G, 16), scales (E, N, G)) -> (weights (E, N / 16,
    G / 2, 512) uint8, scales (E, N / 16, G / 2, 32) uint8) in the fragment order above.
    ``row_order`` (N,) picks the rows first (row r of the result is checkpoint row
    ``row_order[r]``), e.g. gpt-oss's interleaved gate/up rows as [gate | up]."""
    check_fragment_shape(blocks, scales)
    if row_order is not None:
        blocks, scales = blocks[:, row_order], scales[:, row_order]
    e, n, g, _ = blocks.shape
    s, kb = n // ROWS_PER_SLAB, g // 2
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(e, s, 16, kb, 64)
    byte = codes[..., :32] | (codes[..., 32:] << 4)  # (E, S, row, KB, k')
    # row = 8 i1 + lq; k' = 16 i3 + 8 i2 + 2 lr + i0 -> (E, S, KB, lq, lr, i3, i2, i1, i0)
    byte = byte.reshape(e, s, 2, 8, kb, 2, 2, 4, 2).permute(0, 1, 4, 3, 7, 5, 6, 2, 8)
    sc = scales.reshape(e, s, 2, 8, kb, 2).permute(0, 1, 4, 3, 2, 5)  # (.., lq, i1, group)
    return byte.reshape(e, s, kb, 512).contiguous(), sc.reshape(e, s, kb, 32).contiguous()


def gate_up_row_order(rows: int, interleaved: bool, device=None) -> torch.Tensor | None:
    """The row order putting gate rows [0, I) then up rows [I, 2I): None for "concat"
    checkpoints (already so), gate row 2j / up row 2j + 1 gathered for "interleaved"."""
    if not interleaved:
        return None
    half = torch.arange(rows // 2, device=device)
    return torch.cat((2 * half, 2 * half + 1))
