"""The host half of the token verbs: argument checks, reserving, minting and
binding pages, window frees and truncation, staged as a ``TablePatch`` for one
upload and one fused launch (``tables.TableWriter``).

    grow:    reserve -> mint virtual pages -> bind them in every token sub-pool
             -> req_to_token[rows, positions] = virtual token ids
    frees:   unbind (fenced while a forward may read) -> tombstones in v2p, p2v
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from unikv.allocator.fences import FenceQueue
from unikv.allocator.pages import PageBook
from unikv.allocator.prefix import PrefixCache, stage_unbind
from unikv.allocator.requests import RequestTable, Roles, VirtualSpace
from unikv.allocator.room import Room
from unikv.allocator.tables import Part, TablePatch, TableWriter


def ragged(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges ``[starts[i], starts[i] + counts[i])`` (host int64)."""
    total = int(counts.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets


@dataclass
class StagedGrow:
    """A grow staged on the host: the table writes, and the part of ``patch``
    holding the new tokens' virtual ids (int32, request by request)."""

    patch: TablePatch
    token_ids: Part


class Tokens:
    """Token-side bookkeeping verbs over the requests, virtual space and page books."""

    def __init__(
        self,
        roles: Roles,
        requests: RequestTable,
        vspace: VirtualSpace,
        books: dict[str, PageBook],
        fences: FenceQueue,
        room: Room,
        writer: TableWriter,
        prefix: PrefixCache,
    ) -> None:
        self.roles, self.requests, self.vspace, self.books = roles, requests, vspace, books
        self.fences, self.room, self.writer, self.prefix = fences, room, writer, prefix
        self._token_books = [books[n] for n in roles.token_names]  # the fast path's test

    # -- checks ---------------------------------------------------------------------

    def lens(self, slots: np.ndarray, lens: object, what: str, name: str) -> np.ndarray:
        array = np.asarray(lens)
        if array.shape != slots.shape or array.dtype.kind not in "iu":  # integer arrays
            raise ValueError(
                f"{what}: {name} must be a host integer array of shape {slots.shape}, got {lens!r}"
            )
        return array.astype(np.int64, copy=False)  # read only: the verbs never write it

    def check_held(self, slots: np.ndarray, lens: np.ndarray, what: str, name: str) -> None:
        held = self.requests.lens[slots]
        bad = held != lens  # (same shapes: ``lens`` checked them)
        if np.count_nonzero(bad):
            raise ValueError(
                f"{what}: {name} must equal the tokens each request holds; requests "
                f"{slots[bad].tolist()} hold {held[bad].tolist()} but {name} says "
                f"{lens[bad].tolist()}"
            )

    def decode_args(
        self, slots: object, seq_lens: object, what: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """Checked (slots, seq_lens) of a decode verb: open distinct slots, lengths
        equal to the tokens held, none at max_context. Host int64 arrays."""
        slots = self.requests.check_slots(slots, what)
        seq = self.lens(slots, seq_lens, what, "seq_lens")
        self.check_held(slots, seq, what, "seq_lens")
        if (seq >= self.requests.max_context).any():
            raise ValueError(f"{what}: a request is at max_context {self.requests.max_context}")
        return slots, seq

    # -- growing --------------------------------------------------------------------

    def stage_extend(
        self, slots: object, prefix_lens: object, extend_lens: object
    ) -> StagedGrow | None:
        """``alloc_extend``'s host half: a StagedGrow, or None (state unchanged).

        slots, prefix_lens, extend_lens: (B,) host integer arrays; prefix_lens must
        equal the tokens each request holds. Reuses each partly filled tail page;
        the staged patch writes ``req_to_token`` and holds the new virtual token
        ids, (sum ext,) int32, request by request. None when the chain cannot hold
        them even after compaction and the shortfall callback."""
        slots = self.requests.check_slots(slots, "alloc_extend")
        prefix = self.lens(slots, prefix_lens, "alloc_extend", "prefix_lens")
        ext = self.lens(slots, extend_lens, "alloc_extend", "extend_lens")
        self.check_held(slots, prefix, "alloc_extend", "prefix_lens")
        if (ext < 0).any() or (prefix + ext > self.requests.max_context).any():
            raise ValueError(
                f"alloc_extend: extend_lens must be >= 0 and prefix + extend <= max_context "
                f"{self.requests.max_context}, got extend_lens {ext.tolist()}"
            )
        ps = self.roles.page_size
        old, end = -(-prefix // ps), -(-(prefix + ext) // ps)
        count = end - old
        owners, cols = np.repeat(slots, count), ragged(old, count)
        rows, positions = np.repeat(slots, ext), ragged(prefix, ext)
        return self.stage_grow(slots, prefix + ext, owners, cols, rows, positions)

    def stage_decode(self, slots: np.ndarray, seq: np.ndarray) -> StagedGrow | None:
        """One token per request at position ``seq[i]`` (checked by ``decode_args``)."""
        ps = self.roles.page_size
        need = seq % ps == 0
        return self.stage_grow(slots, seq + 1, slots[need], seq[need] // ps, slots, seq)

    def stage_grow(
        self,
        slots: np.ndarray,
        new_lens: np.ndarray,
        owners: np.ndarray,
        cols: np.ndarray,
        rows: np.ndarray,
        positions: np.ndarray,
    ) -> StagedGrow | None:
        """Reserve, mint virtual pages for (owners, cols), bind them in every token
        sub-pool and set the lengths, on the host; the device writes (with
        req_to_token[rows, positions]) are staged. None (state unchanged) when the
        chain cannot hold the new pages."""
        if self.roles.owner is None:
            raise ValueError("this pool has no token sub-pool; use alloc_mamba")
        count, names = len(owners), self.roles.token_names
        # fast path: the free stacks hold the pages already (reserve would move
        # nothing); otherwise reserve makes room, waits, or says no
        if (
            count
            and not self.room.covers(self._token_books, count)
            and not self.room.reserve({n: count for n in names}, count, slots)
        ):
            return None
        patch = TablePatch()
        flat = patch.part(rows * self.requests.max_context + positions)
        if count:  # most decode steps at ps > 1 fill tail pages only
            vpages = self.vspace.mint(owners.astype(np.int32), cols)
            self.requests.pages[owners, cols] = vpages
            v = patch.part(vpages)
            for name in names:
                ppages = self.books[name].take(count)
                self.books[name].bind_host(vpages, ppages)
                p = patch.part(ppages)
                patch.add(self.writer.v2p_id[name], v, p)
                patch.add(self.writer.p2v_id[name], p, v)
        self.requests.lens[slots] = new_lens
        tokens = patch.part(self.requests.token_ids(rows, positions))
        patch.add(TableWriter.REQ_TO_TOKEN, flat, tokens)
        return StagedGrow(patch, tokens)

    # -- freeing --------------------------------------------------------------------

    def _unbind(self, names: tuple[str, ...], vpages: np.ndarray, patch: TablePatch) -> None:
        stage_unbind(self.books, names, self.fences, self.writer, vpages, patch)

    def free_requests(self, slots: object) -> np.ndarray:
        """``free_request``'s token half: checks ``slots`` (an int slot, or host ints of
        distinct open requests; ValueError, nothing changed), then for each in turn
        stages its pages' unbinding and retires them, and closes it. Returns the slots
        (host int64); the caller, inside one ``TableWriter.batch``, frees their Mamba
        slots. Freeing many is freeing each in turn (the same tables, free stacks and
        cache LRU), in one table write."""
        checked = self._free_args(slots)
        for slot in checked.tolist():
            held = self.requests.held_pages(slot)
            self.prefix.release_window(slot, 0, len(held))
            self.writer.stage(self.free_pages(held))
            self.requests.close(slot)
        return checked

    def _free_args(self, slots: object) -> np.ndarray:
        if isinstance(slots, (int, np.integer)):
            if not 0 <= slots < self.requests.max_requests:
                raise ValueError(
                    f"free_request: slot must be an int in [0, {self.requests.max_requests}), "
                    f"got {slots!r}"
                )
            if not self.requests.in_use[slots]:
                raise ValueError(
                    f"free_request: request {slots} is not open (double free or never opened)"
                )
            return np.array([slots], np.int64)
        if isinstance(slots, (bool, float, str)) or slots is None:
            raise ValueError(
                f"free_request: pass an int slot or a 1-D host integer array, got {slots!r}"
            )
        return self.requests.check_slots(slots, "free_request")

    def stage_out_of_window(self, slots: object, seq_lens: object) -> TablePatch:
        """``free_out_of_window``'s host half (checked arguments); the tombstones.

        slots, seq_lens: (B,) host integer arrays, seq_lens <= tokens held; every
        future query of request i sits at position >= seq_lens[i] - 1, so a page
        whose last position is < seq_lens[i] - W is freed (tombstones; the owner's
        virtual pages live on). Decode: pass the lengths including the token being
        computed; chunked prefill: the prefix length + 1 (or call after the chunk's
        forward)."""
        slots = self.requests.check_slots(slots, "free_out_of_window")
        seq = self.lens(slots, seq_lens, "free_out_of_window", "seq_lens")
        if (seq > self.requests.lens[slots]).any() or (seq < 0).any():
            raise ValueError("free_out_of_window: seq_lens must lie in [0, tokens held]")
        patch = TablePatch()
        self.stage_window_frees(slots, seq, patch)
        return patch

    def free_pages(self, vpages: np.ndarray) -> TablePatch:
        """A request gives up ``vpages`` (its virtual pages, block order): cached
        ones lose a reference; its own are unbound everywhere and retired."""
        patch = TablePatch()
        private = self.prefix.release(vpages)
        self._unbind(self.roles.token_names, private, patch)
        self.vspace.retire(private)
        return patch

    def stage_window_frees(self, slots: np.ndarray, seq: np.ndarray, patch: TablePatch) -> None:
        """Unbind the pages of windowed sub-pools that no query at position
        >= seq[i] - 1 can see; stage their tombstones in ``patch``."""
        ps = self.roles.page_size
        for name, window in self.roles.windows.items():
            first = self.requests.window_lo[name]
            lo = first[slots]
            # pages [lo, (seq - W) // ps) leave; that bound stays below the pages held
            # (seq <= tokens held, W >= 1), so no clamp to the held pages is needed
            gone = np.maximum((seq - window) // ps - lo, 0)
            if not np.count_nonzero(gone):
                continue
            if np.count_nonzero(gone > 1):  # ragged: several pages of some request
                vpages = self.requests.page_ids(np.repeat(slots, gone), ragged(lo, gone))
            else:  # decode: at most one page per request leaves
                leaving = np.flatnonzero(gone)
                vpages = self.requests.page_ids(slots[leaving], lo[leaving])
            # a cached page loses this request's hold; at none the binding is the
            # cache's, evictable alone (prefix.py); private pages are unbound now
            cached = self.prefix.is_cached(vpages)
            self.prefix.leave_window(name, vpages[cached])
            self._unbind((name,), vpages[~cached], patch)
            first[slots] = lo + gone

    def stage_truncate(self, slots: object, new_lens: object) -> TablePatch:
        """``truncate``'s host half (see the facade); returns the tombstone writes."""
        slots = self.requests.check_slots(slots, "truncate")
        keep = self.lens(slots, new_lens, "truncate", "new_lens")
        ps = self.roles.page_size
        if (keep < 0).any() or (keep > self.requests.lens[slots]).any():
            raise ValueError("truncate: new_lens must lie in [0, tokens held]")
        lo, hi = -(-keep // ps), self.requests.num_pages(slots)
        cut = keep % ps != 0  # the page keep // ps stays partly filled and is written next
        cut[cut] = self.prefix.is_cached(self.requests.page_ids(slots[cut], keep[cut] // ps))
        if cut.any():
            raise ValueError(
                f"truncate: new_lens {keep[cut].tolist()} of requests {slots[cut].tolist()} cut "
                f"into shared prefix-cache pages (read-only); keep a multiple of {ps} tokens"
            )
        for name, window in self.roles.windows.items():
            # the next token (position keep) is written on page keep // ps and its
            # query reads from position keep + 1 - W: kept pages from there on must
            # still be bound: not freed out of this request's window, and, for shared
            # prefix pages it opened with, not freed in the request that cached them
            first = np.maximum(keep + 1 - window, 0) // ps
            freed = self.requests.window_lo[name][slots]
            bad = (first < lo) & (freed > first)
            reads = np.maximum(lo - first, 0)
            vpages = self.requests.page_ids(np.repeat(slots, reads), ragged(first, reads))
            lost = self.prefix.is_cached(vpages) & (self.books[name].physical(vpages) < 0)
            bad[np.repeat(np.arange(len(slots)), reads)[lost]] = True
            if bad.any():
                raise ValueError(
                    f"truncate: new_lens {keep[bad].tolist()} of requests {slots[bad].tolist()} "
                    f"keep pages of {name!r} already freed out of the window (by this request, "
                    f"or by the one that cached them): the next query would read freed keys "
                    f"from position {(keep[bad] + 1 - window).tolist()} on; keep more tokens "
                    "(a cut whose window is still bound), or none"
                )
        for slot, start, end in zip(slots.tolist(), lo.tolist(), hi.tolist()):
            self.prefix.release_window(slot, start, end)  # the cut pages' window holds
        for name in self.roles.windows:  # no kept page lies beyond the freed ones
            window_lo = self.requests.window_lo[name]
            window_lo[slots] = np.minimum(window_lo[slots], lo)
        patch = self.free_pages(
            self.requests.page_ids(np.repeat(slots, hi - lo), ragged(lo, hi - lo))
        )
        self.requests.lens[slots] = keep
        return patch

    def demand_for(self, slots: object, extend_lens: object) -> dict[str, int]:
        """New pages per token sub-pool that ``alloc_extend(slots, held, extend_lens)`` needs."""
        slots = self.requests.check_slots(slots, "demand_for")
        ext = self.lens(slots, extend_lens, "demand_for", "extend_lens")
        ps, held = self.roles.page_size, self.requests.lens[slots]
        pages = int((-(-(held + ext) // ps) - (-(-held // ps))).sum())
        return {name: pages for name in self.roles.token_names}

    def request_footprint(self, slot: int) -> dict[str, int]:
        """Physical pages request ``slot`` holds per sub-pool (for eviction choices)."""
        return {name: len(cols) for name, (cols, _) in self.request_pages(slot).items()}

    def request_pages(self, slot: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per sub-pool: (page columns request ``slot`` still holds, their physical
        pages), host int64, ascending columns; a sliding-window sub-pool leaves out
        the columns that left the window; the Mamba sub-pool gives the request's
        state slot as column 0, if it holds one (for transfers and offload: a
        request's state travels with its pages). Shared prefix pages below the
        window stay bound while cached (``stage_window_frees``) but are left out:
        the request no longer reads them, and a readmission does not hold them."""
        vpages = self.requests.held_pages(slot)
        out = {}
        for name in self.roles.token_names:
            physical = self.books[name].physical(vpages).astype(np.int64)
            if name in self.roles.windows:
                physical[: self.requests.window_lo[name][slot]] = -1
            cols = np.flatnonzero(physical >= 0)
            out[name] = (cols, physical[cols])
        if self.roles.mamba_name is not None:
            physical = self.books[self.roles.mamba_name].physical(np.array([slot + 1], np.int32))
            physical = physical.astype(np.int64)
            cols = np.flatnonzero(physical >= 0)
            out[self.roles.mamba_name] = (cols, physical[cols])
        return out
