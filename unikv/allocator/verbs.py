"""The public objects the facade hands out, besides its own verbs:

    alloc.prefix   PrefixVerbs: the prefix cache and its state checkpoints
    alloc.io       IOVerbs: the I/O hooks by virtual page (``unikv.io``)
    alloc.view     AllocatorView: read-only state (roles, lengths, page counts)

Each wraps the parts that implement it, so no caller outside the allocator reads
``alloc.parts``; each mutating verb ends with the facade's debug-mode
``check_integrity`` (``check``: None outside debug mode), as the facade's own do.
Neither is a part: they sit above the tree (``parts.py``), beside the facade.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from unikv.allocator.device import Uploader
from unikv.allocator.integrity import check_chain
from unikv.allocator.mamba import MambaSlots
from unikv.allocator.page_io import PageIO
from unikv.allocator.pages import PageBook
from unikv.allocator.parts import Parts
from unikv.allocator.prefix import PrefixCache, PrefixHit
from unikv.allocator.requests import RequestTable, Roles
from unikv.allocator.room import Room
from unikv.allocator.tables import TableWriter
from unikv.ids import PhysicalPageIds, VirtualPageIds
from unikv.layout import IdMap
from unikv.pool import UnifiedPool

Check = Callable[[], None] | None
Host = TypeVar("Host")


def hand_out(
    pool: UnifiedPool, parts: Parts, debug: bool
) -> tuple[PrefixVerbs, IOVerbs, AllocatorView]:
    """The facade's ``prefix``, ``io`` and ``view`` over ``parts``; ``debug``: their
    mutating verbs end with ``check_integrity`` (a partial over the pool and the
    parts, not a method of the facade: nothing below the facade holds it)."""
    check = partial(check_chain, pool, parts) if debug else None
    return (
        PrefixVerbs(parts.prefix, parts.room, check),
        IOVerbs(parts.io, check),
        AllocatorView(parts.roles, parts.requests, parts.books, parts.mamba, parts.writer),
    )


class PrefixVerbs:
    """Prefix caching (``alloc.prefix``; docs/design.md section 12): ``match`` a
    prompt, pass the hit (``reload``-ed) to ``alloc.new_request(prefix=hit)``,
    ``insert`` a request's written pages, ``checkpoint`` a hybrid request's state,
    read ``counters()``. Each verb's full contract is on ``PrefixCache``."""

    def __init__(self, cache: PrefixCache, room: Room, check: Check = None) -> None:
        self._cache, self._room, self._check = cache, room, check
        self._batching = False

    def _after(self) -> None:
        if self._check is not None and not self._batching:
            self._check()

    @contextmanager
    def batched(self) -> Iterator[None]:
        """The state checkpoints taken inside (``checkpoint``) are bound and copied
        together when it exits: one table write and one envelope copy per step
        instead of one of each per checkpoint (``StateCheckpoints.flush``; anything
        that reads, spills or frees a slot meanwhile flushes first), and the table
        writes of the checkpoints dropped or evicted meanwhile go with it
        (``TableWriter.batch``). Debug-mode checks run once, at the exit."""
        states = self._cache.states
        if states is None or self._batching:
            yield
            return
        self._batching = states.deferring = True
        with self._cache.writer.batch():  # the step's drops and evictions: one write
            try:
                yield
            finally:
                self._batching = states.deferring = False
                states.flush()
                self._after()  # (its check writes what is still staged first)

    def _reserve_host(self, new: Mapping[str, int], virtual: int) -> bool:
        """Room for a host reload: the room maker, without the shortfall callback."""
        return self._room.reserve(new, virtual, callback=False)

    def _reserve_state(self, new: Mapping[str, int]) -> bool:
        """Room for a checkpoint: evicts older checkpoints, never cached pages."""
        return self._room.reserve(new, callback=False, evict_pages=False)

    def match(self, token_ids: object, salt: str | None = None) -> PrefixHit:
        """The longest cached run of whole pages of ``token_ids`` (no state change;
        ``PrefixCache.match``)."""
        return self._cache.match(token_ids, salt)

    def expect(self, token_ids: object, salt: str | None = None) -> int:
        """A waiting request will look ``token_ids`` up: the checkpoint it would
        restore is evicted after the others (``PrefixCache.want``); returns its node id
        (0: none), to pass to ``unexpect`` once the request opens or leaves."""
        return self._cache.want(token_ids, salt)

    def unexpect(self, node_id: int) -> None:
        """Undo ``expect`` (``node_id``: what it returned)."""
        self._cache.unwant(node_id)

    def reload(self, hit: PrefixHit) -> PrefixHit:
        """The hit to pass to ``new_request``: its host pages reloaded (``PrefixCache.reload``)."""
        out = self._cache.reload(hit, self._reserve_host)
        self._after()
        return out

    def uncount(self, hit: PrefixHit) -> None:
        """Take back the lookup counters of an attached hit whose admission was given up."""
        self._cache.uncount(hit)

    def insert(self, slot: int, token_ids: object, salt: str | None = None) -> int:
        """Share request ``slot``'s full pages of ``token_ids``; the pages newly
        cached (``PrefixCache.insert``)."""
        added = self._cache.insert(slot, token_ids, salt)
        self._after()
        return added

    def checkpoint(
        self,
        slot: int,
        token_ids: object,
        salt: str | None = None,
        turn_end: bool = False,
        source: int | None = None,
        supersedes: object = None,
        drop: bool = False,
        junction: bool = False,
    ) -> bool:
        """Copy request ``slot``'s state slot (``source``: the Mamba virtual id of the
        slot holding the state instead, a per-draft-position one) into a checkpoint at
        the last block of ``token_ids``; False when none was taken
        (``PrefixCache.checkpoint``). ``supersedes``: the first tokens of the request's
        own checkpoint this one replaces: it goes first (dropped, ``drop``, or demoted),
        before another is evicted to make room. ``junction``: taken where the prompt
        left a cached run it matched (kept after per-request ones under pressure)."""
        taken = self._cache.checkpoint(
            slot, token_ids, self._reserve_state, salt, turn_end, source, supersedes, drop,
            junction,
        )  # fmt: skip
        self._after()
        return taken

    def share_checkpoint(
        self,
        slot: int,
        token_ids: object,
        at: int,
        salt: str | None = None,
        turn_end: bool = False,
        source: int | None = None,
        previous: int = 0,
        drop: bool = False,
        junction: bool = False,
    ) -> bool:
        """``insert`` of ``token_ids`` and ``checkpoint`` at its first ``at`` tokens in
        one chain walk (``PrefixCache.share_checkpoint``); ``previous``: the tokens of
        the request's own checkpoint this one supersedes (0: none)."""
        taken = self._cache.share_checkpoint(
            slot, token_ids, at, self._reserve_state, salt, turn_end, source, previous, drop,
            junction,
        )  # fmt: skip
        self._after()
        return taken

    def reserve_checkpoint(self, slot: int, tokens: int) -> bool:
        """Reserve the checkpoint slot request ``slot``'s prefill chunk ending at
        ``tokens`` tokens (whole pages) writes its final state into, as a second
        destination (the step plan's ``ckpt_slots``), so the ``checkpoint`` taken
        there after the step needs no copy; False: none (no room, no state slot)."""
        done = self._cache.reserve_checkpoint(slot, tokens, self._reserve_state)
        self._after()
        return done

    def holds_state(self, slot: int) -> bool:
        """Whether request ``slot`` holds its recurrent-state slot (False without a
        Mamba sub-pool)."""
        states = self._cache.states
        if states is None:
            return False
        return bool(states.book.physical(np.array([int(slot) + 1], np.int32))[0] >= 0)

    def reserved_checkpoint(self, slot: int) -> int:
        """The tokens at which request ``slot`` holds a reserved checkpoint slot
        (``reserve_checkpoint``), 0 for none."""
        states = self._cache.states
        held = states.direct.get(int(slot)) if states is not None else None
        return 0 if held is None else held[1]

    def checkpoint_rows(
        self, slots: np.ndarray, ends: np.ndarray, q_indptr: np.ndarray, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, np.ndarray] | None:
        """The checkpoints requests ``slots`` (host ints) reach in a step that ends at
        ``ends`` tokens (their new tokens: ``q_indptr`` (B+1,), host ints), reserved at
        any tokens in ``(start, end]`` (issue 41: a checkpoint inside a chunk): ((rows,)
        int64 device physical slots, 0 the sink
        elsewhere and in padded rows; (rows,) int64 device row of each lane after which
        its state is the checkpoint's, -1 its last, or None when every one is a chunk's
        end; the same rows on the host), or None when no request has one. One copy."""
        states = self._cache.states
        if states is None or not states.direct:  # (the common step: nothing reserved)
            return None
        ends = np.asarray(ends, np.int64)
        found = states.direct_slots(slots, ends, ends - np.diff(q_indptr))
        if found is None:
            return None
        out = np.zeros((2, rows), np.int64)
        out[1] = -1
        out[0, : len(found[0])], out[1, : len(found[1])] = found
        inside = bool((out[1] >= 0).any())
        dev = self._cache.writer.upload(out.reshape(-1) if inside else out[0], wide=True)
        return dev[:rows], (dev[rows:] if inside else None), out[1]

    def demote_checkpoint(
        self,
        token_ids: object,
        drop: bool = False,
        salt: str | None = None,
        slot: int | None = None,
    ) -> None:
        """The checkpoint at the last block of ``token_ids`` goes first (``drop``: now);
        ``slot``: the request whose own first tokens these are (a cheaper lookup)."""
        self._cache.demote_checkpoint(token_ids, drop, salt, slot)
        self._after()

    def ends_turn(self, hit: PrefixHit) -> bool:
        """Whether ``hit`` ends at a decode (turn-end) checkpoint."""
        states = self._cache.states
        return (
            bool(hit.num_tokens) and states is not None and int(hit.nodes[-1]) in states.turn_ends
        )

    @property
    def evicted(self) -> int:
        """Cached pages plus state checkpoints evicted so far (a pressure signal)."""
        states = self._cache.states
        return self._cache.stats.evicted_pages + (states.evicted if states is not None else 0)

    def pool_fractions(self) -> tuple[float, float]:
        """(checkpoints, batch): the fractions of the pool's bytes the cache's state
        checkpoints and the running requests hold (host ints: each book's live pages,
        less the cached pages and the checkpoint slots), for the checkpoint cost rule."""
        cache = self._cache
        books, total = cache.books, self._room.pool.total_bytes
        states = cache.states
        ckpt = 0 if states is None else len(states.by_node) * books[states.book.name].page_bytes
        live = sum(b.num_live * b.page_bytes for b in books.values())
        pages = np.fromiter(cache.by_page, np.int32, len(cache.by_page))
        cached = sum(
            int((books[n].v2p_host[pages] >= 0).sum()) * books[n].page_bytes
            for n in cache.roles.token_names
        )
        return ckpt / total, max(live - cached - ckpt, 0) / total

    def cached_pages(self, name: str) -> int:
        """Pages (Mamba: state slots) of sub-pool ``name`` that only the cache holds:
        evictable cached pages and window bindings, or checkpoints no request restores."""
        cache = self._cache
        states = cache.states
        if states is not None and states.book.name == name:
            return states.num_evictable
        if name not in cache.roles.token_names:
            return 0
        return len(cache.evictable_physical(name))

    def counters(self) -> dict[str, int]:
        """Host-int counters: hits, queries, evictions, checkpoints, ``host_*``."""
        return self._cache.counters()

    def reset(self) -> int:
        """Drop every cached page, checkpoint and host copy no request holds."""
        dropped = self._cache.reset()
        self._after()
        return dropped

    @property
    def host(self) -> Any:
        """The host tier behind the cache (``io/prefix_host.PrefixHost``), or None."""
        return self._cache.host

    def add_host_tier(self, build: Callable[[PrefixCache], Host]) -> Host:
        """Put a host tier behind the cache: ``build(cache)`` makes it
        (``io/prefix_host_setup.enable_prefix_host``); returns it. ValueError on a
        pool the cache does not serve, or when one is attached already."""
        cache = self._cache
        cache.check_supported("enable_prefix_host")
        if cache.host is not None:
            raise ValueError("enable_prefix_host: this allocator's prefix cache has a host tier")
        host = build(cache)
        cache.host = host
        if cache.states is not None:
            cache.states.host = host
        self._after()
        return host


class IOVerbs:
    """The I/O hooks by virtual page (``alloc.io``; ``page_io.PageIO`` has each
    contract): ``physical_pages``, ``release_physical``, ``bind_physical``, ``pin``,
    ``unpin``, ``pinned``."""

    def __init__(self, io: PageIO, check: Check = None) -> None:
        self._io, self._check = io, check

    def _after(self) -> None:
        if self._check is not None:
            self._check()

    def physical_pages(self, name: str, vpages: VirtualPageIds) -> np.ndarray:
        """Physical pages (host int64, -1 = unbound) of ``vpages``, no device sync."""
        return self._io.physical_pages(name, vpages)

    def release_physical(
        self, name: str, vpages: VirtualPageIds, fence: Any = None
    ) -> PhysicalPageIds:
        """Unbind owned, bound ``vpages``; their pages become holes after ``fence``."""
        pages = self._io.release_physical(name, vpages, fence)
        self._after()
        return pages

    def bind_physical(self, name: str, vpages: VirtualPageIds) -> PhysicalPageIds | None:
        """Fresh pages for owned, unbound ``vpages`` (compacting if needed), or None."""
        pages = self._io.bind_physical(name, vpages)
        if pages is not None:
            self._after()
        return pages

    def pin(self, name: str, pages: PhysicalPageIds) -> None:
        """Pin live pages: never moved by compaction, not reused before ``unpin``."""
        self._io.pin(name, pages)
        self._after()

    def unpin(self, name: str, pages: PhysicalPageIds) -> None:
        """Undo one ``pin`` per entry."""
        self._io.unpin(name, pages)
        self._after()

    def pinned(self, name: str, pages: np.ndarray) -> np.ndarray:
        """Whether each of ``pages`` (host ints) of sub-pool ``name`` is pinned (host bools)."""
        return self._io.pinned(name, pages)


class AllocatorView:
    """Read-only state of an allocator (``alloc.view``): no verb changes anything."""

    def __init__(
        self, roles: Roles, requests: RequestTable, books: Mapping[str, PageBook],
        mamba: MambaSlots | None = None, writer: TableWriter | None = None,
    ) -> None:  # fmt: skip
        self._requests, self._books, self._mamba = requests, books, mamba
        self._id_maps = {n: IdMap(b.page_size, b.blocks_per_page) for n, b in books.items()}
        self._writer = writer
        # the allocator's uploader (``device.make_uploader``) or None
        self._upload: Uploader | None = writer.upload if writer is not None else None
        self.roles = roles  # who does what among the sub-pools (a frozen Roles)

    @property
    def mapping_epoch(self) -> int:
        """A count of the allocator's table changes (``TableWriter.epoch``): every verb
        that changes a request's pages (grow, truncate, free, window frees, prefix
        attach and eviction, compaction moves, a resize) moves it on. Block tables and
        write ids built at one epoch are still right at the same epoch (the requests'
        slots and lengths alike). Host int, no sync."""
        return self._writer.epoch if self._writer is not None else -1

    @property
    def draft_k(self) -> int:
        """Per-draft-position state slots per request (0: none; speculation on a
        recurrent model holds k, ``mamba.MambaSlots``)."""
        return self._mamba.k if self._mamba is not None else 0

    def draft_vids(self, slots: np.ndarray) -> np.ndarray:
        """(B, k) int32 Mamba virtual ids of requests ``slots``' draft state slots."""
        if not self.draft_k:
            raise ValueError("draft_vids: this allocator holds no draft state slots")
        assert self._mamba is not None
        return self._mamba.draft_vids(np.asarray(slots, np.int64))

    def token_vids(self, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> torch.Tensor:
        """(sum(counts),) int32 virtual token ids on the device of rows ``starts[i] ..
        starts[i] + counts[i] - 1`` that requests ``slots[i]`` hold already, request by
        request (a gather of ``req_to_token``; e.g. to write a lazy draft's rows)."""
        slots, starts, counts = self._held_rows(slots, starts, counts, "token_vids")
        owners = np.repeat(slots, counts)
        cols = np.arange(owners.size) - np.repeat(np.cumsum(counts) - counts, counts)
        cols += np.repeat(starts, counts)
        table = self._requests.req_to_token
        flat = owners * table.shape[1] + cols
        return table.reshape(-1).index_select(0, self.upload_ids(flat))

    def row_vids(self, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``token_vids``' ids on the host ((sum(counts),) int64, from the host mirror
        of the requests' pages: no device work), for a caller that uploads them with
        other data (a verify step's rows: ``speculative/headroom.HostRows``)."""
        slots, starts, counts = self._held_rows(slots, starts, counts, "row_vids")
        return self._requests.row_token_ids(slots, starts, counts)

    def row_kernel_ids(self, name: str, vids: np.ndarray) -> np.ndarray:
        """(n,) int64 kernel ids of token sub-pool ``name`` for host virtual token ids
        ``vids`` (``row_vids``'), from the host mirror of ``v2p`` (the truth; no device
        work): ``alloc.translate``'s ids, tombstones in the sink page."""
        if name not in self.roles.token_names:
            raise ValueError(
                f"row_kernel_ids: {name!r} is not a token sub-pool; token sub-pools: "
                f"{list(self.roles.token_names)}"
            )
        id_map = self._id_maps[name]  # the contract's arithmetic
        return id_map.kernel_ids_from_virtual(
            np.asarray(vids, np.int64), self._books[name].v2p_host
        )

    def upload_ids(self, array: np.ndarray) -> torch.Tensor:
        """A fresh host integer array as an int32 tensor on the allocator's device
        (CUDA: pinned, enqueued; no host sync)."""
        if self._upload is not None:
            return self._upload(array)
        return torch.from_numpy(np.ascontiguousarray(array, np.int32)).to(
            self._requests.req_to_token.device
        )

    def _held_rows(
        self, slots: object, starts: object, counts: object, what: str
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, starts, counts) as int64 host arrays, ValueError unless every row
        lies below the lengths the requests hold."""
        slots, starts, counts = (np.asarray(a, np.int64) for a in (slots, starts, counts))
        held = self._requests.lens[slots]
        if np.count_nonzero(((held - starts - counts) | starts | counts) < 0):  # (sign bits)
            raise ValueError(
                f"{what}: rows must be held: starts {starts.tolist()} + counts "
                f"{counts.tolist()} within the lengths {held.tolist()}"
            )
        return slots, starts, counts

    def allocated_lens(self, slots: np.ndarray) -> np.ndarray:
        """(B,) int64 tokens each of requests ``slots`` (host ints) holds now: its
        allocated length (``alloc_extend`` raises it, ``truncate`` cuts it), read
        from the host table (a copy; no device read)."""
        return self._requests.lens[np.asarray(slots, np.int64)]

    @property
    def max_context(self) -> int:
        """Tokens a request may hold (the columns of ``req_to_token``)."""
        return self._requests.max_context

    def _book(self, name: str) -> PageBook:
        if name not in self._books:
            raise KeyError(f"no sub-pool {name!r}; the allocator has {list(self._books)}")
        return self._books[name]

    def live_pages(self, name: str) -> int:
        """Pages (Mamba: slots) of sub-pool ``name`` bound now, cached ones included."""
        return self._book(name).num_live

    def page_states(self, name: str) -> np.ndarray:
        """Each page's ``pages.PageState`` in sub-pool ``name``: a read-only host view."""
        view = self._book(name).state.view()
        view.flags.writeable = False
        return view

    def window_lo(self, slot: int, name: str) -> int:
        """The first page column request ``slot`` still holds in windowed sub-pool
        ``name`` (the columns before it left the window)."""
        if name not in self._requests.window_lo:
            raise ValueError(f"window_lo: {name!r} is not a sliding-window sub-pool")
        return int(self._requests.window_lo[name][slot])
