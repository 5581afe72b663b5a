"""unikv: one byte buffer for every kind of per-request LLM state."""

from unikv.ids import (
    KernelIds,
    KernelPageIds,
    PhysicalPageIds,
    PhysicalTokenIds,
    VirtualPageIds,
    VirtualTokenIds,
)
from unikv.pool import Grow, SubPool, SubPoolConfig, UnifiedPool
from unikv.specs import MambaSpec, MHASpec, MLASpec, StatePart

__all__ = [
    "Grow",
    "KernelIds",
    "KernelPageIds",
    "MHASpec",
    "MLASpec",
    "MambaSpec",
    "PhysicalPageIds",
    "PhysicalTokenIds",
    "StatePart",
    "SubPool",
    "SubPoolConfig",
    "UnifiedPool",
    "VirtualPageIds",
    "VirtualTokenIds",
]
