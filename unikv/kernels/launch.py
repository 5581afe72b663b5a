"""Low-overhead launches of small Triton kernels on the allocator's per-step path.

``kernel[grid](...)`` runs Triton's binder, builds a specialisation key from
every argument, stringifies the options and looks the compiled kernel up: tens
of microseconds of host time for a kernel that runs for two. ``launcher(kernel)``
keeps the compiled kernel of each specialisation itself and launches it straight
through its driver entry point.

The specialisation key mirrors Triton's own: the values of constexpr keywords,
the dtype and 16-byte alignment of each tensor, ``None``-ness, and for each int
whether it is 1 or a multiple of 16 (Triton specialises on both unless told
not to). A call whose key is new (or any call under the interpreter, or with a
launch hook installed, e.g. a profiler) goes through ``kernel[grid]``.

Calling convention: positional runtime arguments in signature order, then every
remaining parameter (the constexprs) as keywords.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton import knobs
from triton.compiler import CompiledKernel

_current_device = torch.cuda.current_device
_raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


def _arg_key(arg: object) -> object:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0
    return type(arg)


class Launcher:
    """``launcher(grid, *args, **constexprs)``: launch ``kernel`` on the current stream."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.names = tuple(getattr(kernel, "arg_names", ()))
        self.compiled: dict[tuple, CompiledKernel] = {}

    def __call__(self, grid: tuple[int, ...], *args: object, **meta: object) -> None:
        key = (tuple(map(_arg_key, args)), tuple(meta.values()))
        compiled = self.compiled.get(key)
        if compiled is None or knobs.runtime.launch_enter_hook is not None:
            result = self.kernel[grid](*args, **meta)
            if isinstance(result, CompiledKernel):
                assert tuple(meta) == self.names[len(args) :], (
                    "launch: constexprs must follow the runtime arguments, as keywords in "
                    f"signature order {self.names[len(args):]}, got {tuple(meta)}"
                )
                self.compiled[key] = result
            return
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = _raw_stream(_current_device())
        compiled.run(
            grid[0],
            g1,
            g2,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
            *meta.values(),
        )


def launcher(kernel: object) -> Callable[..., None]:
    """A ``Launcher`` for a ``@triton.jit`` kernel (one per kernel, module level)."""
    return Launcher(kernel)
