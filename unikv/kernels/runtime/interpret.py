"""Compatibility shim for Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Triton 3.6's interpreter turns a scalar tensor into a Python int with
``int(array_of_shape_1)``, which numpy >= 2.3 rejects, so a loop like
``tl.range(lo, hi)`` with run-time bounds fails under the interpreter. This
patch (applied only when the interpreter is on) converts through ``.item()``.
The interpreter also casts fp32 to bf16 by truncation where GPUs round to
nearest even (``cvt.rn``), and rounds fp32 to float8_e4m3fn wrongly where the
mantissa carries into the exponent (126.4 -> 64); ``_round_bf16`` makes both round
to nearest even, so interpreter tests see the GPU's rounding. Its ``tl.dot`` multiplies bf16 operands' raw uint16 bit
patterns as integers; ``_bf16_dot`` widens them to fp32 first (exact), as the GPU's
bf16 MMA does. Compiled kernels are untouched.
"""

from __future__ import annotations

import numpy as np

from unikv.env import FLAGS


def patch_interpreter() -> None:
    if not FLAGS.triton_interpret:
        return
    from unikv.kernels.runtime.private import triton_interpreter

    interpreter = triton_interpreter()
    original = interpreter._patch_lang_tensor
    if getattr(original, "_unikv_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._unikv_patched = True
    interpreter._patch_lang_tensor = patched
    _round_bf16(interpreter)
    _bf16_dot(interpreter)


def _fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), rounded to nearest even; NaN stays NaN."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _fp32_to_e4m3_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> float8_e4m3fn bit patterns (uint8), rounded to nearest even (torch's
    conversion; the interpreter's own loses a binade when the mantissa rounds up)."""
    import torch

    return (
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        .to(torch.float8_e4m3fn)
        .view(torch.uint8)
        .numpy()
    )


def _round_bf16(interpreter) -> None:
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return interpreter.TensorHandle(_fp32_to_e4m3_bits(src.data), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _bf16_dot(interpreter) -> None:
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            a, b = (
                interpreter.TensorHandle(_bf16_bits_to_fp32(t.data), tl.float32)
                if t.dtype.scalar == tl.bfloat16
                else t
                for t in (a, b)
            )
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
