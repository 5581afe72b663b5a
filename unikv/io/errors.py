"""Errors of the page I/O layer (host tier, save/restore, transfer).

Both derive from ``ValueError``: they report bad input (a file or a peer that
does not match this pool), never a broken internal invariant.
"""

from __future__ import annotations


class SpecMismatchError(ValueError):
    """The other side (a file, a peer) was built from different specs or page
    sizes than this pool; no page was moved."""


class PageIntegrityError(ValueError):
    """Page bytes failed their checksum (or could not be read at all); the
    destination pool was left unchanged."""


class TransferError(RuntimeError):
    """The peer reported that it did not commit the pages it was sent."""
