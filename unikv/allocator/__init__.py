"""The page allocator: virtual-to-physical pages for every sub-pool of a
UnifiedPool, moving frontiers, lazy compaction, one capacity oracle.

    allocator.py   PoolAllocator: the facade over the parts below
    pages.py       PageBook: one sub-pool's pages (host mirrors, band, free stack)
    tables.py      TablePatch, TableWriter: packed device table writes, one launch
    requests.py    request slots, virtual space, req_to_token, roles
    tokens.py      the token verbs' host half (grow, window frees, truncate)
    step.py        DecodeStep and the decode step's output buffers
    mamba.py       Mamba state slots
    page_io.py     I/O hooks by virtual page (release, bind, pin, unpin)
    prefix.py      prefix caching: shared full pages, hash chain, LRU eviction
    room.py        reserve / can_admit / compact, the shortfall callback
    bands.py       band planning, pure: needs, candidate packings, page moves
    capacity.py    the band packer (capacity oracle)
    compaction.py  carrying out page moves toward a packing
    fences.py      pages held until a done-event fires
    translate.py   translation out= rules and debug tombstone checks
    device.py      host -> device index uploads without a sync
    integrity.py   check_integrity
"""

from unikv.allocator.allocator import PoolAllocator
from unikv.allocator.capacity import BandNeed, bands_disjoint, pack_bands
from unikv.allocator.pages import PageBook, PageState
from unikv.allocator.parts import Parts
from unikv.allocator.prefix import PrefixHit
from unikv.allocator.room import Shortfall
from unikv.allocator.step import DecodeStep
from unikv.allocator.tables import TablePatch, TableWriter
from unikv.allocator.translate import TombstoneReadError

__all__ = [
    "BandNeed",
    "DecodeStep",
    "PageBook",
    "PageState",
    "Parts",
    "PoolAllocator",
    "PrefixHit",
    "Shortfall",
    "TablePatch",
    "TableWriter",
    "TombstoneReadError",
    "bands_disjoint",
    "pack_bands",
]
