"""Low-overhead launches of small Triton kernels on the allocator's per-step path.

``kernel[grid](...)`` runs Triton's binder, builds a specialisation key from
every argument, stringifies the options and looks the compiled kernel up: on a
slow host, tens of microseconds for a kernel that runs for two. ``launcher``
keeps the compiled kernel of each specialisation itself and launches it through
its driver entry point.

The key mirrors Triton's specialisation: the constexpr keywords, each tensor's
dtype (``None`` arguments are constexprs), and, for parameters the kernel lets
Triton specialise, whether an int is 1 or a multiple of 16 and whether a
pointer is 16-byte aligned. Kernels on the hot path list every runtime
parameter in ``do_not_specialize`` and ``do_not_specialize_on_alignment`` so
their key is the dtypes alone. A call with a new key (or any call under the
interpreter, or while a launch hook such as a profiler is installed) goes
through ``kernel[grid]``.

Calling convention: positional runtime arguments in signature order, then every
remaining parameter (the constexprs) as keywords, in signature order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton import knobs
from triton.compiler import CompiledKernel

from unikv.kernels.runtime.private import current_raw_stream

try:
    from triton.knobs import HookChain
except ImportError:  # older Triton: hooks are plain callables or None
    HookChain = ()

_current_device = torch.cuda.current_device
_raw_stream = current_raw_stream


def _full_key(arg: object) -> object:
    """Key of a parameter Triton may specialise (value class and alignment)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0
    return type(arg)


def _dtype_key(arg: object) -> object:
    """Key of a parameter Triton does not specialise: its dtype or None-ness."""
    return arg.dtype if isinstance(arg, torch.Tensor) else arg is None


def _hooks_installed() -> bool:
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and (not isinstance(hook, HookChain) or bool(hook.calls))


class Launcher:
    """``launcher(grid, *args, **constexprs)``: launch ``kernel`` on the current stream."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        params = [p for p in getattr(kernel, "params", ()) if not p.is_constexpr]
        self.names = tuple(getattr(kernel, "arg_names", ()))
        self.keys = tuple(
            _dtype_key if p.do_not_specialize and p.do_not_specialize_on_alignment else _full_key
            for p in params
        )
        self.compiled: dict[tuple, CompiledKernel] = {}
        self.direct = True  # False after the driver entry point refused our arguments

    def key(self, args: tuple, meta: dict) -> tuple:
        """The specialisation key of a call (pass it back as ``key=`` to skip
        recomputing it when the arguments' dtypes and classes are fixed)."""
        return tuple([f(a) for f, a in zip(self.keys, args)]), tuple(meta.values())

    def __call__(
        self, grid: tuple[int, ...], *args: object, key: tuple | None = None, **meta: object
    ) -> None:
        if key is None:
            key = self.key(args, meta)
        compiled = self.compiled.get(key)
        if compiled is None or _hooks_installed():
            result = self.kernel[grid](*args, **meta)
            if isinstance(result, CompiledKernel) and self.direct:
                assert len(args) == len(self.keys) and tuple(meta) == self.names[len(args) :], (
                    "launch: pass every runtime argument positionally, then the constexprs "
                    f"as keywords in signature order {self.names[len(self.keys) :]}; got "
                    f"{len(args)} positional and {tuple(meta)}"
                )
                self.compiled[key] = result
            return
        try:
            compiled.run(
                grid[0],
                grid[1] if len(grid) > 1 else 1,
                grid[2] if len(grid) > 2 else 1,
                _raw_stream(_current_device()),
                compiled.function,
                compiled.packed_metadata,
                None,
                None,
                None,
                *args,
                *meta.values(),
            )
        except TypeError:  # another Triton's launcher signature: refused before launching
            self.direct = False
            self.compiled.clear()
            self.kernel[grid](*args, **meta)


def launcher(kernel: object) -> Callable[..., None]:
    """A ``Launcher`` for a ``@triton.jit`` kernel (one per kernel, module level)."""
    return Launcher(kernel)
