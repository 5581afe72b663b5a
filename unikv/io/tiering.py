"""Offload and reload by virtual page, through the allocator's I/O hooks.

    offload(v):  P = v2p[v]  ->  copy P's envelope to a host slot (side stream)
                 -> release_physical(v, fence=copy event): v2p[v] = -1, v stays
                    owned by its request; P is PENDING (neither reused nor moved)
                    until the copy has read it, then a hole
    reload(v):   P' = bind_physical(v) (any hole; compacting if needed)
                 -> pin(P') -> copy the host slot into P' (side stream)
                 -> poll(): unpin P' once the copy's event fired, so compaction
                    never moves a page that is still being written

Virtual ids never change, so the request's ``req_to_token`` rows stay valid
while its pages live on the host. Before a kernel reads reloaded pages, wait
for the reload (``HostCopy.done()`` to schedule around it, or ``HostCopy.wait()``
to order the forward stream after it without blocking the host).

Physical page ids are read from the allocator's host mirror
(``PageIO.physical_pages``), so neither verb syncs the host with the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unikv.allocator import PoolAllocator
from unikv.ids import PhysicalPageIds, VirtualPageIds, expect
from unikv.io.host_tier import HostCopy, HostPageIds, HostTier


@dataclass
class Offloaded:
    """Virtual pages (n,) of one sub-pool whose envelopes live in ``host_slots``
    (``host_slots[i]`` holds ``vpages[i]``); ``copy`` is the device-to-host copy."""

    vpages: VirtualPageIds
    host_slots: HostPageIds
    copy: HostCopy


class Tiering:
    """Offload/reload of one sub-pool's virtual pages between the pool and a
    :class:`HostTier`.

    Args:
        alloc: the pool allocator (its I/O hooks ``alloc.io``:
            ``physical_pages``, ``release_physical``, ``bind_physical``, ``pin``,
            ``unpin``, ``pinned``).
        tier: the host tier of the same pool and sub-pool.
    """

    def __init__(self, alloc: PoolAllocator, tier: HostTier) -> None:
        self.alloc, self.tier, self.name = alloc, tier, tier.name
        self.io = alloc.io
        if tier.name not in alloc.pool.subpools:
            have = list(alloc.pool.subpools)
            raise KeyError(f"no sub-pool {tier.name!r}; the allocator has {have}")
        self._pinned: list[HostCopy] = []  # reloads whose destination pages are pinned

    @property
    def num_in_flight(self) -> int:
        """Reloads whose destination pages are still pinned (after a poll)."""
        self.poll()
        return len(self._pinned)

    def poll(self) -> None:
        """Unpin the destination pages of every finished reload (non-blocking)."""
        still = []
        for copy in self._pinned:
            if copy.done():
                self.io.unpin(self.name, copy.pages)
            else:
                still.append(copy)
        self._pinned = still

    def check_integrity(self) -> None:
        """The tier's own check, plus: tier and allocator serve one pool and
        sub-pool, and the pages of reloads still in flight stay pinned."""
        self.tier.check_integrity()
        same = self.tier.pool is self.alloc.pool and self.tier.name == self.name
        assert same and self.io is self.alloc.io, (
            "tiering: the tier and the allocator serve the same pool and sub-pool"
        )
        for copy in self._pinned:
            pages = copy.pages.data.to("cpu", torch.int64).numpy()
            assert self.io.pinned(self.name, pages).all(), (
                "tiering: the pages of a reload in flight are pinned"
            )

    def _bound_pages(self, vpages: VirtualPageIds, what: str) -> PhysicalPageIds:
        expect(vpages, VirtualPageIds, what, self.name)
        try:
            pages = self.io.physical_pages(self.name, vpages)
        except ValueError as error:  # name the caller's verb
            raise ValueError(f"{what}: {error}") from None
        if (pages < 0).any():
            host = vpages.data.detach().cpu().numpy()
            raise ValueError(
                f"{what}: virtual pages {host[pages < 0].tolist()} of {self.name!r} hold no "
                "physical page (already offloaded, tombstoned or never allocated)"
            )
        return PhysicalPageIds(torch.from_numpy(pages), self.name)

    def offload(self, vpages: VirtualPageIds) -> Offloaded | None:
        """Move (n,) bound virtual pages to the host and give their physical pages
        back to the allocator (fenced by the copy). ``None`` (nothing changed)
        when the host tier has fewer than n free slots."""
        self.poll()
        pages = self._bound_pages(vpages, "Tiering.offload vpages")
        copy = self.tier.offload(pages, check=False)  # bound pages: real and distinct
        if copy is None:
            return None
        try:
            self.io.release_physical(self.name, vpages, fence=copy.event)
        except Exception:
            self.tier.free(copy.host_slots)  # e.g. a pinned page: undo the slots
            raise
        return Offloaded(vpages, copy.host_slots, copy)

    def reload(self, offloaded: Offloaded) -> HostCopy | None:
        """Bind fresh physical pages to the offloaded virtual pages and copy their
        envelopes back; the host slots are freed (reused after the copy). ``None``
        (nothing changed) when the allocator cannot make room."""
        self.poll()
        if self.io.bind_physical(self.name, offloaded.vpages) is None:
            return None
        pages = PhysicalPageIds(
            torch.from_numpy(self.io.physical_pages(self.name, offloaded.vpages)), self.name
        )
        self.io.pin(self.name, pages)
        copy = self.tier.reload(offloaded.host_slots, pages, check=False)
        self.tier.free(offloaded.host_slots)
        self._pinned.append(copy)
        self.poll()  # on CPU the copy is done: unpin at once
        return copy

    def drop(self, offloaded: Offloaded) -> None:
        """Forget offloaded pages without reloading them (their request ended):
        free the host slots. The virtual pages are the request's to free."""
        self.tier.free(offloaded.host_slots)
