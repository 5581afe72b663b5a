"""Page-granular I/O: a page envelope is one contiguous byte range, so offload
to host memory, save/restore and transfer between instances are one copy per
page (docs/design.md section 9).

- ``host_tier``: a (pinned) host pool of envelopes; offload/reload on side streams.
- ``tiering``: offload/reload by virtual page through the allocator's hooks.
- ``save``: safetensors files with spec fingerprints and per-page checksums.
- ``transfer``: send/receive over torch.distributed with a handshake and checksums.
"""

from unikv.io.checksum import page_checksums
from unikv.io.errors import PageIntegrityError, SpecMismatchError, TransferError
from unikv.io.host_tier import HostCopy, HostPageIds, HostTier
from unikv.io.save import load_manifest, restore_pages, save_pages
from unikv.io.tiering import Offloaded, Tiering
from unikv.io.transfer import recv_pages, send_pages

__all__ = [
    "HostCopy",
    "HostPageIds",
    "HostTier",
    "Offloaded",
    "PageIntegrityError",
    "SpecMismatchError",
    "Tiering",
    "TransferError",
    "load_manifest",
    "page_checksums",
    "recv_pages",
    "restore_pages",
    "save_pages",
    "send_pages",
]
