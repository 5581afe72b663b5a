"""The I/O hooks by virtual page (offload, reload, transfers: ``unikv.io``).

release_physical(name, v, fence)   v2p[v] = -1, v stays owned by its request;
                                   its page is PENDING until ``fence`` fired
bind_physical(name, v)             fresh pages for owned, unbound v (compacting
                                   if needed), or None
pin / unpin(name, pages)           a pinned page is never moved by compaction
pinned(name, pages)                which of the pages are pinned (host bools)
physical_pages(name, v)            host lookup of v2p (no device sync)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from unikv.allocator.fences import FenceQueue
from unikv.allocator.pages import LIVE, PageBook
from unikv.allocator.prefix import CACHED
from unikv.allocator.requests import RequestTable, Roles, VirtualSpace
from unikv.allocator.room import Room
from unikv.allocator.tables import TableWriter
from unikv.ids import PhysicalPageIds, VirtualPageIds, expect


class PageIO:
    """I/O verbs over the page books; ``name`` is any sub-pool (Mamba: the virtual
    id of request r is r + 1)."""

    def __init__(
        self,
        roles: Roles,
        requests: RequestTable,
        vspace: VirtualSpace,
        books: Mapping[str, PageBook],
        fences: FenceQueue,
        room: Room,
        writer: TableWriter,
    ) -> None:
        self.roles, self.requests, self.vspace, self.books = roles, requests, vspace, books
        self.fences, self.room, self.writer = fences, room, writer

    def _book(self, name: str, what: str) -> PageBook:
        if name not in self.books:
            raise ValueError(f"{what}: no sub-pool {name!r}; the allocator has {list(self.books)}")
        return self.books[name]

    def _vpages(self, book: PageBook, vpages: object, what: str) -> np.ndarray:
        data = expect(vpages, VirtualPageIds, what)
        host = data.detach().cpu().numpy().astype(np.int32)  # I/O path: may sync
        if host.ndim != 1 or (host < 1).any() or (host >= book.num_virtual).any():
            raise ValueError(
                f"{what}: virtual pages must be a 1-D list in [1, {book.num_virtual}) of "
                f"sub-pool {book.name!r}, got {host.tolist()}"
            )
        if len(np.unique(host)) != len(host):
            raise ValueError(f"{what}: virtual pages must be distinct, got {host.tolist()}")
        return host

    def _pages(self, book: PageBook, pages: object, what: str) -> np.ndarray:
        host = expect(pages, PhysicalPageIds, what, book.name).detach().cpu().numpy()
        host = host.astype(np.int64)
        if host.ndim != 1 or (host < book.first_page).any() or (host >= book.num_pages).any():
            raise ValueError(
                f"{what}: pages must lie in [{book.first_page}, {book.num_pages}), "
                f"got {host.tolist()}"
            )
        return host

    def _check_owned(self, name: str, vpages: np.ndarray, what: str) -> None:
        if name == self.roles.mamba_name:
            slots = vpages - 1
            inside = slots < self.requests.max_requests  # beyond: prefix-cache checkpoints
            unowned = ~inside
            unowned[inside] = ~self.requests.in_use[slots[inside]]
        else:
            cached = self.vspace.owner[vpages] == CACHED
            if cached.any():
                raise ValueError(
                    f"{what}: virtual pages {vpages[cached].tolist()} of {name!r} are shared "
                    "prefix-cache pages; only a request's own pages move through I/O"
                )
            unowned = self.vspace.owner[vpages] < 0
        if unowned.any():
            raise ValueError(
                f"{what}: virtual pages {vpages[unowned].tolist()} of {name!r} belong to no "
                "request (never allocated or already freed)"
            )

    def _owner_slots(self, name: str, vpages: np.ndarray) -> np.ndarray:
        if name == self.roles.mamba_name:
            return (vpages - 1).astype(np.int64)
        return self.vspace.owner[vpages].astype(np.int64)

    def _check_in_window(self, name: str, vpages: np.ndarray, what: str) -> None:
        if name not in self.roles.windows:
            return
        slots = self.vspace.owner[vpages]
        gone = self.vspace.column[vpages] < self.requests.window_lo[name][slots]
        if gone.any():
            raise ValueError(
                f"{what}: virtual pages {vpages[gone].tolist()} of {name!r} left the sliding "
                "window; they are not bound again"
            )

    def physical_pages(self, name: str, vpages: VirtualPageIds) -> np.ndarray:
        """Physical pages (host int64, -1 = unbound) of (n,) distinct virtual pages
        of sub-pool ``name``, from the host mirror (no device sync)."""
        book = self._book(name, "physical_pages")
        return book.physical(self._vpages(book, vpages, "physical_pages")).astype(np.int64)

    def release_physical(
        self, name: str, vpages: VirtualPageIds, fence: Any = None
    ) -> PhysicalPageIds:
        """Unbind (n,) owned, bound virtual pages (v2p = -1; they stay owned by their
        request) and return their physical pages on the device, which become holes
        once ``fence`` (a CUDA event or None) and the forward fence have fired."""
        book = self._book(name, "release_physical")
        host = self._vpages(book, vpages, "release_physical")
        self._check_owned(name, host, "release_physical")
        bound = book.physical(host)
        if (bound < 0).any():
            raise ValueError(
                f"release_physical: virtual pages {host[bound < 0].tolist()} of {name!r} "
                "hold no physical page (released twice, tombstoned or never bound)"
            )
        if (book.pins[bound] > 0).any():
            pinned = bound[book.pins[bound] > 0].tolist()
            raise ValueError(f"release_physical: pages {pinned} are pinned; unpin first")
        pages = self.fences.unbind(book, host, fence)
        self.writer.unbind(book, host, pages)
        return PhysicalPageIds(self.writer.upload(pages.copy()), name)

    def bind_physical(self, name: str, vpages: VirtualPageIds) -> PhysicalPageIds | None:
        """Take holes (compacting if needed) for (n,) owned, unbound virtual pages,
        bind v2p/p2v and return the physical pages on the device; None (state
        unchanged) when the chain cannot make room."""
        book = self._book(name, "bind_physical")
        host = self._vpages(book, vpages, "bind_physical")
        self._check_owned(name, host, "bind_physical")
        if (book.physical(host) >= 0).any():
            raise ValueError(
                f"bind_physical: virtual pages {host[book.physical(host) >= 0].tolist()} of "
                f"{name!r} are already bound; release them first"
            )
        self._check_in_window(name, host, "bind_physical")
        if not self.room.reserve({name: len(host)}, 0, self._owner_slots(name, host)):
            return None
        pages = book.take(len(host))
        book.bind_host(host, pages)
        return PhysicalPageIds(self.writer.bind(book, host, pages), name)

    def pin(self, name: str, pages: PhysicalPageIds) -> None:
        """Pin (n,) live pages (counted): a pinned page is never moved by compaction,
        and if its data is freed meanwhile, the page is not reused before ``unpin``."""
        book = self._book(name, "pin")
        host = self._pages(book, pages, "pin")
        if (book.state[host] != LIVE).any():
            raise ValueError(
                f"pin: pages {host[book.state[host] != LIVE].tolist()} of {name!r} are not live"
            )
        book.pin(host)

    def unpin(self, name: str, pages: PhysicalPageIds) -> None:
        """Undo one ``pin`` per entry; a freed page whose last pin goes becomes a hole
        (unless a fence still holds it)."""
        book = self._book(name, "unpin")
        host = self._pages(book, pages, "unpin")
        counts = np.bincount(host, minlength=book.num_pages).astype(np.int32)
        if (counts > book.pins).any():
            raise ValueError(
                f"unpin: pages {np.flatnonzero(counts > book.pins).tolist()} are not pinned"
            )
        book.unpin(counts, self.fences.held(name))

    def pinned(self, name: str, pages: np.ndarray) -> np.ndarray:
        """Whether each of ``pages`` (host ints) of sub-pool ``name`` is pinned."""
        return self._book(name, "pinned").pins[np.asarray(pages, np.int64)] > 0
