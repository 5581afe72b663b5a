"""The host tier: a (pinned) host pool of page envelopes for one sub-pool.

    device pool rows (num_pages, page_bytes)        host pool (num_slots, page_bytes)
    | sink | ... | page p | ... |     offload ->     | slot s | slot s+1 | ... |
                                     <- reload

A page envelope is one contiguous byte range, so moving a page is one copy, and
a run of consecutive pages meeting a run of consecutive host slots is one copy
too. ``offload`` hands the lowest free slots to the pages in ascending page order,
so the pages of a batch that are consecutive land in consecutive slots; page ids
given on the host cost no sync to plan with (issue 41: the host tier at line rate):

- run path: each such run of at least ``direct_min_bytes`` goes straight between
  the pool and the host slots in one copy (every run, on the direct path);
- direct path (``page_bytes >= direct_min_bytes``): so a stray page is one copy;
- gather path (smaller envelopes off a run, or device page ids): gather the
  envelopes into a device staging buffer with one ``index_select`` and copy each
  run of consecutive host slots with one copy. Reload is the mirror image (run
  copies, then one ``index_copy_``).

Per call the host work is O(1) Python calls however many pages move (numpy over
the page set: slot assignment, the run plan, slot states); only the copies are
per run. The host pool is allocated (pinned on CUDA) and touched once, at
construction, so no copy pays first-touch page faults on its slots.

The path, the streams and the pinning are decided once, at construction. On
CUDA the copies run on two side streams (one per direction, so offload and
reload overlap) that first wait for the current stream; the current (forward)
stream never waits for them. Each launch returns a :class:`HostCopy` whose
event fires when its bytes have moved. On CPU copies are synchronous and the
event is ``None``.

Ordering kept here (per host slot): a reload waits for the offload that wrote
its slots; a freed slot returns to the free list only after the reload that
read it has finished. Ordering on the device side (no page move or reuse while
a copy reads or writes it) is the allocator's: pin the pages, or release them
with the copy's event as the fence (see ``unikv.io.tiering``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from unikv.ids import PhysicalPageIds, _Ids, expect
from unikv.io.envelopes import page_rows, physical_pages, run_bounds
from unikv.pool import UnifiedPool, check_pages

DIRECT_MIN_BYTES = 1 << 20
STAGING_BYTES = 64 << 20
_FREE, _USED, _PENDING = 0, 1, 2


class HostPageIds(_Ids):
    """Slots of a :class:`HostTier`'s host pool (ints in a CPU tensor)."""

    __slots__ = ()


@dataclass
class HostCopy:
    """A launched copy between device pages and host slots.

    ``pages[i]`` (physical page of the sub-pool) pairs with ``host_slots[i]``.
    ``event`` is a CUDA event recorded after the last copy (``None`` on CPU:
    the copy already happened).
    """

    host_slots: HostPageIds
    pages: PhysicalPageIds
    event: torch.cuda.Event | None

    def done(self) -> bool:
        """Whether the bytes have moved (non-blocking)."""
        return self.event is None or self.event.query()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait on the device for this
        copy, without blocking the host. Call before a kernel reads reloaded pages."""
        if self.event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the copy is done."""
        if self.event is not None:
            self.event.synchronize()


class HostTier:
    """A host pool of ``num_slots`` page envelopes of sub-pool ``name``.

    Args:
        pool: the unified pool whose pages move.
        name: the sub-pool (its ``page_bytes`` is the envelope size).
        num_slots: host envelopes to allocate (``num_slots * page_bytes`` bytes).
        direct_min_bytes: envelopes at least this large are copied one by one;
            smaller ones go through the gather path.
        staging_bytes: device staging for the gather path (per direction).
        pin_memory: pin the host pool; default: when the pool is on CUDA.
    """

    def __init__(
        self,
        pool: UnifiedPool,
        name: str,
        num_slots: int,
        *,
        direct_min_bytes: int = DIRECT_MIN_BYTES,
        staging_bytes: int = STAGING_BYTES,
        pin_memory: bool | None = None,
    ) -> None:
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.pool, self.name = pool, name
        self.subpool = pool[name]
        self.page_bytes = self.subpool.page_bytes
        self._rows = page_rows(pool, name)  # (num_pages, page_bytes) view
        cuda = pool.device.type == "cuda"
        pin = cuda if pin_memory is None else pin_memory
        self.host = torch.empty((num_slots, self.page_bytes), dtype=torch.uint8, pin_memory=pin)
        self.host.zero_()  # touched now: a spill into never-written slots pays no page faults
        self.direct = self.page_bytes >= direct_min_bytes
        self.direct_min_bytes = direct_min_bytes
        staging_rows = max(1, min(num_slots, staging_bytes // self.page_bytes))
        shape = (0 if self.direct else staging_rows, self.page_bytes)
        self._staging_out = torch.empty(shape, dtype=torch.uint8, device=pool.device)
        self._staging_in = torch.empty(shape, dtype=torch.uint8, device=pool.device)
        self._out_stream = torch.cuda.Stream(pool.device) if cuda else None
        self._in_stream = torch.cuda.Stream(pool.device) if cuda else None
        self._launch = self._launch_async if cuda else self._launch_sync
        self._free = list(range(num_slots))  # sorted (a heap too): lowest first -> long runs
        self._state = np.zeros(num_slots, np.uint8)  # _FREE / _USED / _PENDING per slot
        self._writer: list[torch.cuda.Event | None] = [None] * num_slots
        self._reader: list[torch.cuda.Event | None] = [None] * num_slots
        self._pending: list[tuple[torch.cuda.Event, list[int]]] = []

    @property
    def num_slots(self) -> int:
        return self.host.shape[0]

    @property
    def num_free(self) -> int:
        """Slots free now (slots whose reload is still running are not counted)."""
        self._reclaim()
        return len(self._free)

    # -- public verbs -------------------------------------------------------------

    def offload(self, pages: PhysicalPageIds, *, check: bool = True) -> HostCopy | None:
        """Copy the envelopes of ``pages`` into newly taken host slots.

        Args:
            pages: (n,) int32/int64 physical pages of this sub-pool (CPU ids avoid
                a host sync on the direct path). ``check`` validates them (a sync).

        Returns:
            a :class:`HostCopy` (``host_slots[i]`` holds ``pages[i]``), or ``None``
            with nothing changed when fewer than n host slots are free.
        """
        src = physical_pages(pages, "HostTier.offload pages", self.name)
        if check:
            check_pages(self.subpool, src, "HostTier.offload pages")
        slots = self._take(src.numel())
        if slots is None:
            return None
        if src.device.type == "cpu":  # ascending slots to ascending pages: long runs
            ranked = np.empty(len(slots), np.int64)
            ranked[np.argsort(src.detach().numpy(), kind="stable")] = slots
            slots = ranked.tolist()
        event = self._launch(self._out_stream, self._copy_out, src, slots, [])
        for s in slots:
            self._writer[s] = event
        return HostCopy(HostPageIds(torch.tensor(slots, dtype=torch.int64)), pages, event)

    def reload(
        self, host_slots: HostPageIds, pages: PhysicalPageIds, *, check: bool = True
    ) -> HostCopy:
        """Copy host slots back into (any) physical pages: ``pages[i] <- host_slots[i]``.

        The host slots stay taken; :meth:`free` them when no longer needed.

        Args:
            host_slots: (n,) slots returned by :meth:`offload`.
            pages: (n,) distinct physical pages of this sub-pool to overwrite.
        """
        dst = physical_pages(pages, "HostTier.reload pages", self.name)
        slots = self._used_slots(host_slots, "HostTier.reload host_slots")
        if len(slots) != dst.numel():
            raise ValueError(
                f"HostTier.reload takes one page per host slot, got {len(slots)} slots and "
                f"{dst.numel()} pages"
            )
        if check:
            check_pages(self.subpool, dst, "HostTier.reload pages")
        writers = list({id(e): e for s in slots if (e := self._writer[s]) is not None}.values())
        event = self._launch(self._in_stream, self._copy_in, dst, slots, writers)
        for s in slots:
            self._reader[s] = event
        return HostCopy(host_slots, pages, event)

    def free(self, host_slots: HostPageIds) -> None:
        """Give host slots back; they are reused once any reload reading them is done."""
        slots = self._used_slots(host_slots, "HostTier.free host_slots")
        readers = [self._reader[s] for s in slots]
        for s in slots:
            self._reader[s] = self._writer[s] = None
        done = [s for s, r in zip(slots, readers) if r is None]
        by_event: dict[int, tuple[torch.cuda.Event, list[int]]] = {}
        if len(done) < len(slots):  # some still read by a reload: PENDING until it ends
            for s, reader in zip(slots, readers):
                if reader is not None:
                    by_event.setdefault(id(reader), (reader, []))[1].append(s)
            for _, waiting in by_event.values():
                self._state[waiting] = _PENDING
        self._give_back(done)
        self._pending.extend(by_event.values())

    def used_slots(self) -> list[int]:
        """The USED slots (taken by ``offload``, not freed), ascending (host; for checks)."""
        return np.flatnonzero(self._state == _USED).tolist()

    def check_integrity(self) -> None:
        """Slot states against the free heap and the pending reloads (host only,
        O(num_slots); for tests and debug). AssertionError names the invariant."""
        n, state = self.num_slots, self._state
        assert len(state) == len(self._writer) == len(self._reader) == n, (
            "host tier: one state, writer and reader per slot"
        )
        assert tuple(self.host.shape) == (n, self.page_bytes) == (n, self.subpool.page_bytes), (
            "host tier: the host pool holds num_slots envelopes of the sub-pool's page_bytes"
        )
        assert np.isin(state, (_FREE, _USED, _PENDING)).all(), (
            "host tier: every slot is FREE, USED or PENDING"
        )
        free = np.flatnonzero(state == _FREE).tolist()
        assert sorted(self._free) == free, "host tier: the free heap holds exactly the FREE slots"
        heap = self._free  # kept sorted, which makes it a heap as well
        assert (np.diff(heap) > 0).all(), "host tier: the free list is a heap (lowest slot first)"
        waiting = sorted(s for _, slots in self._pending for s in slots)
        assert waiting == np.flatnonzero(state == _PENDING).tolist(), (
            "host tier: PENDING slots are exactly those waiting for a reload's event"
        )
        assert all(self._writer[s] is None and self._reader[s] is None for s in free + waiting), (
            "host tier: a free or pending slot has no writer or reader"
        )

    # -- slot bookkeeping ---------------------------------------------------------

    def _reclaim(self) -> None:
        if not self._pending:
            return
        still, fired = [], []
        for event, slots in self._pending:
            if event.query():
                fired += slots
            else:
                still.append((event, slots))
        self._pending = still
        self._give_back(fired)

    def _give_back(self, slots: list[int]) -> None:
        """``slots`` become FREE: merged into the sorted free list (one sort of two runs)."""
        if slots:
            self._state[slots] = _FREE
            self._free += slots
            self._free.sort()

    def _take(self, n: int) -> list[int] | None:
        """The ``n`` lowest free slots (ascending), now USED; None when fewer are free."""
        self._reclaim()
        if n > len(self._free):
            return None
        slots = self._free[:n]
        del self._free[:n]
        self._state[slots] = _USED
        return slots

    def _used_slots(self, host_slots: HostPageIds, what: str) -> list[int]:
        data = expect(host_slots, HostPageIds, what)
        slots = data.to("cpu", torch.int64).numpy()
        n = self.num_slots
        ok = (slots >= 0) & (slots < n)
        ok[ok] = self._state[slots[ok]] == _USED
        if not ok.all() or len(np.unique(slots)) != len(slots):
            raise ValueError(
                f"{what} must be distinct slots taken by offload from this tier "
                f"(0..{n - 1}); got {slots.tolist()}, of which {slots[~ok].tolist()} are out "
                "of range or free"
            )
        return slots.tolist()

    # -- copies ---------------------------------------------------------------------

    def _launch_sync(self, stream, copy, pages, slots, writers) -> None:
        copy(pages, slots, None)

    def _launch_async(self, stream, copy, pages, slots, writers) -> torch.cuda.Event:
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        for writer in writers:
            stream.wait_event(writer)
        with torch.cuda.stream(stream):
            copy(pages, slots, stream)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _device_index(self, pages: torch.Tensor, staging: torch.Tensor, stream) -> torch.Tensor:
        """Page ids on the pool's device. Tensors made on (or owned by) another
        stream are marked as used by ``stream``, so the caching allocator does not
        hand their memory out while the side stream still reads them."""
        index = pages.to(self.pool.device, torch.int64, non_blocking=True)
        if stream is not None:
            index.record_stream(stream)
            staging.record_stream(stream)
        return index

    def _plan(self, pages: torch.Tensor, slots: list[int]) -> tuple[list, torch.Tensor, list]:
        """(ranges, rest pages, rest slots): ``ranges`` are ``(page, slot, length)`` runs
        where the pages and the slots are both consecutive and the run is at least
        ``direct_min_bytes`` (or the envelope is: the direct path), one copy each; the
        others go through the staging gather. Host page ids cost nothing; device ones
        are read only on the direct path (a sync, as before)."""
        if pages.device.type != "cpu" and not self.direct:
            return [], pages, slots
        ids = pages.detach().to("cpu", torch.int64).numpy()  # a sync only for device ids
        order = np.argsort(np.asarray(slots, np.int64), kind="stable")  # any order will do:
        held, ids = np.asarray(slots, np.int64)[order], ids[order]  # each pair is one copy
        starts, lengths = run_bounds(ids, held)
        direct = np.full(len(starts), self.direct) | (
            lengths * self.page_bytes >= self.direct_min_bytes
        )
        ranges = list(
            zip(
                ids[starts[direct]].tolist(),
                held[starts[direct]].tolist(),
                lengths[direct].tolist(),
            )
        )
        rest = np.repeat(~direct, lengths)
        return ranges, torch.from_numpy(ids[rest]), held[rest].tolist()

    def _copy_out(self, pages: torch.Tensor, slots: list[int], stream) -> None:
        ranges, pages, slots = self._plan(pages, slots)
        for page, slot, length in ranges:  # one copy per run of envelopes
            self.host[slot : slot + length].copy_(
                self._rows[page : page + length], non_blocking=True
            )
        if not slots:
            return
        staging = self._staging_out
        index = self._device_index(pages, staging, stream)
        for c0 in range(0, len(slots), staging.shape[0]):
            chunk = slots[c0 : c0 + staging.shape[0]]
            torch.index_select(
                self._rows, 0, index[c0 : c0 + len(chunk)], out=staging[: len(chunk)]
            )
            for i, slot, length in _slot_runs(chunk):
                self.host[slot : slot + length].copy_(staging[i : i + length], non_blocking=True)

    def _copy_in(self, pages: torch.Tensor, slots: list[int], stream) -> None:
        ranges, pages, slots = self._plan(pages, slots)
        for page, slot, length in ranges:
            self._rows[page : page + length].copy_(
                self.host[slot : slot + length], non_blocking=True
            )
        if not slots:
            return
        staging = self._staging_in
        index = self._device_index(pages, staging, stream)
        for c0 in range(0, len(slots), staging.shape[0]):
            chunk = slots[c0 : c0 + staging.shape[0]]
            for i, slot, length in _slot_runs(chunk):
                staging[i : i + length].copy_(self.host[slot : slot + length], non_blocking=True)
            self._rows.index_copy_(0, index[c0 : c0 + len(chunk)], staging[: len(chunk)])


def _slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive ``slots``."""
    array = np.asarray(slots, np.int64)
    starts, lengths = run_bounds(array)
    return list(zip(starts.tolist(), array[starts].tolist(), lengths.tolist()))
