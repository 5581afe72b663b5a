"""Save page envelopes to disk and restore them into a pool of the same specs.

File format (safetensors, one file, any number of sub-pools):

    tensors   "<name>.pages"      (n, page_bytes) uint8   the envelopes, in the
                                                         order the pages were given
              "<name>.checksums"  (n, 3) int64            ``page_checksums`` of them
    metadata  "format"   = "unikv-pages"
              "version"  = "1"
              "subpools" = JSON {name: {fingerprint, page_size, page_bytes, kind,
                                        spec, num_pages}}
              "user.<key>" = the caller's own string metadata

Restore checks everything before it writes a byte: format, spec fingerprint,
page size and page bytes (:class:`SpecMismatchError` naming both fingerprints),
shapes and every page's checksum (:class:`PageIntegrityError`). On any error the
pool is unchanged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

from unikv.ids import PhysicalPageIds
from unikv.io.checksum import CHECKSUM_WORDS, mismatched_pages, page_checksums
from unikv.io.envelopes import page_rows, physical_pages
from unikv.io.errors import PageIntegrityError
from unikv.io.manifest import check_same_geometry, subpool_manifest
from unikv.pool import UnifiedPool, check_pages

FORMAT, VERSION = "unikv-pages", "1"


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as e:  # an optional dependency (the "models" extra)
        raise ImportError("saving pages needs safetensors: pip install safetensors") from e
    return st


def save_pages(
    path: str | os.PathLike,
    pool: UnifiedPool,
    pages: Mapping[str, PhysicalPageIds],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write the envelopes of ``pages[name]`` (physical pages of sub-pool name,
    (n,) int32/int64) with checksums and spec fingerprints to ``path``."""
    tensors, manifest = {}, {}
    for name, ids in pages.items():
        data = physical_pages(ids, "save_pages pages", name)
        check_pages(pool[name], data, f"save_pages pages of {name!r}")
        envelopes = page_rows(pool, name).index_select(0, data.to(pool.device, torch.int64))
        tensors[f"{name}.pages"] = envelopes.cpu()
        tensors[f"{name}.checksums"] = page_checksums(envelopes).cpu()
        manifest[name] = {**subpool_manifest(pool, name), "num_pages": int(data.numel())}
    header = {"format": FORMAT, "version": VERSION, "subpools": json.dumps(manifest)}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str, got {key!r}: {value!r}")
        header[f"user.{key}"] = value
    _safetensors().save_file(tensors, os.fspath(path), metadata=header)


def load_manifest(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(subpools, user_metadata)`` of a saved file, without reading its pages:
    ``subpools[name]`` has fingerprint, page_size, page_bytes, kind, spec, num_pages."""
    from safetensors import safe_open

    _safetensors()
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            header = f.metadata() or {}
    except Exception as e:  # a damaged header or a file that is not safetensors
        raise PageIntegrityError(f"cannot read saved pages from {path}: {e}") from e
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise PageIntegrityError(
            f"{path} is not a unikv page file (format {header.get('format')!r} version "
            f"{header.get('version')!r}; expected {FORMAT!r} version {VERSION!r})"
        )
    try:
        subpools = json.loads(header["subpools"])
    except (KeyError, ValueError) as e:
        raise PageIntegrityError(f"{path}: damaged 'subpools' metadata: {e}") from e
    _check_entries(path, subpools)
    user = {k[len("user.") :]: v for k, v in header.items() if k.startswith("user.")}
    return subpools, user


# every sub-pool entry of a page file's manifest: key -> the JSON types it may hold
ENTRY = {"fingerprint": str, "page_size": int, "page_bytes": int, "kind": str, "spec": str,
         "num_pages": int}  # fmt: skip


def _check_entries(path, subpools: object) -> None:
    """PageIntegrityError unless ``subpools`` maps names to entries with every key
    of ``ENTRY``, each of its type (ints non-negative): a damaged header is named,
    never a KeyError or TypeError from a later read."""
    if not isinstance(subpools, dict):
        raise PageIntegrityError(
            f"{path}: damaged 'subpools' metadata: expected a JSON object of sub-pools, "
            f"got {type(subpools).__name__}"
        )
    for name, entry in subpools.items():
        if not isinstance(entry, dict):
            raise PageIntegrityError(
                f"{path}: damaged 'subpools' metadata: sub-pool {name!r} is "
                f"{type(entry).__name__}, expected an object with keys {sorted(ENTRY)}"
            )
        for key, kind in ENTRY.items():
            value = entry.get(key)
            if (
                not isinstance(value, kind)
                or isinstance(value, bool)
                or (kind is int and value < 0)
            ):
                raise PageIntegrityError(
                    f"{path}: damaged 'subpools' metadata: sub-pool {name!r} needs "
                    f"{key!r} as a{'' if kind is str else ' non-negative'} "
                    f"{kind.__name__}, got {value!r}; the file is corrupt, nothing was restored"
                )


def restore_pages(
    path: str | os.PathLike, pool: UnifiedPool, pages: Mapping[str, PhysicalPageIds]
) -> None:
    """Load a file written by :func:`save_pages` into ``pool``: the i-th saved
    envelope of sub-pool ``name`` goes to physical page ``pages[name][i]``
    (distinct, outside the sink; one page per saved envelope). Every sub-pool in
    ``pages`` must be in the file; the file may hold others (ignored)."""
    saved, _ = load_manifest(path)
    ours = {name: subpool_manifest(pool, name) for name in pages}
    check_same_geometry(ours, saved, pages, f"file {os.fspath(path)}")
    dst = {}
    for name, ids in pages.items():
        dst[name] = physical_pages(ids, "restore_pages pages", name)
        check_pages(pool[name], dst[name], f"restore_pages pages of {name!r}")
    for name, data in dst.items():
        if data.numel() != saved[name]["num_pages"]:
            raise ValueError(
                f"restore_pages: {path} holds {saved[name]['num_pages']} pages of sub-pool "
                f"{name!r} but {data.numel()} destination pages were given; pass one per saved page"
            )
    staged = {name: _read_verified(path, pool, name, saved[name]) for name in pages}
    for name, envelopes in staged.items():  # commit: one scatter per sub-pool
        page_rows(pool, name).index_copy_(0, dst[name].to(pool.device, torch.int64), envelopes)


def _read_verified(path, pool: UnifiedPool, name: str, entry: Mapping) -> torch.Tensor:
    """The saved envelopes of ``name`` on the pool's device, checksums verified."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            envelopes = f.get_tensor(f"{name}.pages")
            expected = f.get_tensor(f"{name}.checksums")
    except Exception as e:
        raise PageIntegrityError(f"cannot read the pages of {name!r} from {path}: {e}") from e
    n, page_bytes = entry["num_pages"], entry["page_bytes"]
    if (
        envelopes.dtype != torch.uint8
        or tuple(envelopes.shape) != (n, page_bytes)
        or expected.dtype != torch.int64
        or tuple(expected.shape) != (n, CHECKSUM_WORDS)
    ):
        raise PageIntegrityError(
            f"{path}: sub-pool {name!r} tensors have shapes {tuple(envelopes.shape)} "
            f"{envelopes.dtype} / {tuple(expected.shape)} {expected.dtype}; the manifest "
            f"promises ({n}, {page_bytes}) uint8 / ({n}, {CHECKSUM_WORDS}) int64"
        )
    envelopes = envelopes.to(pool.device)
    bad = mismatched_pages(expected.to(pool.device), page_checksums(envelopes))
    if bad:
        raise PageIntegrityError(
            f"{path}: {len(bad)} of {n} saved pages of sub-pool {name!r} fail their checksum "
            f"(indices {bad[:16]}); the file is corrupt, nothing was restored"
        )
    return envelopes
