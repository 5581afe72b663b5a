"""KV kernels over the unified pool: Triton on CUDA, pure-torch references on CPU.

``get_backend(device)`` (``kernels/backend.py``) picks the implementation ONCE,
at construction time of whoever calls it, and returns a typed ``KernelBackend``;
the per-step path then calls its ops with no device or layout branching. Every
op has the same signature in both backends.
"""

from __future__ import annotations

from unikv.kernels.attention import ref as reference
from unikv.kernels.backend import MLA_OPS, OPS, RECURRENT_OPS, KernelBackend, get_backend

__all__ = ["MLA_OPS", "OPS", "RECURRENT_OPS", "KernelBackend", "get_backend", "reference"]
