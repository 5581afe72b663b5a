"""KV kernels over the unified pool: Triton on CUDA, pure-torch references on CPU.

``get_backend(device)`` (``kernels/backend.py``) picks the implementation ONCE,
at construction time of whoever calls it, and returns a typed ``KernelBackend``;
the per-step path then calls its ops with no device or layout branching. Every
op has the same signature in both backends, stated once as a ``Protocol`` in its
family's ``protocols`` module: ``attention/``, ``mla/``, ``tables/``, ``linear/``,
``moe/``, ``recurrent/`` (shared launch helpers: ``runtime/``). Choices that depend
on the step are plans the step planner makes (``DecodePlan``, ``ExtendPlan``,
``RowsPlan``).
"""

from __future__ import annotations

from unikv.kernels.attention import ref as reference
from unikv.kernels.backend import MLA_OPS, OPS, RECURRENT_OPS, KernelBackend, get_backend

__all__ = ["MLA_OPS", "OPS", "RECURRENT_OPS", "KernelBackend", "get_backend", "reference"]
