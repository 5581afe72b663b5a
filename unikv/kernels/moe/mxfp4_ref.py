"""Dequantise gpt-oss's MXFP4 expert weights (``*_blocks`` + ``*_scales``).

Released gpt-oss checkpoints store ``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj`` as MXFP4: ``<name>_blocks`` (E, rows, G, 16) uint8,
two e2m1 values per byte (low nibble first), and ``<name>_scales`` (E, rows, G)
uint8 exponents biased by 127, one per group of 32 values. Dequantised, a
tensor is (E, rows, G * 32), transposed to transformers' (E, G * 32, rows).
"""

from __future__ import annotations

import torch

FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)  # e2m1 code -> value


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks: (E, rows, G, 16) uint8; scales: (E, rows, G) uint8 -> fp32 (E, G * 32, rows)."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks must be uint8 (E, rows, G, 16) with scales (E, rows, G); got "
            f"{blocks.dtype} {tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2)  # (E, rows, G, 32)
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents[..., None].to(torch.float32))
    return values.flatten(-2).transpose(1, 2).contiguous()  # (E, G * 32, rows)
