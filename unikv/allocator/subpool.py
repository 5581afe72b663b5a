"""One sub-pool's pages: v2p/p2v tables, a band with holes, a free stack.

    page:   0 .. first_page-1 | first_page ........................ num_pages-1
            sink (never given)  OUT ... | band: LIVE/FREE/PENDING | ... OUT

- ``v2p[v]`` (virtual page -> physical page, -1 = tombstone) and ``p2v[p]`` are
  inverse on LIVE pages; entry 0 of both is pinned to 0 (the sink).
- Every LIVE or PENDING page lies in the band ``[lo, hi)``; every FREE page (a
  hole) lies in it too and sits exactly once on the free stack; OUT pages lie
  outside it. Bands of different sub-pools are byte-disjoint (kept by the chain).
- The host mirrors (numpy) are the truth for bookkeeping; the device tables are
  written from uploaded arrays (``device.py``): one fused launch per per-step
  verb (``unikv.kernels.table_update``), batched ``index_put_`` on slow paths.

The I/O hooks ``release_physical``, ``bind_physical``, ``pin`` and ``unpin``
are methods of this class; ``bind_physical`` asks the chain for room.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unikv.allocator.device import pack_updates
from unikv.ids import PhysicalPageIds, VirtualPageIds, expect
from unikv.pool import Grow, SubPool

OUT, FREE, LIVE, PENDING = 0, 1, 2, 3


class SubPoolAllocator:
    """Page bookkeeping of one sub-pool. ``num_virtual`` sizes ``v2p``: the id
    owner's virtual page space (LESSONS.md bug 10), or request slots + 1 for Mamba."""

    def __init__(
        self,
        subpool: SubPool,
        num_virtual: int,
        device: torch.device,
        upload: Any,
        chain: Any = None,
        table_ops: Any = None,
    ) -> None:
        self.geom = subpool
        self.name = subpool.name
        self.grow = subpool.grow
        self.page_size = subpool.page_size
        self.page_bytes = subpool.page_bytes
        self.first_page = subpool.first_page
        self.num_pages = subpool.num_pages
        self.blocks_per_page = subpool.spec.blocks_per_page or 1
        self.num_virtual = num_virtual
        self.upload = upload
        self.chain = chain
        self.v2p_host = np.full(num_virtual, -1, np.int32)
        self.p2v_host = np.full(self.num_pages, -1, np.int32)
        self.v2p_host[0] = self.p2v_host[0] = 0  # the sink
        self.state = np.full(self.num_pages, OUT, np.int8)
        self.pins = np.zeros(self.num_pages, np.int32)
        self.any_pinned = False  # whether any entry of pins is > 0 (skips a gather per free)
        self.num_live = 0
        self.num_pending = 0
        self._stack = np.zeros(self.num_pages, np.int32)  # holes; pop from the end
        self.num_free = 0
        start = self.num_pages if self.grow == Grow.DOWN else self.first_page
        self.lo = self.hi = start
        self.v2p = torch.from_numpy(self.v2p_host.copy()).to(device)  # (V,) int32
        self.p2v = torch.from_numpy(self.p2v_host.copy()).to(device)  # (num_pages,) int32
        self._minus_one = torch.full((), -1, dtype=torch.int32, device=device)
        if table_ops is None:
            from unikv.allocator.device import make_table_ops

            table_ops = make_table_ops(device)
        self._update_tables = table_ops.update_tables  # chosen once, by device
        self._tables = [self.v2p, self.p2v]

    # -- free stack ------------------------------------------------------------

    def take(self, count: int) -> np.ndarray:
        """Pop ``count`` holes (the caller made sure there are enough)."""
        assert count <= self.num_free, (
            f"free stack of {self.name!r} short: {count} > {self.num_free}"
        )
        self.num_free -= count
        return self._stack[self.num_free : self.num_free + count].copy()

    def _push(self, pages: np.ndarray) -> None:
        self._stack[self.num_free : self.num_free + len(pages)] = pages
        self.num_free += len(pages)

    # -- binding (host mirrors; the device write is the caller's batched upload) --

    def bind_host(self, vpages: np.ndarray, ppages: np.ndarray) -> None:
        """v2p[vpages] = ppages, p2v[ppages] = vpages on the host; ppages were taken."""
        self.v2p_host[vpages] = ppages
        self.p2v_host[ppages] = vpages
        self.state[ppages] = LIVE
        self.num_live += len(ppages)

    def write_bind(self, vpages: torch.Tensor, ppages: torch.Tensor) -> None:
        """The device half of ``bind_host``: (n,) int32 device tensors."""
        self.v2p.index_put_((vpages,), ppages)
        self.p2v.index_put_((ppages,), vpages)

    def unbind(self, vpages: np.ndarray, fence: Any = None) -> np.ndarray:
        """Unbind bound virtual pages (host int32, v2p >= 0): tombstone them on host
        and device, hold or free their physical pages. Returns the physical pages."""
        ppages = self.unbind_host(vpages, fence)
        if len(ppages):
            packed, segments, count = pack_updates([vpages, ppages], [(0, 0, -1), (1, 1, -1)])
            self._update_tables(self._tables, self.upload(packed), segments, count)
        return ppages

    def unbind_host(self, vpages: np.ndarray, fence: Any = None) -> np.ndarray:
        """``unbind`` without the device write: the caller tombstones ``v2p[vpages]``
        and ``p2v[returned physical pages]`` in its own batched upload."""
        ppages = self.v2p_host[vpages]
        if len(vpages) == 0:
            return ppages
        assert not np.count_nonzero(ppages <= 0), f"{self.name!r}: unbinding unbound virtual pages"
        self.v2p_host[vpages] = -1
        self.p2v_host[ppages] = -1
        self.num_live -= len(ppages)
        held = self.chain.fences.hold(self.name, ppages, fence) if self.chain else False
        if not held and not self.any_pinned:  # the common case: every page becomes a hole
            self.state[ppages] = FREE
            self._push(ppages)
            return ppages
        hold = np.ones(len(ppages), bool) if held else self.pins[ppages] > 0  # pinned: until unpin
        self.state[ppages[hold]] = PENDING
        self.num_pending += int(hold.sum())
        self.state[ppages[~hold]] = FREE
        self._push(ppages[~hold])
        return ppages

    def release_pending(self, ppages: np.ndarray) -> None:
        """Fenced pages whose events fired become holes (pinned ones wait for unpin)."""
        assert (self.state[ppages] == PENDING).all(), f"{self.name!r}: releasing non-pending pages"
        ppages = ppages[self.pins[ppages] == 0]
        self.state[ppages] = FREE
        self.num_pending -= len(ppages)
        self._push(ppages)

    # -- band ------------------------------------------------------------------

    @property
    def band(self) -> tuple[int, int]:
        return self.lo, self.hi

    def occupied_span(self, mask: np.ndarray | None = None) -> tuple[int, int]:
        """(min, max) page that is occupied (LIVE or PENDING, or set in ``mask``);
        (1, 0) when none. O(band) on the host: slow path only."""
        if mask is None:
            mask = self.state[self.lo : self.hi] >= LIVE
        else:
            mask = mask[self.lo : self.hi]
        where = np.flatnonzero(mask)
        if len(where) == 0:
            return 1, 0
        return int(where[0]) + self.lo, int(where[-1]) + self.lo

    def set_band(self, lo: int, hi: int) -> None:
        """Move the band's frontiers to ``[lo, hi)``; every page leaving it must be a hole."""
        assert self.first_page <= lo <= hi <= self.num_pages, (
            f"{self.name!r}: band [{lo}, {hi}) off grid"
        )
        old_lo, old_hi = self.lo, self.hi
        if old_lo == old_hi:
            old_lo = old_hi = lo  # an empty band has no position
        outside = np.r_[old_lo : min(old_hi, lo), max(old_lo, hi) : old_hi]
        assert (self.state[outside] == FREE).all(), (
            f"{self.name!r}: band shrinks over occupied pages"
        )
        self.state[outside] = OUT
        self.lo, self.hi = lo, hi
        if len(outside):  # shrinking: rebuild the stack from the states
            self.num_free = 0
            self._push(self._order(np.flatnonzero(self.state[lo:hi] == FREE).astype(np.int32) + lo))
        added = np.r_[lo : min(old_lo, hi), max(old_hi, lo) : hi].astype(np.int32)  # ascending
        assert (self.state[added] == OUT).all(), f"{self.name!r}: band grows over owned pages"
        self.state[added] = FREE
        # pages farthest from the frontier go first: new pages on the far side of
        # the old band pop before its holes, those on the frontier side after them
        far = added >= old_hi if self.grow == Grow.DOWN else added < old_lo
        self._push_under(self._order(added[~far]))
        self._push(self._order(added[far]))

    def _order(self, pages: np.ndarray) -> np.ndarray:
        """Stack order of ascending ``pages``: those farthest from the frontier pop first."""
        return pages if self.grow == Grow.DOWN else pages[::-1]

    def _push_under(self, pages: np.ndarray) -> None:
        """Put ``pages`` beneath the holes already on the stack (they pop last)."""
        n = len(pages)
        if n:
            self._stack[n : self.num_free + n] = self._stack[: self.num_free].copy()
            self._stack[:n] = pages
            self.num_free += n

    def apply_moves(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Rewrite the tables after the envelopes of ``src`` were copied to ``dst``
        (host int32; dst are holes or pages outside the band that the chain cleared)."""
        assert (self.state[src] == LIVE).all() and (self.pins[src] == 0).all(), (
            f"{self.name!r}: compaction may only move unpinned live pages"
        )
        vpages = self.p2v_host[src]
        self.p2v_host[src] = -1
        self.p2v_host[dst] = vpages
        self.v2p_host[vpages] = dst
        self.state[src] = FREE
        self.state[dst] = LIVE
        packed = self.upload(np.concatenate([vpages, dst, src]))
        n = len(src)
        self.write_bind(packed[:n], packed[n : 2 * n])
        self.p2v.index_put_((packed[2 * n :],), self._minus_one)

    # -- I/O hooks ---------------------------------------------------------------

    def _vpages(self, vpages: object, what: str) -> np.ndarray:
        data = expect(vpages, VirtualPageIds, what)
        host = data.detach().cpu().numpy().astype(np.int32)  # I/O path: may sync
        if host.ndim != 1 or (host < 1).any() or (host >= self.num_virtual).any():
            raise ValueError(
                f"{what}: virtual pages must be a 1-D list in [1, {self.num_virtual}) of "
                f"sub-pool {self.name!r}, got {host.tolist()}"
            )
        if len(np.unique(host)) != len(host):
            raise ValueError(f"{what}: virtual pages must be distinct, got {host.tolist()}")
        return host

    def physical_of(self, vpages: VirtualPageIds) -> PhysicalPageIds:
        """Physical pages (-1 = unbound) of (n,) virtual pages; a device tensor."""
        host = self._vpages(vpages, "physical_of")
        return PhysicalPageIds(self.upload(self.v2p_host[host].copy()), self.name)

    def release_physical(self, vpages: VirtualPageIds, fence: Any = None) -> PhysicalPageIds:
        """Unbind (n,) owned, bound virtual pages (v2p = -1; they stay owned by their
        request) and return their physical pages, which become holes once ``fence``
        (a CUDA event or None) and the forward fence have fired."""
        host = self._vpages(vpages, "release_physical")
        self.chain.check_owned(self.name, host, "release_physical")
        bound = self.v2p_host[host]
        if (bound < 0).any():
            raise ValueError(
                f"release_physical: virtual pages {host[bound < 0].tolist()} of {self.name!r} "
                "hold no physical page (released twice, tombstoned or never bound)"
            )
        if (self.pins[bound] > 0).any():
            raise ValueError(
                f"release_physical: pages {bound[self.pins[bound] > 0].tolist()} are pinned; unpin first"
            )
        pages = self.unbind(host, fence)
        return PhysicalPageIds(self.upload(pages.copy()), self.name)

    def bind_physical(self, vpages: VirtualPageIds) -> PhysicalPageIds | None:
        """Take holes (compacting if needed) for (n,) owned, unbound virtual pages,
        bind v2p/p2v and return the physical pages; None (state unchanged) when
        the chain cannot make room."""
        host = self._vpages(vpages, "bind_physical")
        self.chain.check_owned(self.name, host, "bind_physical")
        if (self.v2p_host[host] >= 0).any():
            raise ValueError(
                f"bind_physical: virtual pages {host[self.v2p_host[host] >= 0].tolist()} of "
                f"{self.name!r} are already bound; release them first"
            )
        self.chain.check_in_window(self.name, host, "bind_physical")
        owners = self.chain.owner_slots(self.name, host)
        if not self.chain.reserve({self.name: len(host)}, 0, owners):
            return None
        pages = self.take(len(host))
        self.bind_host(host, pages)
        packed = self.upload(np.concatenate([host, pages]))
        self.write_bind(packed[: len(host)], packed[len(host) :])
        return PhysicalPageIds(packed[len(host) :], self.name)

    def _pages(self, pages: object, what: str) -> np.ndarray:
        data = expect(pages, PhysicalPageIds, what, self.name)
        host = data.detach().cpu().numpy().astype(np.int64)
        if host.ndim != 1 or (host < self.first_page).any() or (host >= self.num_pages).any():
            raise ValueError(
                f"{what}: pages must lie in [{self.first_page}, {self.num_pages}), got {host.tolist()}"
            )
        return host

    def pin(self, pages: PhysicalPageIds) -> None:
        """Pin (n,) live pages (counted): a pinned page is never moved by compaction,
        and if its data is freed meanwhile, the page is not reused before ``unpin``."""
        host = self._pages(pages, "pin")
        if (self.state[host] != LIVE).any():
            raise ValueError(
                f"pin: pages {host[self.state[host] != LIVE].tolist()} of {self.name!r} are not live"
            )
        np.add.at(self.pins, host, 1)
        self.any_pinned = bool(np.count_nonzero(self.pins))

    def unpin(self, pages: PhysicalPageIds) -> None:
        """Undo one ``pin`` per entry; a freed page whose last pin goes becomes a hole
        (unless a fence still holds it)."""
        host = self._pages(pages, "unpin")
        counts = np.bincount(host, minlength=self.num_pages).astype(np.int32)
        if (counts > self.pins).any():
            raise ValueError(
                f"unpin: pages {np.flatnonzero(counts > self.pins).tolist()} are not pinned"
            )
        self.pins -= counts
        self.any_pinned = bool(np.count_nonzero(self.pins))
        done = np.flatnonzero((counts > 0) & (self.pins == 0) & (self.state == PENDING)).astype(
            np.int32
        )
        fenced = self.chain.fences.held(self.name) if self.chain else done[:0]
        done = done[~np.isin(done, fenced)]
        self.state[done] = FREE
        self.num_pending -= len(done)
        self._push(done)
