"""Block-quantised FP8 checkpoints (DeepSeek-V3, MiMo-V2-Flash), dequantised at load.

Such a checkpoint's config.json holds ``quantization_config = {"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}``. A
quantised linear weight ``<prefix>.weight`` (..., out, in) is stored as
float8_e4m3fn next to ``<prefix>.weight_scale_inv`` (..., ceil(out / bn),
ceil(in / bk)), a float (fp32) scale per block of bn rows x bk columns; the real
weight is

    W[r, c] = float(Wq[r, c]) * scale_inv[r // bn, c // bk]     (edge blocks partial)

computed in fp32, then rounded to the model dtype. Modules left unquantised
(embeddings, norms, lm_head, router gates, ``modules_to_not_convert``) have no
``weight_scale_inv`` and load as they are: a weight is quantised exactly when its
scale is in the checkpoint, whatever its name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

FP8_METHOD = "fp8"
KNOWN_METHODS = ("fp8", "mxfp4")  # mxfp4: gpt-oss's experts (models/gpt_oss.py)
SCALE_SUFFIX = "_scale_inv"  # <prefix>.weight -> <prefix>.weight_scale_inv
FMTS = {"e4m3": torch.float8_e4m3fn}
ACTIVATION_SCHEMES = ("dynamic",)  # "static" needs per-tensor input scales
SCALE_FMTS = (None, "float", "ue8m0")  # both are multipliers stored as floats
CHUNK_BYTES = 1 << 26  # fp32 bytes of weight rows dequantised at once


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's FP8 block format: ``block`` = (bn rows of out, bk columns of in)."""

    block: tuple[int, int]
    dtype: torch.dtype = torch.float8_e4m3fn


def quantization_config(hf_config) -> dict | None:
    """The config's ``quantization_config`` as a dict (a transformers config object,
    its QuantizationConfig object or a config.json dict), None without one."""
    quant = (
        hf_config.get("quantization_config")
        if isinstance(hf_config, Mapping)
        else getattr(hf_config, "quantization_config", None)
    )
    if quant is None or isinstance(quant, Mapping):
        return dict(quant) if quant else None
    return quant.to_dict()


def _bad(field: str, expected: str, given, fix: str) -> ValueError:
    return ValueError(
        f"quantization_config {field}: expected {expected}, got {given!r}; "
        f"unikv loads DeepSeek-V3-style block FP8 ({fix})"
    )


def fp8_format(hf_config) -> Fp8Format | None:
    """The FP8 block format of a config with ``quant_method`` "fp8", None for an
    unquantised or MXFP4 one; ValueError for another method or an FP8 variant the
    loader cannot dequantise (fmt, activation scheme, block size)."""
    quant = quantization_config(hf_config)
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method not in KNOWN_METHODS:
        raise _bad("quant_method", f"one of {list(KNOWN_METHODS)}", method, "or MXFP4 for gpt-oss")
    if method != FP8_METHOD:
        return None
    fmt = quant.get("fmt") or "e4m3"
    if fmt not in FMTS:
        raise _bad("fmt", f"one of {sorted(FMTS)}", fmt, "float8_e4m3fn weights")
    scheme = str(quant.get("activation_scheme") or "dynamic").lower()
    if scheme not in ACTIVATION_SCHEMES:
        raise _bad(
            "activation_scheme", f"one of {list(ACTIVATION_SCHEMES)}", scheme, "no input scales"
        )
    if quant.get("scale_fmt") not in SCALE_FMTS:
        raise _bad("scale_fmt", f"one of {list(SCALE_FMTS)}", quant.get("scale_fmt"), "scales")
    block = quant.get("weight_block_size")
    ok = isinstance(block, (list, tuple)) and len(block) == 2
    if not ok or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise _bad(
            "weight_block_size",
            "two positive ints [rows, columns] (per-tensor FP8 is not supported)",
            block,
            "e.g. [128, 128]",
        )
    return Fp8Format(block=(block[0], block[1]), dtype=FMTS[fmt])


def fp8_pairs(
    index: Mapping[str, str], params: Mapping, fp8: Fp8Format | None
) -> dict[str, tuple[str, str]]:
    """Checkpoint weight name -> (weight name, scale name) for every quantised weight
    (every ``*.weight_scale_inv`` that is not a model parameter itself). ValueError
    for a scale without its weight, or scales in a checkpoint whose config is not FP8."""
    scales = sorted(n for n in index if n.endswith(SCALE_SUFFIX) and n not in params)
    if scales and fp8 is None:
        raise ValueError(
            f"checkpoint has FP8 block scales ({scales[0]}, {len(scales)} in all) but config.json "
            "has no quantization_config with quant_method 'fp8'; add the checkpoint's "
            "quantization_config (fmt, activation_scheme, weight_block_size)"
        )
    pairs = {}
    for scale in scales:
        weight = scale[: -len(SCALE_SUFFIX)]
        if weight not in index:
            raise ValueError(f"checkpoint has {scale} but no {weight}; the FP8 pair is broken")
        pairs[weight] = (weight, scale)
    return pairs


def check_unscaled(name: str, tensor: torch.Tensor, param_dtype: torch.dtype) -> None:
    """ValueError for an FP8 checkpoint tensor without a scale loaded into a
    parameter of another dtype (its values would be off by the missing scale)."""
    one_byte_float = tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1  # any fp8
    if one_byte_float and param_dtype != tensor.dtype:
        raise ValueError(
            f"tensor {name} is {tensor.dtype} but the checkpoint has no {name}{SCALE_SUFFIX}; "
            "an FP8 weight needs its block scales: the checkpoint is incomplete"
        )


def check_fp8_pair(
    weight: torch.Tensor, scale_inv: torch.Tensor, fp8: Fp8Format, name: str = "weight"
) -> None:
    """ValueError unless ``weight`` (..., out, in) has the format's dtype and
    ``scale_inv`` is float of shape (..., ceil(out / bn), ceil(in / bk))."""
    if weight.dtype != fp8.dtype or weight.dim() < 2:
        raise ValueError(
            f"{name}: an FP8 weight must be a {fp8.dtype} matrix (..., out, in), got "
            f"{weight.dtype} of shape {tuple(weight.shape)}; the checkpoint and its "
            "quantization_config fmt disagree"
        )
    (bn, bk), (rows, cols) = fp8.block, weight.shape[-2:]
    expected = (*weight.shape[:-2], math.ceil(rows / bn), math.ceil(cols / bk))
    if tuple(scale_inv.shape) != expected or not scale_inv.dtype.is_floating_point:
        raise ValueError(
            f"{name}{SCALE_SUFFIX}: expected a float scale of shape {expected} (weight "
            f"{tuple(weight.shape)} in blocks of {list(fp8.block)}), given {scale_inv.dtype} "
            f"{tuple(scale_inv.shape)}; the checkpoint's scales and weight_block_size disagree"
        )


def dequantize_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8: Fp8Format,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    *,
    name: str = "weight",
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """``weight`` (..., out, in) float8_e4m3fn and ``scale_inv`` (..., ceil(out / bn),
    ceil(in / bk)) float -> the real weight (..., out, in) in ``dtype`` on ``device``
    (default: the weight's). Rows are dequantised on the device in chunks of whole
    row blocks of at most ``chunk_bytes`` fp32 bytes (at least one row block), so
    no fp32 copy of the whole tensor exists at once."""
    check_fp8_pair(weight, scale_inv, fp8, name)
    device = weight.device if device is None else torch.device(device)
    (bn, bk), (rows, cols) = fp8.block, weight.shape[-2:]
    out = torch.empty(weight.shape, dtype=dtype, device=device)
    # (..., ceil(out / bn), in): each block's scale repeated over its bk columns
    col_scales = scale_inv.to(device, torch.float32).repeat_interleave(bk, dim=-1)[..., :cols]
    row_bytes = 4 * cols * math.prod(weight.shape[:-2])
    step = max(1, chunk_bytes // max(1, row_bytes * bn)) * bn  # whole row blocks
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        scales = col_scales[..., r0 // bn : math.ceil(r1 / bn), :].repeat_interleave(bn, dim=-2)
        chunk = weight[..., r0:r1, :].to(device).float()  # (..., r1 - r0, in) fp32
        out[..., r0:r1, :] = (chunk * scales[..., : r1 - r0, :]).to(dtype)
    return out
