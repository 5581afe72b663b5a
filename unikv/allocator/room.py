"""Making room for an allocation, cheapest first (docs/design.md section 6):

1. holes on each free stack (no band moves);
2. ``Mode.NOW``: move frontiers over free bytes and trailing holes (no page moves);
3. evict superseded (demoted) state checkpoints, then prefix-cache pages no request
   holds, oldest first (``prefix.py``): the shortfall first, retrying 1-2; other
   recurrent-state checkpoints too (``checkpoints.py``) when the Mamba sub-pool is
   short or no page is left, as many as the bytes short need. Room for a new
   checkpoint evicts pages no hit can use (``prefix_evict.dead_pages``) before
   checkpoints, and never other cached pages;
4. ``Mode.AFTER``: order the stream after the forward fences (a device-side wait,
   no host sync: the step planned while the last one runs is not stalled; issue 41),
   move live pages into holes in stream order; if that does not pack either, evict
   twice as many and retry, until none is left;
5. the shortfall callback (``on_shortfall``) evicts from any sub-pool, given
   the joint picture, and the allocator tries again.

``can_admit`` answers 2 and 4 with the same packer (``capacity.pack_bands``),
counting every evictable page and evictable state checkpoint as a hole.
Under pressure ``reserve`` orders after the fences its plan counted on, or says no;
it never asserts on a packing that vanished (issue 16). Idle-time ``compact`` and
``resize`` wait for the fences on the host (slow paths, between steps).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from unikv.allocator import bands
from unikv.allocator.bands import Frame, Mode
from unikv.allocator.compaction import compact_to
from unikv.allocator.fences import FenceQueue
from unikv.allocator.pages import PageBook
from unikv.allocator.prefix import PrefixCache
from unikv.allocator.requests import RequestTable, VirtualSpace
from unikv.allocator.tables import TableWriter
from unikv.pool import UnifiedPool


@dataclass
class Shortfall:
    """The joint picture handed to ``on_shortfall`` (docs/lessons.md bugs 9 and 11).

    demand: new pages asked per sub-pool; virtual: new virtual pages asked;
    usage: per sub-pool ``{live, pending, pinned, free_in_band, page_bytes, band}``;
    free_bytes: bytes inside no band. The callback may free requests of ANY
    sub-pool (a Mamba shortfall may take room from full attention) and returns
    True when it freed something, so the allocator tries again."""

    demand: dict[str, int]
    virtual: int
    virtual_free: int
    usage: dict[str, dict[str, Any]]
    free_bytes: int


class Room:
    """Reserve, admission and compaction over the page books of one pool."""

    def __init__(
        self,
        pool: UnifiedPool,
        books: Mapping[str, PageBook],
        requests: RequestTable,
        vspace: VirtualSpace,
        fences: FenceQueue,
        writer: TableWriter,
        on_shortfall: Callable[[Shortfall], bool] | None,
        max_rounds: int,
        prefix: PrefixCache,
    ) -> None:
        self.pool, self.books, self.requests, self.vspace = pool, books, requests, vspace
        self.fences, self.writer, self.prefix = fences, writer, prefix
        self.on_shortfall, self.max_rounds = on_shortfall, max_rounds
        self.frame = Frame(pool.sink_bytes, pool.total_bytes, pool.band_limits)

    def check_demand(self, demand: Mapping[str, int]) -> dict[str, int]:
        """``demand`` as ``{sub-pool name: new pages}`` of ints, or TypeError/ValueError."""
        if not isinstance(demand, Mapping):
            raise TypeError(f"demand must be a mapping {{sub-pool name: pages}}, got {demand!r}")
        for name, pages in demand.items():
            if name not in self.books:
                raise ValueError(
                    f"demand names sub-pool {name!r}; the allocator has {list(self.books)}"
                )
            if not isinstance(pages, (int, np.integer)) or pages < 0:
                raise ValueError(f"demand[{name!r}] must be a non-negative int, got {pages!r}")
        return {n: int(p) for n, p in demand.items()}

    def drain(self) -> None:
        """Pages whose fences fired become holes."""
        if not len(self.fences):  # nothing held: the common case, no dict built
            return
        for name, pages in self.fences.drain().items():
            self.books[name].release_pending(pages)

    def covers(self, books: Sequence[PageBook], count: int) -> bool:
        """``reserve``'s first test for ``count`` new pages on each of ``books`` and
        ``count`` virtual ids (fired fences drained first): True when the free
        stacks hold them already, so ``reserve`` would return True moving nothing.
        False says nothing (``reserve`` decides, under pressure)."""
        self.drain()
        if count > self.vspace.num_free:
            return False
        for book in books:
            if book.num_free < count:
                return False
        return True

    def _fits_free(self, new: Mapping[str, int], virtual: int) -> bool:
        return virtual <= self.vspace.num_free and all(
            self.books[n].num_free >= k for n, k in new.items()
        )

    def _needs(
        self, new: Mapping[str, int], mode: Mode, evicted: bool = False
    ) -> dict[str, bands.BandNeed]:
        held = reclaim = None
        if mode is Mode.AFTER:
            held = {n: self.fences.held(n, transfer_only=True) for n in self.books}
        if evicted:  # as if every evictable prefix page (and state checkpoint) were evicted
            reclaim = {n: self.prefix.evictable_physical(n) for n in self.prefix.roles.token_names}
            if self.prefix.states is not None:
                reclaim[self.prefix.states.book.name] = self.prefix.states.evictable_physical()
        return bands.band_needs(self.books, self.frame, new, mode, held, reclaim)

    def can_admit(self, new: Mapping[str, int], virtual: int) -> tuple[bool, bool]:
        """(fits now without page moves, fits after compaction); evictable prefix
        pages count as holes (as fenced pages while a forward is in flight)."""
        evictable = self.prefix.num_evictable
        if virtual > self.vspace.num_free + evictable:
            return False, False
        self.drain()
        if virtual <= self.vspace.num_free and (
            self._fits_free(new, 0) or self.frame.pack(self._needs(new, Mode.NOW)) is not None
        ):
            return True, True
        now = self._evictable() and not self.fences.forward_outstanding()  # evicted: holes
        if now and self.frame.pack(self._needs(new, Mode.NOW, evicted=True)) is not None:
            return True, True
        return False, self.frame.pack(self._needs(new, Mode.AFTER, evicted=True)) is not None

    def reserve(
        self,
        new: Mapping[str, int],
        virtual: int = 0,
        slots: np.ndarray | None = None,
        callback: bool = True,
        evict_pages: bool = True,
    ) -> bool:
        """Make each free stack hold ``new[name]`` holes (and the virtual space
        ``virtual`` ids). False, with no page moved, when impossible (evictable
        prefix pages may be gone). ``slots``: the requests being served, which
        the shortfall callback must not free; ``callback=False``: never ask it;
        ``evict_pages=False``: evict state checkpoints only, never cached pages (a
        new checkpoint must not cost the cached prefixes it would extend)."""
        self.drain()
        if self._fits_free(new, virtual):
            return True
        for _ in range(self.max_rounds + 1):
            if self._make_room(new, virtual, evict_pages):
                assert self._fits_free(new, virtual), (
                    "reserve: a feasible plan left free stacks short"
                )
                return True
            if not callback or self.on_shortfall is None:
                return False
            if not self.on_shortfall(self.shortfall(new, virtual)):
                return False
            if slots is not None and not self.requests.in_use[slots].all():
                raise RuntimeError(
                    "the shortfall callback freed a request of the allocation it was called "
                    f"for (slots {slots.tolist()}); evict only requests outside the batch"
                )
            self.drain()
            if self._fits_free(new, virtual):
                return True
        return False

    def _make_room(self, new: Mapping[str, int], virtual: int, evict_pages: bool = True) -> bool:
        """Steps 2-4 of the module docstring; True when the free stacks hold ``new``."""
        if virtual <= self.vspace.num_free and self._grow_now(new):
            return True
        states = self.prefix.states
        while states is not None and states.num_demoted:  # superseded checkpoints first,
            states.evict(1, self.prefix.reachable_many)  # one at a time: a state slot's bytes
            self.drain()
            if self._fits_free(new, virtual) or (
                virtual <= self.vspace.num_free and self._grow_now(new)
            ):
                return True
        batch = self._deficit(new, virtual)
        while True:
            if batch and self._evict(new, batch, evict_pages):
                self.drain()
                if self._fits_free(new, virtual):
                    return True
                if virtual <= self.vspace.num_free and self._grow_now(new):
                    return True
            if virtual <= self.vspace.num_free and self._compact_for(new):
                return True
            if not self._evictable(evict_pages):
                return False
            batch = max(2 * batch, 1)

    def _evictable(self, pages: bool = True) -> int:
        states = self.prefix.states
        held = states.num_evictable if states is not None else 0
        return held + (self.prefix.num_reclaimable if pages else 0)

    def _evict(self, new: Mapping[str, int], batch: int, evict_pages: bool = True) -> bool:
        """Evict ``batch`` cached pages (unless not ``evict_pages``: then only pages
        no hit can use, ``prefix_evict.dead_pages``, a state slot's bytes of them per
        slot short, before any checkpoint), and state checkpoints when the Mamba
        sub-pool is short (``batch`` of them) or no page is left (a ``batch`` of
        pages' bytes: ``_slots_for``), unless the pages took checkpoints with their
        nodes (the caller looks again first); False when nothing was."""
        states = self.prefix.states
        pages = self.prefix.num_reclaimable if evict_pages else 0
        if pages:
            gone = states.evicted if states is not None else 0
            self.writer.stage(self.prefix.evict(batch))  # with the verb's own write
            if states is not None and states.evicted > gone:
                return True  # checkpoints went with their nodes: look again first
        elif states is not None and new.get(states.book.name):
            patch, dead = self.prefix.evict_dead(self._pages_for(new, batch))
            self.writer.stage(patch)
            if dead:
                return True
        if states is not None and states.num_evictable and (new.get(states.book.name) or not pages):
            count = batch if new.get(states.book.name) else self._slots_for(new, batch)
            return bool(states.evict(count, self.prefix.reachable_many)) or bool(pages)
        return bool(pages)

    def _pages_for(self, new: Mapping[str, int], batch: int) -> int:
        """Cached pages (one in each token sub-pool) whose bytes cover ``batch``
        state slots."""
        assert self.prefix.states is not None, "room invariant: state slots need checkpoints"
        states = self.prefix.states.book
        page = sum(b.page_bytes for n, b in self.books.items() if n != states.name)
        return batch * -(-states.page_bytes // page) if page else 0

    def _slots_for(self, new: Mapping[str, int], batch: int) -> int:
        """State checkpoints whose bytes cover ``batch`` pages of each token sub-pool
        of ``new`` (at least one): a checkpoint holds a state slot, tens of pages'
        bytes, so evicting ``batch`` of them for a page shortfall would drop
        checkpoints that later hits need (issue 41: a chat round's admissions evicted
        13 turn ends for a dozen pages)."""
        assert self.prefix.states is not None, "room invariant: state slots need checkpoints"
        slot = self.books[self.prefix.states.book.name].page_bytes
        need = batch * sum(self.books[n].page_bytes for n in new if n in self.books)
        return max(1, -(-need // slot))

    def _deficit(self, new: Mapping[str, int], virtual: int) -> int:
        """Pages to evict first, a lower bound: what holes, fence-held pages and
        the bytes no band holds do not cover."""
        used = sum((b.hi - b.lo) * b.page_bytes for b in self.books.values())
        spare = self.pool.total_bytes - self.pool.sink_bytes - used
        short = [virtual - self.vspace.num_free]
        for name, count in new.items():
            book = self.books[name]
            short.append(count - book.num_free - book.num_pending - spare // book.page_bytes)
        return max(0, *short)

    def _grow_now(self, new: Mapping[str, int]) -> bool:
        found = bands.candidates(self.books, self.frame, self._needs(new, Mode.NOW), new, True)
        if not found:
            return False
        for name, band in found[0].items():
            if band != self.books[name].band:
                self.books[name].set_band(*band)
        return True

    def _compact_for(self, new: Mapping[str, int]) -> bool:
        if self.frame.pack(self._needs(new, Mode.AFTER)) is None:
            return False
        # AFTER counted every page a forward fence holds as free, so order after ALL
        # of them, not only the latest forward: its event may have fired before an
        # older group's (out of order), or since reserve's drain. No host sync: the
        # moves and every later use of those pages run after the forward in stream
        # order (``FenceQueue.order_forward``); the planned step is not stalled
        self._order_forward()
        found = bands.candidates(self.books, self.frame, self._needs(new, Mode.ACTUAL), new, False)
        if not found:  # cannot happen once the fences fired; say no rather than assert
            return False
        compact_to(self.pool, self.books, self.writer, found[0])
        return True

    def _order_forward(self) -> None:
        """Pages the forward fences hold become holes for work enqueued from now on
        (``FenceQueue.order_forward``); fired transfer fences are drained."""
        for name, pages in self.fences.order_forward().items():
            self.books[name].release_pending(pages)
        self.drain()

    def compact(self) -> int:
        """Wait for the forward fences, then pack every band tight. Returns pages moved."""
        self.fences.wait_forward()
        self.drain()
        targets = self.frame.pack(self._needs({}, Mode.ACTUAL))
        assert targets is not None, "compaction: the current occupancy does not pack"
        return compact_to(self.pool, self.books, self.writer, targets)

    # -- resizing an elastic pool (docs/design.md section 4) ----------------------------

    def resize(self, total_bytes: int) -> int:
        """Move the pool's top to ``total_bytes``; returns the pages moved.

        Growing commits the new chunks and the planner sees the room at once: the
        DOWN band may take the new top pages as holes now, any band after
        compaction. Shrinking packs every band below the new top (evicting cached
        prefix pages no request holds only if it must; waiting for the forward
        fences; one envelope copy per live page moved), then releases the chunks
        above. It never frees a page a request holds: when the occupied pages do
        not pack below ``total_bytes`` it raises ValueError with nothing changed
        (beyond draining fences that already fired).
        A slow path (host syncs): call it between steps."""
        pool = self.pool
        pages = pool.check_resize(total_bytes)  # ValueError: nothing changed
        if total_bytes >= pool.total_bytes:
            pool.resize(total_bytes)
            self._regrid(pages)
            return 0
        self.drain()  # fired fences first: their pages are holes, not kept in place
        frame = Frame(pool.sink_bytes, total_bytes)

        def needs(mode: Mode, evicted: bool = False) -> dict[str, bands.BandNeed]:
            got = self._needs({}, mode, evicted)
            return {n: replace(need, num_pages=pages[n]) for n, need in got.items()}

        if frame.pack(needs(Mode.AFTER, evicted=True)) is None:
            raise ValueError(self._refusal(total_bytes, needs(Mode.AFTER, evicted=True)))
        batch = 1
        while frame.pack(needs(Mode.AFTER)) is None:  # cached pages no request holds go
            if not self._evict({}, batch):
                raise RuntimeError("resize: eviction stalled before the bands packed")
            self.drain()
            batch *= 2
        self.fences.wait_forward()  # no forward reads a page while it moves
        self.drain()
        targets = frame.pack(needs(Mode.ACTUAL))
        if targets is None:  # cannot happen once the fences fired
            raise RuntimeError("resize: the occupied pages no longer pack after the fences")
        moved = compact_to(pool, self.books, self.writer, targets)
        self._regrid(pages)
        pool.resize(total_bytes)
        return moved

    def _regrid(self, pages: Mapping[str, int]) -> None:
        """Each book's grid to ``pages[name]`` pages; the writer and the frame follow
        (what a preemption's free left staged is written first, on the old grid)."""
        self.writer.settle()
        for name, book in self.books.items():
            book.resize(pages[name])
            if name in self.writer.p2v_id:
                self.writer.follow(book)
        self.frame = Frame(self.pool.sink_bytes, self.pool.total_bytes, self.pool.band_limits)

    def _may_take(self, total_bytes: int) -> bool:
        """Whether the pool's geometry and floor allow ``total_bytes`` (no state read)."""
        try:
            self.pool.check_resize(total_bytes)
        except ValueError:
            return False
        return True

    def _refusal(self, total_bytes: int, needs: Mapping[str, bands.BandNeed]) -> str:
        """The message of a refused shrink: what is held and the least size that packs."""
        pool = self.pool
        lo, hi = pool.sink_bytes, pool.total_bytes  # hi packs (the pool holds it now)
        while hi - lo > 1:  # the least top that packs (packing is monotone in the top)
            mid = (lo + hi) // 2
            grids = {n: replace(d, num_pages=mid // d.page_bytes) for n, d in needs.items()}
            if self._may_take(mid) and Frame(pool.sink_bytes, mid).pack(grids) is not None:
                hi = mid
            else:
                lo = mid
        held = {n: d.pages for n, d in needs.items()}
        return (
            f"resize: {total_bytes} bytes cannot hold what the running requests need: pages "
            f"{held} (cached prefix pages no request holds counted as free; pinned and "
            f"transfer-held pages stay where they are); the least size that holds them is "
            f"{hi} bytes. Nothing was changed; finish or preempt requests first"
        )

    def shortfall(self, new: Mapping[str, int], virtual: int) -> Shortfall:
        """The joint picture (see :class:`Shortfall`); ``shortfall({}, 0).usage``
        is the usage of every sub-pool."""
        usage = {
            n: {
                "live": b.num_live,
                "pending": b.num_pending,
                "pinned": int((b.pins > 0).sum()),
                "free_in_band": b.num_free,
                "page_bytes": b.page_bytes,
                "band": b.band,
            }
            for n, b in self.books.items()
        }
        used = sum((b.hi - b.lo) * b.page_bytes for b in self.books.values())
        free_bytes = self.pool.total_bytes - self.pool.sink_bytes - used
        return Shortfall(dict(new), virtual, self.vspace.num_free, usage, free_bytes)
