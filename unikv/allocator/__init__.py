"""The page allocator: virtual-to-physical pages for every sub-pool of a
UnifiedPool, moving frontiers, lazy compaction, one capacity oracle.

    chain.py       PoolAllocator: the chain, reserve/can_admit/compact, fences
    tokens.py      allocate (extend, decode) and free verbs
    step.py        decode_step: a decode step's verbs and lookups in one call
    lookups.py     Mamba slots and translation verbs
    subpool.py     one sub-pool: v2p/p2v, band, holes, I/O hooks
    capacity.py    the band packer (capacity oracle)
    compaction.py  page moves toward a packing
    requests.py    request slots, virtual space, req_to_token
    translate.py   virtual -> physical / kernel ids
    fences.py      pages held until a done-event fires
    device.py      host -> device index uploads without a sync
    integrity.py   check_integrity
"""

from unikv.allocator.capacity import BandNeed, bands_disjoint, pack_bands
from unikv.allocator.chain import PoolAllocator, Shortfall
from unikv.allocator.step import DecodeStep
from unikv.allocator.subpool import SubPoolAllocator
from unikv.allocator.translate import TombstoneReadError, translate_kernel, translate_physical

__all__ = [
    "BandNeed",
    "DecodeStep",
    "PoolAllocator",
    "Shortfall",
    "SubPoolAllocator",
    "TombstoneReadError",
    "bands_disjoint",
    "pack_bands",
    "translate_kernel",
    "translate_physical",
]
