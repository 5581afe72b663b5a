"""Pages that a running forward or transfer may still touch (the done-event protocol).

    free(page) while a fence is outstanding  ->  PENDING (neither reused nor moved)
    every event of its group has fired        ->  FREE   (back on the free stack)

A group holds the pages freed under one tuple of events. The forward fence is
the event of the latest forward (``mark_in_flight``); forwards run in order on
one stream, so it covers every earlier one. A transfer fence (``fence=`` of
``release_physical``) belongs to a side stream and may fire in any order.
Events are polled with ``query()`` (cudaEventQuery: never a host sync). Compaction
on a shortfall does not wait for the forward fences either: it *orders* the current
stream after them (``order_forward``: ``torch.cuda.Event.wait``, a device-side wait)
and reuses their pages for work enqueued from then on, which runs after the forward
in stream order (docs/design.md section 6: every reader of pool bytes runs on that
stream, or on a side stream that waits for it before its copies). Only idle-time
compaction and a resize ``synchronize()`` (slow paths, between steps). On CPU there
are no events: a freed page is free at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unikv.allocator.pages import PageBook


class FenceQueue:
    """Pending page groups: ``[(events, has_transfer_fence, {name: [pages]})]``."""

    def __init__(self) -> None:
        self.forward: Any = None  # the latest forward's done-event, None when fired
        self._groups: list[tuple[tuple, bool, dict[str, list[np.ndarray]]]] = []

    def mark_in_flight(self, event: Any) -> None:
        """The latest forward's done-event: ``event`` (e.g. a torch.cuda.Event
        recorded after a forward that reads/writes the live pages, or None when it
        already ran) fires when it is done. Until then freed pages are neither
        reused nor moved, and live pages are not moved."""
        if event is not None and not (hasattr(event, "query") and hasattr(event, "synchronize")):
            raise TypeError(
                f"mark_in_flight takes an event with query()/synchronize() or None, got {event!r}"
            )
        self.forward = event

    def forward_outstanding(self) -> bool:
        if self.forward is not None and self.forward.query():
            self.forward = None
        return self.forward is not None

    def hold(self, name: str, pages: np.ndarray, fence: Any = None, spill: bool = False) -> bool:
        """Hold ``pages`` (host int32) of sub-pool ``name`` until the forward fence
        and ``fence`` have fired. False (nothing held) when neither is outstanding.
        ``spill``: ``fence`` is a copy queued right behind the forward (a prefix
        spill to the host), so ``wait_forward`` waits for it too (it is not a
        transfer fence)."""
        self.forward_outstanding()
        events = tuple(e for e in (self.forward, fence) if e is not None)
        if not events or len(pages) == 0:
            return False
        transfer = fence is not None and not spill
        last = self._groups[-1] if self._groups else None
        if (
            last is not None
            and last[1] == transfer
            and len(last[0]) == len(events)
            and all(a is b for a, b in zip(last[0], events))
        ):
            group = last[2]
        else:
            group = {}
            self._groups.append((events, transfer, group))
        group.setdefault(name, []).append(pages)
        return True

    def unbind(
        self, book: PageBook, vpages: np.ndarray, fence: Any = None, spill: bool = False
    ) -> np.ndarray:
        """``book.unbind_host(vpages)``, its pages held while the forward fence or
        ``fence`` is outstanding (``spill``: as ``hold``). Returns the physical pages
        (host int32)."""
        held = self.hold(book.name, book.physical(vpages), fence, spill)
        return book.unbind_host(vpages, held)

    def drain(self) -> dict[str, np.ndarray]:
        """Pop the groups whose events have all fired; their pages by sub-pool."""
        fired: dict[str, list[np.ndarray]] = {}
        keep = []
        for entry in self._groups:
            events, _, group = entry
            if all(e.query() for e in events):
                for name, arrays in group.items():
                    fired.setdefault(name, []).extend(arrays)
            else:
                keep.append(entry)
        self._groups = keep
        return {n: np.concatenate(a) for n, a in fired.items()}

    def wait_forward(self) -> None:
        """Block until the forward fences fire (host sync: slow path only): the
        latest one and those of every group without a transfer fence."""
        if self.forward is not None:
            self.forward.synchronize()
            self.forward = None
        for events, transfer, _ in self._groups:
            if not transfer:
                for event in events:
                    event.synchronize()

    def order_forward(self) -> dict[str, np.ndarray]:
        """``wait_forward`` without a host sync: the current stream waits on the
        device for the forward fences (the latest forward's event and those of every
        group without a transfer fence, spill copies included: each event's ``wait()``,
        ``torch.cuda.Event.wait``; an event without one, a test's, is synchronized),
        and those groups are popped: their pages by sub-pool, free for any work
        enqueued from now on (the caller releases them). Pages freed later are still
        held by the latest forward's fence, which stays (polled as usual)."""
        ordered = {id(self.forward): self.forward} if self.forward is not None else {}
        fired: dict[str, list[np.ndarray]] = {}
        keep = []
        for entry in self._groups:
            events, transfer, group = entry
            if transfer:
                keep.append(entry)
                continue
            ordered.update((id(e), e) for e in events)
            for name, arrays in group.items():
                fired.setdefault(name, []).extend(arrays)
        for event in ordered.values():  # each once (a group shares the forward's)
            _order(event)
        self._groups = keep
        return {n: np.concatenate(a) for n, a in fired.items()}

    def held(self, name: str, transfer_only: bool = False) -> np.ndarray:
        """Pages of ``name`` still held; ``transfer_only``: only groups with a
        non-forward event (those a wait on the forward fence would not free)."""
        arrays = [
            a
            for _, transfer, group in self._groups
            if transfer or not transfer_only
            for a in group.get(name, [])
        ]
        return np.concatenate(arrays) if arrays else np.zeros(0, np.int32)

    def __len__(self) -> int:
        return len(self._groups)


def _order(event: Any) -> None:
    """Work enqueued on the current stream from now on runs after ``event`` (a
    device-side wait, no host sync); an event that cannot order a stream (a test's
    fake, with ``query``/``synchronize`` only) is waited for on the host."""
    wait = getattr(event, "wait", None)
    if wait is not None:
        wait()
    else:
        event.synchronize()
