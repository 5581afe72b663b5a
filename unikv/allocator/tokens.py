"""Token verbs of the PoolAllocator: allocate for prefill and decode, free.

Host numpy throughout (vectorised, no Python loop over requests); each verb
ends with ONE upload and ONE fused table write (``table_update.update_tables``):

    upload = [header | req_to_token flat index | token ids | vpages | ppages(sub 1) | ...]

Ragged per-request ranges are expanded with ``_ragged`` (repeat + arange).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from unikv.allocator.device import pack_updates
from unikv.ids import VirtualTokenIds


def _ragged(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``range(starts[i], starts[i] + counts[i])`` (host int64)."""
    total = int(counts.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets


class TokenVerbs:
    """Mixed into PoolAllocator (uses its requests, vspace, subs, reserve, upload)."""

    def new_request(self) -> int:
        """Open a request slot (host int) with no tokens."""
        slot = self.requests.open()
        if slot is None:
            raise ValueError(
                f"all {self.requests.max_requests} request slots are open; free a request "
                "or raise max_requests"
            )
        return slot

    def _lens(self, slots: np.ndarray, lens: object, what: str, name: str) -> np.ndarray:
        array = np.asarray(lens)
        if array.shape != slots.shape or array.dtype.kind not in "iu":  # integer arrays
            raise ValueError(
                f"{what}: {name} must be a host integer array of shape {slots.shape}, got {lens!r}"
            )
        return array.astype(np.int64)

    def demand_for(self, slots: object, extend_lens: object) -> dict[str, int]:
        """New pages per sub-pool that ``alloc_extend(slots, lens, extend_lens)`` needs."""
        slots = self.requests.check_slots(slots, "demand_for")
        ext = self._lens(slots, extend_lens, "demand_for", "extend_lens")
        ps, held = self.page_size, self.requests.lens[slots]
        pages = int((-(-(held + ext) // ps) - (-(-held // ps))).sum())
        return {name: pages for name in self.token_names}

    def alloc_extend(
        self, slots: object, prefix_lens: object, extend_lens: object
    ) -> VirtualTokenIds | None:
        """Allocate ``extend_lens[i]`` tokens after ``prefix_lens[i]`` for each request.

        slots, prefix_lens, extend_lens: (B,) host integer arrays; prefix_lens must
        equal the tokens each request holds. Reuses each partly filled tail page,
        writes ``req_to_token`` and returns the new virtual token ids, (sum ext,)
        int32 on the device, request by request. None (state unchanged) when the
        chain cannot hold them even after compaction and the shortfall callback."""
        slots = self.requests.check_slots(slots, "alloc_extend")
        prefix = self._lens(slots, prefix_lens, "alloc_extend", "prefix_lens")
        ext = self._lens(slots, extend_lens, "alloc_extend", "extend_lens")
        self._check_held(slots, prefix, "alloc_extend", "prefix_lens")
        if (ext < 0).any() or (prefix + ext > self.requests.max_context).any():
            raise ValueError(
                f"alloc_extend: extend_lens must be >= 0 and prefix + extend <= max_context "
                f"{self.requests.max_context}, got extend_lens {ext.tolist()}"
            )
        ps = self.page_size
        old, end = -(-prefix // ps), -(-(prefix + ext) // ps)
        count = end - old
        owners = np.repeat(slots, count)
        cols = _ragged(old, count)
        rows = np.repeat(slots, ext)
        positions = _ragged(prefix, ext)
        return self._grow(slots, prefix + ext, owners, cols, rows, positions)

    def alloc_decode(self, slots: object, seq_lens: object) -> VirtualTokenIds | None:
        """One new token per request at position ``seq_lens[i]`` (the length BEFORE
        it). slots, seq_lens: (B,) host integer arrays. Returns (B,) int32 virtual
        token ids on the device, or None (state unchanged)."""
        slots, seq = self._decode_args(slots, seq_lens, "alloc_decode")
        need = seq % self.page_size == 0
        return self._grow(slots, seq + 1, slots[need], seq[need] // self.page_size, slots, seq)

    def _decode_args(self, slots: object, seq_lens: object, what: str):
        """Checked (slots, seq_lens) of a decode verb: open distinct slots, lengths
        equal to the tokens held, none at max_context. Host int64 arrays."""
        slots = self.requests.check_slots(slots, what)
        seq = self._lens(slots, seq_lens, what, "seq_lens")
        self._check_held(slots, seq, what, "seq_lens")
        if (seq >= self.requests.max_context).any():
            raise ValueError(f"{what}: a request is at max_context {self.requests.max_context}")
        return slots, seq

    def _check_held(self, slots: np.ndarray, lens: np.ndarray, what: str, name: str) -> None:
        held = self.requests.lens[slots]
        if not np.array_equal(held, lens):
            raise ValueError(
                f"{what}: {name} must equal the tokens each request holds; requests "
                f"{slots[held != lens].tolist()} hold {held[held != lens].tolist()} but "
                f"{name} says {lens[held != lens].tolist()}"
            )

    def _grow(self, slots, new_lens, owners, cols, rows, positions) -> VirtualTokenIds | None:
        """Mint virtual pages for (owners, cols), bind them in every token sub-pool,
        set the lengths and write req_to_token[rows, positions]."""
        staged = self._stage_grow(slots, new_lens, owners, cols, rows, positions)
        if staged is None:
            return None
        arrays, segments = staged
        packed, num, n = self._write_tables(arrays, segments)
        self._after_verb()
        start = 4 * num + n  # after the header and the flat req_to_token indices
        return VirtualTokenIds(packed[start : start + n])

    def _stage_grow(self, slots, new_lens, owners, cols, rows, positions):
        """The host half of ``_grow``: reserve, mint, bind on the host, set lengths.
        Returns ``(arrays, segments)`` for ``pack_updates`` over ``_grow_tables``
        (arrays[0]: flat req_to_token indices, arrays[1]: token ids), or None
        (state unchanged) when the chain cannot hold the new pages."""
        if self.owner is None:
            raise ValueError("this pool has no token sub-pool; use alloc_mamba")
        count = len(owners)
        if count and not self.reserve({n: count for n in self.token_names}, count, slots):
            return None
        arrays: list[np.ndarray] = [rows * self.requests.max_context + positions, None]
        segments = [(0, 0, 1)]  # req_to_token[flat] = tokens
        if count:  # most decode steps at ps > 1 fill tail pages only
            vpages = self.vspace.mint(owners.astype(np.int32), cols)
            self.requests.pages[owners, cols] = vpages
            arrays.append(vpages)
            for i, name in enumerate(self.token_names):
                ppages = self.subs[name].take(count)
                self.subs[name].bind_host(vpages, ppages)
                arrays.append(ppages)  # v2p[vpages] = ppages, p2v[ppages] = vpages
                segments += [(1 + 2 * i, 2, 3 + i), (2 + 2 * i, 3 + i, 2)]
        self.requests.lens[slots] = new_lens
        arrays[1] = self.requests.token_ids(rows, positions)
        return arrays, segments

    def _write_tables(self, arrays: list, segments: list) -> tuple:
        """One upload and one fused launch of staged ``_grow_tables`` writes.
        Returns (the packed device array, its number of segments, len(arrays[0]))."""
        packed, num, max_count = pack_updates(arrays, segments)
        packed = self.upload(packed)
        self._ops.update_tables(self._grow_tables, packed, num, max_count)
        return packed, num, len(arrays[0])

    def _after_verb(self) -> None:
        if self.debug:
            self.check_integrity()

    # -- freeing ------------------------------------------------------------------------

    def _unbind_bound(self, name: str, vpages: np.ndarray) -> None:
        sub = self.subs[name]
        sub.unbind(vpages[sub.v2p_host[vpages] >= 0])

    def free_request(self, slot: int) -> None:
        """Free every page of request ``slot`` (all sub-pools) and close the slot."""
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.requests.max_requests:
            raise ValueError(
                f"free_request: slot must be an int in [0, {self.requests.max_requests}), got {slot!r}"
            )
        if not self.requests.in_use[slot]:
            raise ValueError(
                f"free_request: request {slot} is not open (double free or never opened)"
            )
        vpages = self.requests.pages[
            slot, : int(self.requests.num_pages(np.array([slot]))[0])
        ].copy()
        for name in self.token_names:
            self._unbind_bound(name, vpages)
        self.vspace.retire(vpages)
        if self.mamba_name is not None:
            self._unbind_bound(self.mamba_name, np.array([slot + 1], np.int32))
        self.requests.close(int(slot))
        self._after_verb()

    def free_out_of_window(self, slots: object, seq_lens: object) -> None:
        """Free the sliding-window pages that no future query can see (tombstones;
        the owner's virtual pages live on).

        slots, seq_lens: (B,) host integer arrays, seq_lens <= tokens held; every
        future query of request i sits at position >= seq_lens[i] - 1, so a page
        whose last position is < seq_lens[i] - W is freed. Decode: pass the
        lengths including the token being computed; chunked prefill: the prefix
        length + 1 (or call after the chunk's forward)."""
        slots = self.requests.check_slots(slots, "free_out_of_window")
        seq = self._lens(slots, seq_lens, "free_out_of_window", "seq_lens")
        if (seq > self.requests.lens[slots]).any() or (seq < 0).any():
            raise ValueError("free_out_of_window: seq_lens must lie in [0, tokens held]")
        arrays, segments = [], []
        self._stage_window_frees(slots, seq, arrays, segments)
        if segments:
            self._write_tables(arrays, segments)
        self._after_verb()

    def _stage_window_frees(
        self, slots: np.ndarray, seq: np.ndarray, arrays: list, segments: list
    ) -> None:
        """The host half of ``free_out_of_window``: unbind on the host and append the
        tombstone writes of ``v2p`` and ``p2v`` to (arrays, segments) of ``_grow_tables``."""
        for name, window in self.windows.items():
            first = self.requests.window_lo[name]
            lo = first[slots]
            # pages [lo, (seq - W) // ps) leave; that bound stays below the pages held
            # (seq <= tokens held, W >= 1), so no clamp to the held pages is needed
            gone = np.maximum((seq - window) // self.page_size - lo, 0)
            if not np.count_nonzero(gone):
                continue
            hi = lo + gone
            requests = self.requests
            if np.count_nonzero(gone > 1):  # ragged: several pages of some request
                flat = np.repeat(slots * requests.max_pages, gone) + _ragged(lo, gone)
            else:  # decode: at most one page per request leaves
                leaving = np.flatnonzero(gone)
                flat = slots[leaving] * requests.max_pages + lo[leaving]
            vpages = requests._pages_flat[flat]
            sub = self.subs[name]
            vpages = vpages[sub.v2p_host[vpages] >= 0]  # I/O may have released some
            ppages = sub.unbind_host(vpages)
            if len(ppages):
                table, at = 1 + 2 * self.token_names.index(name), len(arrays)
                arrays += [vpages, ppages]
                segments += [(table, at, -1), (table + 1, at + 1, -1)]  # tombstones
            first[slots] = hi

    def truncate(self, slots: object, new_lens: object) -> None:
        """Free the tokens of each request beyond ``new_lens[i]`` (whole pages past
        the new tail). slots, new_lens: (B,) host integer arrays."""
        slots = self.requests.check_slots(slots, "truncate")
        keep = self._lens(slots, new_lens, "truncate", "new_lens")
        ps = self.page_size
        if (keep < 0).any() or (keep > self.requests.lens[slots]).any():
            raise ValueError("truncate: new_lens must lie in [0, tokens held]")
        lo, hi = -(-keep // ps), self.requests.num_pages(slots)
        for name, window in self.windows.items():
            # the next token (position keep) is written on page keep // ps and its
            # query reads from position keep + 1 - W: kept pages from there on must
            # still be bound, i.e. not yet freed out of the window
            first = np.maximum(keep + 1 - window, 0) // ps
            freed = self.requests.window_lo[name][slots]
            bad = (first < lo) & (freed > first)
            if bad.any():
                raise ValueError(
                    f"truncate: new_lens {keep[bad].tolist()} of requests {slots[bad].tolist()} "
                    f"cut into pages of {name!r} already freed out of the window (the first "
                    f"{freed[bad].tolist()} pages): the next query would read freed keys; "
                    f"keep at least {(freed[bad] * ps + window - 1).tolist()} tokens or none"
                )
        for name in self.windows:  # no kept page lies beyond the freed ones
            self.requests.window_lo[name][slots] = np.minimum(
                self.requests.window_lo[name][slots], lo
            )
        vpages = self.requests.pages[np.repeat(slots, hi - lo), _ragged(lo, hi - lo)]
        for name in self.token_names:
            self._unbind_bound(name, vpages)
        self.vspace.retire(vpages)
        self.requests.lens[slots] = keep
        self._after_verb()

    def request_footprint(self, slot: int) -> dict[str, int]:
        """Physical pages request ``slot`` holds per sub-pool (for eviction choices)."""
        vpages = self.requests.pages[slot, : int(self.requests.num_pages(np.array([slot]))[0])]
        out = {n: int((self.subs[n].v2p_host[vpages] >= 0).sum()) for n in self.token_names}
        if self.mamba_name is not None:
            out[self.mamba_name] = int(self.subs[self.mamba_name].v2p_host[slot + 1] >= 0)
        return out

    def request_pages(self, slot: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per sub-pool: (page columns request ``slot`` still holds, their
        physical pages), host int64, ascending columns; a sliding-window sub-pool
        leaves out the columns that left the window; the Mamba sub-pool gives the
        request's state slot as column 0, if it holds one (for transfers and
        offload: a request's state travels with its pages)."""
        vpages = self.requests.pages[slot, : int(self.requests.num_pages(np.array([slot]))[0])]
        out = {}
        for name in self.token_names:
            physical = self.subs[name].v2p_host[vpages].astype(np.int64)
            cols = np.flatnonzero(physical >= 0)
            out[name] = (cols, physical[cols])
        if self.mamba_name is not None:
            physical = self.subs[self.mamba_name].v2p_host[[slot + 1]].astype(np.int64)
            cols = np.flatnonzero(physical >= 0)
            out[self.mamba_name] = (cols, physical[cols])
        return out

    def usage(self) -> Mapping[str, dict[str, int]]:
        """Live, pending and free pages and band per sub-pool (for logs and pictures)."""
        return self._shortfall({}, 0).usage
