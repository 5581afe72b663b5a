"""The private torch and Triton entry points unikv relies on, fenced in one module.

Each is a fast path that the public API does not offer (or offers only at many
microseconds per call on the per-step path):

    current_raw_stream(device_index) -> int   torch._C._cuda_getCurrentRawStream
    record_event(event, stream)               torch._C._CudaEventBase.record
    triton_interpreter()                       triton.runtime.interpreter (the CPU
                                              interpreter's patch point, TRITON_INTERPRET=1)

They are resolved once, at import, and checked against the versions unikv is
tested with (``pyproject.toml`` bounds them: torch 2.11-2.13, Triton 3.6). A
missing entry point raises a RuntimeError that names the installed version and
the tested range, at the first call, never a bare AttributeError deep in a launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TORCH_TESTED = "torch >= 2.11, < 2.14"
TRITON_TESTED = "triton >= 3.6, < 3.7"


def _missing(what: str, version: str, tested: str) -> Callable[..., object]:
    def fail(*args: object, **kwargs: object) -> object:
        raise RuntimeError(
            f"{what} is not available in {version}; unikv uses this private entry point "
            f"and is tested with {tested}: install a version in that range"
        )

    return fail


def _torch_private(name: str, owner: object, label: str) -> Callable[..., object]:
    fn = getattr(owner, name, None)
    if fn is not None:
        return fn
    build = "" if torch.version.cuda else " (a CPU-only build: CUDA entry points need a CUDA build)"
    return _missing(label, f"torch {torch.__version__}{build}", TORCH_TESTED)


# The current CUDA stream of a device as a raw handle (an int), without building
# a Stream object: what Triton's compiled launchers take. Hot path: bound once.
current_raw_stream: Callable[[int], int] = _torch_private(
    "_cuda_getCurrentRawStream", torch._C, "torch._C._cuda_getCurrentRawStream"
)

_event_base = getattr(torch._C, "_CudaEventBase", None)
_event_record = _torch_private("record", _event_base, "torch._C._CudaEventBase.record")


def record_event(event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
    """Record ``event`` on ``stream`` through the C binding (no Python wrapper,
    no current-stream lookup): ``torch.cuda.Event.record(stream)`` without its
    per-call overhead."""
    _event_record(event, stream)


def triton_interpreter() -> object:
    """Triton's CPU interpreter module (``triton.runtime.interpreter``), whose
    ``_patch_lang_tensor`` hook ``kernels/runtime/interpret.py`` wraps."""
    import triton

    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - depends on the installed Triton
        interpreter = None
    if interpreter is None or not hasattr(interpreter, "_patch_lang_tensor"):
        _missing(
            "triton.runtime.interpreter._patch_lang_tensor",
            f"triton {triton.__version__}",
            TRITON_TESTED,
        )()
    return interpreter
