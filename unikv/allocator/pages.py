"""One sub-pool's pages: host v2p/p2v mirrors, a band with holes, a free stack.

    page:   0 .. first_page-1 | first_page ........................ num_pages-1
            sink (never given)  OUT ... | band: LIVE/FREE/PENDING | ... OUT

- ``v2p[v]`` (virtual page -> physical page, -1 = tombstone) and ``p2v[p]`` are
  inverse on LIVE pages; entry 0 of both is pinned to 0 (the sink).
- Every LIVE or PENDING page lies in the band ``[lo, hi)``; every FREE page (a
  hole) lies in it too and sits exactly once on the free stack; OUT pages lie
  outside it. Bands of different sub-pools are byte-disjoint (kept by the chain).
- The host mirrors (numpy) are the truth. ``PageBook`` holds the device tables
  ``v2p``/``p2v`` (int32) but never writes them: the table writer does
  (``tables.py``), from the host arrays the verbs here return.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from unikv.pool import Grow, SubPool


class PageState(IntEnum):
    """State of one physical page (``PageBook.state``, int8)."""

    OUT = 0  # outside the band
    FREE = 1  # a hole: on the free stack
    LIVE = 2  # bound to a virtual page
    PENDING = 3  # freed, but a fence or a pin holds it


OUT, FREE, LIVE, PENDING = PageState.OUT, PageState.FREE, PageState.LIVE, PageState.PENDING
_LIVE = int(LIVE)  # a plain int: numpy stores it without the enum's conversion


class PageBook:
    """Page bookkeeping of one sub-pool. ``num_virtual`` sizes ``v2p``: the id
    owner's virtual page space (docs/lessons.md bug 10), or request slots + 1 for Mamba."""

    def __init__(self, subpool: SubPool, num_virtual: int, device: torch.device) -> None:
        self.name = subpool.name
        self.grow = subpool.grow
        self.page_size = subpool.page_size
        self.page_bytes = subpool.page_bytes
        self.first_page = subpool.first_page
        self.num_pages = subpool.num_pages
        self.blocks_per_page = subpool.spec.blocks_per_page or 1
        self.num_virtual = num_virtual
        self.v2p_host = np.full(num_virtual, -1, np.int32)
        self.p2v_host = np.full(self.num_pages, -1, np.int32)
        self.v2p_host[0] = self.p2v_host[0] = 0  # the sink
        self.state = np.full(self.num_pages, OUT, np.int8)
        self.pins = np.zeros(self.num_pages, np.int32)
        self.any_pinned = False  # whether any entry of pins is > 0 (skips a gather per free)
        self.num_live = 0
        self.num_pending = 0
        self.stack = np.zeros(self.num_pages, np.int32)  # holes in [0, num_free); pop the end
        self.num_free = 0
        start = self.num_pages if self.grow == Grow.DOWN else self.first_page
        self.lo = self.hi = start
        self.v2p = torch.from_numpy(self.v2p_host.copy()).to(device)  # (V,) int32 device
        # (max_pages,) int32 device, allocated once for the largest grid of an elastic
        # pool; ``p2v`` is its first num_pages entries (the rest stay -1)
        self.p2v_all = torch.full((subpool.max_pages,), -1, dtype=torch.int32, device=device)
        self.p2v_all[0] = 0
        self.p2v = self.p2v_all[: self.num_pages]

    # -- lookups ------------------------------------------------------------------

    def physical(self, vpages: np.ndarray) -> np.ndarray:
        """Physical pages (host int32, -1 = unbound) of host virtual pages."""
        return self.v2p_host[vpages]

    def free_ids(self) -> np.ndarray:
        """The holes on the free stack (a view; pop order is from the end)."""
        return self.stack[: self.num_free]

    @property
    def band(self) -> tuple[int, int]:
        return self.lo, self.hi

    # -- free stack -----------------------------------------------------------------

    def take(self, count: int) -> np.ndarray:
        """Pop ``count`` holes (the caller made sure there are enough)."""
        assert count <= self.num_free, (
            f"free stack of {self.name!r} short: {count} > {self.num_free}"
        )
        self.num_free -= count
        return self.stack[self.num_free : self.num_free + count].copy()

    def take_these(self, pages: np.ndarray) -> None:
        """Remove the given holes (host int32) from the free stack (compaction targets)."""
        stack = self.stack[: self.num_free]
        keep = stack[~np.isin(stack, pages)]
        self.num_free = 0
        self._push(keep)

    def _push(self, pages: np.ndarray) -> None:
        self.stack[self.num_free : self.num_free + len(pages)] = pages
        self.num_free += len(pages)

    def _push_under(self, pages: np.ndarray) -> None:
        """Put ``pages`` beneath the holes already on the stack (they pop last)."""
        n = len(pages)
        if n:
            self.stack[n : self.num_free + n] = self.stack[: self.num_free].copy()
            self.stack[:n] = pages
            self.num_free += n

    # -- binding (host only; the table writer writes the device tables) ----------------

    def bind_host(self, vpages: np.ndarray, ppages: np.ndarray) -> None:
        """v2p[vpages] = ppages, p2v[ppages] = vpages; ppages were taken."""
        self.v2p_host[vpages] = ppages
        self.p2v_host[ppages] = vpages
        self.state[ppages] = _LIVE
        self.num_live += len(ppages)

    def exchange_host(self, va: np.ndarray, vb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Swap the physical pages of bound virtual pages ``va[i]`` and ``vb[i]`` (host
        int32, disjoint); returns their pages before, (pa, pb). Nothing is freed or
        taken; the caller writes v2p/p2v on the device."""
        pa, pb = self.v2p_host[va], self.v2p_host[vb]
        assert (pa > 0).all() and (pb > 0).all(), f"{self.name!r}: exchanging unbound pages"
        self.v2p_host[va], self.v2p_host[vb] = pb, pa
        self.p2v_host[pb], self.p2v_host[pa] = va, vb
        return pa, pb

    def unbind_host(self, vpages: np.ndarray, held: bool) -> np.ndarray:
        """Unbind bound virtual pages (host int32, v2p > 0) and return their physical
        pages. ``held``: a fence holds them (PENDING until ``release_pending``);
        otherwise they become holes, except pinned ones (PENDING until unpinned).
        The caller tombstones ``v2p[vpages]`` and ``p2v[returned]`` on the device."""
        ppages = self.v2p_host[vpages]
        if len(vpages) == 0:
            return ppages
        assert not np.count_nonzero(ppages <= 0), f"{self.name!r}: unbinding unbound virtual pages"
        self.v2p_host[vpages] = -1
        self.p2v_host[ppages] = -1
        self.num_live -= len(ppages)
        if not held and not self.any_pinned:  # the common case: every page becomes a hole
            self.state[ppages] = FREE
            self._push(ppages)
            return ppages
        hold = np.ones(len(ppages), bool) if held else self.pins[ppages] > 0
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

    def pin(self, pages: np.ndarray) -> None:
        """Count one pin per entry of ``pages`` (host int64, LIVE pages)."""
        np.add.at(self.pins, pages, 1)
        self.any_pinned = bool(np.count_nonzero(self.pins))

    def unpin(self, counts: np.ndarray, fenced: np.ndarray) -> None:
        """Remove ``counts`` (num_pages,) pins; freed pages whose last pin goes and
        that no fence holds (``fenced``: pages the fence queue holds) become holes."""
        self.pins -= counts
        self.any_pinned = bool(np.count_nonzero(self.pins))
        done = np.flatnonzero((counts > 0) & (self.pins == 0) & (self.state == PENDING))
        done = done[~np.isin(done, fenced)].astype(np.int32)
        self.state[done] = FREE
        self.num_pending -= len(done)
        self._push(done)

    def apply_moves(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Rewrite the host tables after the envelopes of ``src`` were copied to
        ``dst`` (host int32; dst were taken off the stack). Returns the moved
        virtual pages (the caller writes v2p[vpages] = dst, p2v[dst] = vpages,
        p2v[src] = -1 on the device)."""
        assert (self.state[src] == LIVE).all() and (self.pins[src] == 0).all(), (
            f"{self.name!r}: compaction may only move unpinned live pages"
        )
        vpages = self.p2v_host[src]
        self.p2v_host[src] = -1
        self.p2v_host[dst] = vpages
        self.v2p_host[vpages] = dst
        self.state[src] = FREE
        self.state[dst] = LIVE
        return vpages

    # -- the grid (an elastic pool's resize) -------------------------------------------

    def resize(self, num_pages: int) -> None:
        """Make the grid ``num_pages`` pages long (host arrays re-sized, ``p2v`` a new
        view of ``p2v_all``). A shrink needs every page it cuts off OUT (the band
        already below it). Host work, never on the per-step path."""
        old = self.num_pages
        if self.lo == self.hi:  # an empty band has no position: the DOWN one waits at the top
            self.lo = self.hi = num_pages if self.grow == Grow.DOWN else min(self.lo, num_pages)
        assert self.first_page < num_pages <= len(self.p2v_all), (
            f"{self.name!r}: grid of {num_pages} pages off the reservation"
        )
        assert num_pages >= old or (self.hi <= num_pages and not self.state[num_pages:].any()), (
            f"{self.name!r}: a shrink to {num_pages} pages cuts off pages of the band"
        )
        keep = min(old, num_pages)

        def fit(array: np.ndarray, fill: int) -> np.ndarray:
            out = np.full(num_pages, fill, array.dtype)
            out[:keep] = array[:keep]
            return out

        self.p2v_host, self.state, self.pins = (
            fit(self.p2v_host, -1),
            fit(self.state, OUT),
            fit(self.pins, 0),
        )
        self.stack = fit(self.stack, 0)  # the holes lie in the band, below both sizes
        self.num_pages = num_pages
        self.p2v = self.p2v_all[:num_pages]

    # -- band ------------------------------------------------------------------

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
