"""Request slots, their virtual pages, and the req_to_token table.

    req_to_token[r, i]  = virtual token id of position i of request r   (device, int32)
    pages[r, j]         = virtual page of positions [j*ps, (j+1)*ps)     (host mirror)
    lens[r]             = tokens held by request r                        (host)

A virtual token id is ``page * ps + i % ps``; virtual page 0 is the sink and is
never minted, so a zero-filled ``req_to_token`` reads the sink. The id owner
mints virtual pages from ``VirtualSpace``; every other token sub-pool binds the
same virtual pages to its own physical pages. Lengths live on the host: the
scheduler-facing path never reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Roles:
    """Who does what among the sub-pools (docs/design.md section 5).

    owner: the token sub-pool that mints virtual pages (full attention or MLA,
    else the first token sub-pool; None without token sub-pools); token_names:
    every token sub-pool, in pool order; mamba_name: the Mamba sub-pool or None;
    windows: sliding window per windowed token sub-pool; page_size: the token
    sub-pools' shared page size (1 without them)."""

    owner: str | None
    token_names: tuple[str, ...]
    mamba_name: str | None
    windows: dict[str, int]
    page_size: int


class VirtualSpace:
    """The owner's virtual pages ``[1, size)``: a free stack and who owns each page."""

    def __init__(self, size: int) -> None:
        self.size = size
        # request slot owning the page; -1 free; prefix.CACHED held by the prefix cache
        self.owner = np.full(size, -1, np.int32)
        self.column = np.zeros(size, np.int64)  # its page index inside the request
        self._stack = np.arange(size - 1, 0, -1, dtype=np.int32)  # pops 1, 2, 3, ...
        self.num_free = size - 1

    def mint(self, slots: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """One new virtual page per entry of ``slots`` (owning request slots), at page
        index ``columns`` of its request."""
        count = len(slots)
        assert count <= self.num_free, f"virtual space short: {count} > {self.num_free}"
        self.num_free -= count
        pages = self._stack[self.num_free : self.num_free + count][::-1].copy()
        self.owner[pages] = slots
        self.column[pages] = columns
        return pages

    def retire(self, pages: np.ndarray) -> None:
        assert (self.owner[pages] != -1).all(), "virtual space: retiring unowned pages"
        self.owner[pages] = -1
        self._stack[self.num_free : self.num_free + len(pages)] = pages[::-1]
        self.num_free += len(pages)

    def free_ids(self) -> np.ndarray:
        return self._stack[: self.num_free]


class RequestTable:
    """Per-request host state and the device ``req_to_token`` table."""

    def __init__(self, max_requests: int, max_context: int, page_size: int, device: torch.device):
        self.max_requests = max_requests
        self.max_context = max_context
        self.page_size = page_size
        self.max_pages = -(-max_context // page_size)
        self.in_use = np.zeros(max_requests, bool)
        self.lens = np.zeros(max_requests, np.int64)
        self.pages = np.zeros((max_requests, self.max_pages), np.int32)
        self._pages_flat = self.pages.reshape(-1)  # a view: one 1-D gather beats a 2-D one
        self.window_lo: dict[
            str, np.ndarray
        ] = {}  # first page not yet freed, per windowed sub-pool
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._stamp = np.zeros(max_requests, np.int64)  # scratch of check_slots
        self._positions = np.arange(max_requests, dtype=np.int64)
        self._rows_key: tuple | None = None  # ``row_token_ids``' last (slots, counts)
        self._rows: tuple = ()  # and what it kept for them
        # (max_requests, max_context) int32 virtual token ids; 0 = the sink
        self.req_to_token = torch.zeros(
            (max_requests, max_context), dtype=torch.int32, device=device
        )

    def add_window(self, name: str) -> None:
        self.window_lo[name] = np.zeros(self.max_requests, np.int64)

    def open(self) -> int | None:
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        self.in_use[slot] = True
        self.lens[slot] = 0
        for lo in self.window_lo.values():
            lo[slot] = 0
        return slot

    def close(self, slot: int) -> None:
        self.in_use[slot] = False
        self.lens[slot] = 0
        self._free_slots.append(slot)

    def num_pages(self, slots: np.ndarray) -> np.ndarray:
        """Pages held by each request (ceil(len / ps))."""
        return -(-self.lens[slots] // self.page_size)

    def held_pages(self, slot: int) -> np.ndarray:
        """Virtual pages request ``slot`` holds (a copy, host int32, page order)."""
        return self.pages[slot, : -(-int(self.lens[slot]) // self.page_size)].copy()

    def page_ids(self, slots: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """Virtual pages at page ``columns`` of requests ``slots`` (host ints)."""
        return self._pages_flat[slots * self.max_pages + columns]

    def token_ids(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Virtual token ids of ``positions`` of requests ``slots`` (host ints; the
        ids fit int32: the allocator keeps virtual pages * page size below 2**31)."""
        return self._ids_at(slots * self.max_pages, positions)

    def _ids_at(self, base: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Virtual token ids of ``positions`` in the page rows starting at ``base``
        (``slot * max_pages``): ``page * ps + position % ps``."""
        ps = self.page_size
        if ps == 1:
            return self._pages_flat[base + positions]
        cols = positions // ps
        return self._pages_flat[base + cols] * ps + (positions - cols * ps)

    def row_token_ids(
        self, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray
    ) -> np.ndarray:
        """(sum(counts),) int64 virtual token ids of rows ``[starts[i], starts[i] +
        counts[i])`` of requests ``slots[i]``, request by request (host int64 arrays,
        rows held). What depends on (slots, counts) only (each row's request and its
        offset in it) is kept for the next call with the same ones (a steady verify
        step's rows): then a few array ops over the rows, whatever B."""
        key = (slots.tobytes(), counts.tobytes())
        if key != self._rows_key:
            first = np.cumsum(counts) - counts
            owner = np.repeat(np.arange(len(counts)), counts)
            offsets = np.arange(owner.size, dtype=np.int64) - first[owner]
            self._rows = (owner, offsets, slots[owner] * self.max_pages)
            self._rows_key = key
        owner, offsets, base = self._rows
        return self._ids_at(base, starts[owner] + offsets).astype(np.int64, copy=False)

    def check_slot(self, slot: object, what: str) -> int:
        """One open request slot as an int, or ValueError (``check_slots`` of one,
        without its array work: a decode checkpoint's per-take check)."""
        plain = isinstance(slot, (int, np.integer)) and not isinstance(slot, bool)
        index = int(slot) if plain else -1  # type: ignore[call-overload]
        if 0 <= index < self.max_requests and self.in_use[index]:
            return index
        return int(self.check_slots(np.array([slot]), what)[0])

    def check_slots(self, slots: object, what: str) -> np.ndarray:
        """Host int64 array of distinct in-use slots, or ValueError. O(B), no sort:
        duplicates are found by stamping each slot with its position."""
        array = np.asarray(slots)
        if array.ndim != 1 or array.dtype.kind not in "iu":  # signed or unsigned ints
            raise ValueError(f"{what}: slots must be a 1-D host integer array, got {slots!r}")
        array = array.astype(np.int64, copy=False)
        if np.count_nonzero(array.view(np.uint64) >= self.max_requests):  # negatives wrap
            raise ValueError(
                f"{what}: slots must lie in [0, {self.max_requests}), got {array.tolist()}"
            )
        if np.count_nonzero(self.in_use[array]) != len(array):
            raise ValueError(
                f"{what}: slots {array[~self.in_use[array]].tolist()} are not open requests"
            )
        n = len(array)
        if n > self.max_requests:
            raise ValueError(f"{what}: slots must be distinct, got {array.tolist()}")
        positions = self._positions[:n]
        self._stamp[array] = positions
        if np.count_nonzero(self._stamp[array] != positions):  # a later duplicate overwrote
            raise ValueError(f"{what}: slots must be distinct, got {array.tolist()}")
        return array
