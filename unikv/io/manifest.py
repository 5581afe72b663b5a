"""What identifies a sub-pool's page envelopes across instances and files.

Two pools can exchange pages of a sub-pool only when the spec fingerprint, the
page size and the page bytes all agree: then every byte of an envelope means
the same (layer, part, slot, element) on both sides (docs/design.md section 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from unikv.io.errors import SpecMismatchError
from unikv.pool import UnifiedPool

KEYS = ("fingerprint", "page_size", "page_bytes")


def subpool_manifest(pool: UnifiedPool, name: str) -> dict:
    """``{fingerprint, page_size, page_bytes, kind, spec}`` of sub-pool ``name``."""
    sub = pool[name]
    return {
        "fingerprint": sub.spec.fingerprint(),
        "page_size": sub.page_size,
        "page_bytes": sub.page_bytes,
        "kind": sub.spec.kind,
        "spec": repr(sub.spec),
    }


def check_same_geometry(
    ours: Mapping[str, Mapping], theirs: Mapping[str, Mapping], names: Iterable[str], other: str
) -> None:
    """Raise :class:`SpecMismatchError` unless, for every name, ``theirs`` has the
    sub-pool and agrees with ``ours`` on fingerprint, page size and page bytes.

    ``other`` names the other side in the message (a file path, a peer rank).
    """
    problems = []
    for name in names:
        if name not in theirs:
            problems.append(f"sub-pool {name!r} is missing from {other} (it has {sorted(theirs)})")
            continue
        a, b = ours[name], theirs[name]
        if any(a[k] != b[k] for k in KEYS):
            problems.append(
                f"sub-pool {name!r}: this pool has spec fingerprint {a['fingerprint']} "
                f"(page_size {a['page_size']}, page_bytes {a['page_bytes']}) but {other} has "
                f"fingerprint {b['fingerprint']} (page_size {b['page_size']}, page_bytes "
                f"{b['page_bytes']})"
            )
    if problems:
        raise SpecMismatchError(
            "refusing to move pages between pools built from different specs: "
            + "; ".join(problems)
            + "; build both pools from the same SubPoolConfig (spec and page_size)"
        )
