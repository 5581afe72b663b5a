"""Compatibility shim for Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Triton 3.6's interpreter turns a scalar tensor into a Python int with
``int(array_of_shape_1)``, which numpy >= 2.3 rejects, so a loop like
``tl.range(lo, hi)`` with run-time bounds fails under the interpreter. This
patch (applied only when the interpreter is on) converts through ``.item()``.
Compiled kernels are untouched.
"""

from __future__ import annotations

import os


def patch_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from unikv.kernels._private import triton_interpreter

    interpreter = triton_interpreter()
    original = interpreter._patch_lang_tensor
    if getattr(original, "_unikv_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._unikv_patched = True
    interpreter._patch_lang_tensor = patched
