"""Send page envelopes between two instances over torch.distributed.

NCCL moves tensors on the pool's GPU; gloo (CPU) moves them through host
memory. The protocol between sender S and receiver R, all blocking point to
point messages in this fixed order:

    S -> R   prelude (3,) int64 [MAGIC, VERSION, n]  +  n bytes of JSON manifest
    R -> S   prelude + R's manifest                  (the handshake)
             a manifest carries each sub-pool's spec fingerprint, page size, page
             bytes and page count, or the side's own input error; both sides
             judge the pair with the same function and raise SpecMismatchError /
             ValueError together: no page has moved
    per sub-pool, sorted by name:
    S -> R   checksums (n, 3) int64, then envelopes (n, page_bytes) uint8
             (one contiguous staging tensor, gathered with one index_select)
    R        verifies every checksum on its device, then commits with one
             index_copy_ per sub-pool; nothing is written before all pass
    R -> S   ack (2,) int64 [status, pages that failed]; S raises TransferError
             unless the receiver committed

A failed or partial transfer (bad checksum, a peer that dies mid-way) raises
before the commit, so the receiver's pool is unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from unikv.ids import PhysicalPageIds
from unikv.io.checksum import CHECKSUM_WORDS, mismatched_pages, page_checksums
from unikv.io.envelopes import page_rows, physical_pages
from unikv.io.errors import PageIntegrityError, TransferError
from unikv.io.manifest import check_same_geometry, subpool_manifest
from unikv.pool import UnifiedPool, check_pages

MAGIC, VERSION = 0x756E696B76, 1  # "unikv"
ACK_OK, ACK_CORRUPT = 1, 2

StagingHook = Callable[[str, torch.Tensor], None]


def _comm_device(pool: UnifiedPool, group) -> torch.device:
    """NCCL sends device tensors; every other backend sends host tensors."""
    return pool.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _manifest(pool: UnifiedPool, pages: Mapping[str, torch.Tensor]) -> dict:
    return {
        name: {**subpool_manifest(pool, name), "num_pages": int(data.numel())}
        for name, data in pages.items()
    }


def _local_pages(pool: UnifiedPool, pages: Mapping[str, PhysicalPageIds], what: str):
    """``(pages, None)`` with validated (n,) page tensors by sorted name, or
    ``(None, error)`` when the caller's input is bad: the error is raised only
    after the handshake, so the peer learns of it and raises too."""
    try:
        out = {}
        for name in sorted(pages):
            out[name] = physical_pages(pages[name], what, name)
            check_pages(pool[name], out[name], f"{what} of {name!r}")
        return out, None
    except (KeyError, TypeError, ValueError) as e:
        return None, e


def send_json(obj: dict, peer: int, group, device: torch.device) -> None:
    """Send a JSON-able dict: (3,) int64 prelude (magic, version, size), then the
    UTF-8 bytes; ``device`` is where the backend sends from (NCCL: the GPU)."""
    body = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([MAGIC, VERSION, body.numel()], device=device), peer, group=group)
    dist.send(body.to(device), peer, group=group)


def recv_json(peer: int, group, device: torch.device) -> dict:
    """Receive what ``send_json`` sent; a peer of another protocol version raises."""
    prelude = torch.zeros(3, dtype=torch.int64, device=device)
    dist.recv(prelude, peer, group=group)
    magic, version, size = prelude.tolist()
    if magic != MAGIC or version != VERSION:
        raise PageIntegrityError(
            f"rank {peer} does not speak unikv page transfer version {VERSION} "
            f"(got magic {magic:#x}, version {version}); run the same unikv on both sides"
        )
    body = torch.zeros(size, dtype=torch.uint8, device=device)
    dist.recv(body, peer, group=group)
    return json.loads(bytes(body.cpu().tolist()).decode())


def _agree(ours: dict, theirs: dict, peer: int) -> None:
    """Raise on both sides alike when the two manifests do not match."""
    if sorted(ours) != sorted(theirs):
        raise ValueError(
            f"transfer: this side moves sub-pools {sorted(ours)}, rank {peer} moves "
            f"{sorted(theirs)}; name the same sub-pools on both sides"
        )
    check_same_geometry(ours, theirs, sorted(ours), f"rank {peer}")
    counts = {n: (ours[n]["num_pages"], theirs[n]["num_pages"]) for n in ours}
    if any(a != b for a, b in counts.values()):
        raise ValueError(
            f"transfer: page counts differ (this side, rank {peer}) per sub-pool: {counts}; "
            "give the receiver one destination page per page sent"
        )


def exchange_json(ours: dict, peer: int, group, device: torch.device, *, first: bool) -> dict:
    """Swap dicts with ``peer``: the ``first`` side sends before it receives."""
    if first:
        send_json(ours, peer, group, device)
        return recv_json(peer, group, device)
    theirs = recv_json(peer, group, device)
    send_json(ours, peer, group, device)
    return theirs


def _handshake(pool, pages, error, peer, group, device, *, sender: bool) -> None:
    """Exchange manifests (or a local input error) and raise on both sides alike
    unless both are well-formed and agree."""
    ours = {"error": str(error)} if error is not None else {"subpools": _manifest(pool, pages)}
    theirs = exchange_json(ours, peer, group, device, first=sender)
    if error is not None:
        raise error
    if "error" in theirs:
        raise ValueError(f"rank {peer} refused the transfer: {theirs['error']}")
    _agree(ours["subpools"], theirs["subpools"], peer)


def send_pages(
    pool: UnifiedPool, pages: Mapping[str, PhysicalPageIds], dst: int, *, group=None
) -> None:
    """Send the envelopes of ``pages[name]`` ((n,) physical pages of sub-pool
    name) to rank ``dst``, which calls :func:`recv_pages`. Returns once the
    receiver has committed them; raises :class:`TransferError` if it refused."""
    src_pages, error = _local_pages(pool, pages, "send_pages pages")
    device = _comm_device(pool, group)
    _handshake(pool, src_pages, error, dst, group, device, sender=True)
    for name, data in src_pages.items():
        if data.numel() == 0:  # both sides know the count from the handshake
            continue
        envelopes = page_rows(pool, name).index_select(0, data.to(pool.device, torch.int64))
        dist.send(page_checksums(envelopes).to(device), dst, group=group)
        dist.send(envelopes.to(device), dst, group=group)
    ack = torch.zeros(2, dtype=torch.int64, device=device)
    dist.recv(ack, dst, group=group)
    status, num_bad = ack.tolist()
    if status != ACK_OK:
        raise TransferError(
            f"rank {dst} refused the pages: {num_bad} failed their checksum in transit; "
            "its pool is unchanged, send them again"
        )


def recv_pages(
    pool: UnifiedPool,
    pages: Mapping[str, PhysicalPageIds],
    src: int,
    *,
    group=None,
    staging_hook: StagingHook | None = None,
) -> None:
    """Receive pages sent by rank ``src`` with :func:`send_pages` into physical
    pages ``pages[name]`` ((n,) distinct, outside the sink; the i-th sent
    envelope lands in ``pages[name][i]``).

    ``staging_hook(name, envelopes)`` (tests only) may alter the staged
    (n, page_bytes) uint8 envelopes before they are verified.
    Raises :class:`SpecMismatchError` or :class:`PageIntegrityError` with the
    pool unchanged.
    """
    dst_pages, error = _local_pages(pool, pages, "recv_pages pages")
    device = _comm_device(pool, group)
    _handshake(pool, dst_pages, error, src, group, device, sender=False)
    staged, bad = {}, {}
    for name, data in dst_pages.items():
        n, page_bytes = data.numel(), pool[name].page_bytes
        if n == 0:
            continue
        expected = torch.empty((n, CHECKSUM_WORDS), dtype=torch.int64, device=device)
        envelopes = torch.empty((n, page_bytes), dtype=torch.uint8, device=device)
        dist.recv(expected, src, group=group)
        dist.recv(envelopes, src, group=group)
        envelopes = envelopes.to(pool.device)
        if staging_hook is not None:
            staging_hook(name, envelopes)
        bad[name] = mismatched_pages(expected.to(pool.device), page_checksums(envelopes))
        staged[name] = envelopes
    num_bad = sum(len(b) for b in bad.values())
    if num_bad:
        dist.send(torch.tensor([ACK_CORRUPT, num_bad], device=device), src, group=group)
        raise PageIntegrityError(
            f"pages from rank {src} failed their checksum (indices per sub-pool: "
            f"{ {n: b[:16] for n, b in bad.items() if b} }); nothing was committed"
        )
    for name, envelopes in staged.items():  # commit: one scatter per sub-pool
        data = dst_pages[name]
        page_rows(pool, name).index_copy_(0, data.to(pool.device, torch.int64), envelopes)
    dist.send(torch.tensor([ACK_OK, 0], device=device), src, group=group)
