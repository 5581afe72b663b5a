"""Rotary position embedding: inverse frequencies for the rope types of the
supported checkpoints (default, linear, llama3, yarn), as transformers computes
them, and the rotation itself (NeoX "rotate half" layout, applied to q and k in
one op: ``kernels/linear/ref.rope_qk`` or its Triton kernel).

The cos/sin table is computed once in fp32 for every position up to
``max_positions`` (``pos * inv_freq``, one product per element, as in
transformers), scaled by the rope type's attention factor.

Partial rotary (``partial_rotary_factor`` f < 1, Qwen3.5 / Qwen3-Next): as in
transformers, the frequencies are those of a head of ``int(head_dim * f)`` dims
and only the first ``int(head_dim * f)`` dims of each head are rotated; the
rest pass through.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from unikv.kernels.backend import model_ops


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, params: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_positions / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as transformers does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def rotary_dim(params: dict, head_dim: int) -> int:
    """Rotated dims of a head: ``int(head_dim * partial_rotary_factor)`` (transformers'
    rounding); ValueError unless it is even and in (0, head_dim] (rope rotates pairs of
    dims: an odd width has no rotate-half partner for its last dim)."""
    factor = params.get("partial_rotary_factor", 1.0)
    if factor == 1.0:
        if head_dim % 2:
            raise ValueError(
                f"head_dim is {head_dim} with full rotary: rope rotates pairs of dims, so the "
                "rotated width must be even; fix head_dim (or partial_rotary_factor) in "
                "config.json"
            )
        return head_dim
    dim = int(head_dim * factor)
    if not (0 < dim <= head_dim and dim % 2 == 0):
        raise ValueError(
            f"partial_rotary_factor {factor} on head_dim {head_dim} rotates {dim} dims; "
            "expected an even number in (0, head_dim]: fix rope_parameters"
        )
    return dim


def rope_inv_freq(params: dict, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq (rotary_dim/2,) fp32, attention scaling) for a standardised
    transformers ``rope_parameters`` dict (``rotary_dim`` = head_dim unless
    ``partial_rotary_factor`` < 1). Raises ValueError for other types."""
    rope_type = params.get("rope_type", "default")
    head_dim = rotary_dim(params, head_dim)  # the rotated width from here on
    base = float(params["rope_theta"])
    if rope_type == "default":
        return _default_inv_freq(base, head_dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(base, head_dim) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(_default_inv_freq(base, head_dim), params), 1.0
    if rope_type == "yarn":
        return _yarn(base, head_dim, params, max_positions)
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; unikv supports default, linear, llama3 and yarn"
    )


class Rotary(nn.Module):
    """Applies rope to q and k at given positions.

    Args:
        params: transformers' ``rope_parameters``.
        head_dim: the whole head; the first ``rotary_dim`` dims of it are
            rotated (all of them unless ``partial_rotary_factor`` < 1).
        max_positions: table length; positions must be below it.
    """

    def __init__(self, params: dict, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.params, self.head_dim, self.max_positions = params, head_dim, max_positions
        self.rotary_dim = rotary_dim(params, head_dim)
        rope_inv_freq(params, head_dim, max_positions)  # validate the rope type now
        self.ops = model_ops()  # the backend the model is built with (``building``)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if torch.empty(0).device.type != "meta":
            self.build(torch.empty(0).device)

    def build(self, device: torch.device) -> None:
        """(Re)compute the fp32 cos/sin tables (P, rotary_dim/2) on ``device``."""
        inv_freq, scaling = rope_inv_freq(self.params, self.head_dim, self.max_positions)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (P, rotary_dim/2)
        self.cos = (freqs.cos() * scaling).to(device)
        self.sin = (freqs.sin() * scaling).to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) int64; q: (T, Hq, D); k: (T, H, D) (unit stride on D)
        -> rotated (q, k), by ``self.ops.rope_qk``: the Triton op rotates in place,
        so callers use only the returned tensors."""
        return self.ops.rope_qk(q, k, self.cos, self.sin, positions)
