"""Host -> device copies of small int32 index arrays, without a host sync.

The allocator keeps its bookkeeping on the host (numpy) and pushes table
updates to the device. On CUDA an update is staged in a persistent ring of
pinned buffers (``PinnedRing``; no pinning or allocation per call) and copied
with ``non_blocking=True``; a CUDA event per ring slot, recorded after its copy,
guards reuse: the ring only waits when every slot is still in flight. On CPU
the array is wrapped without a copy. With ``SIDE_COPY`` the copy runs on a side
stream and the caller's stream waits for it (an event wait): a decode step's upload,
enqueued while the step before still runs, is done by the time the stream reaches
it, instead of queueing there as a copy of its own. The choice is made once, at construction
(``make_uploader``); device tables are then written by one fused launch per
verb (``tables.TableWriter``) from device-resident values, never
``t[idx] = scalar`` (docs/lessons.md bug 6: a Python scalar becomes a blocking
pageable host-to-device copy).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from unikv.env import FLAGS
from unikv.kernels.runtime.private import current_raw_stream, record_event


class Uploader(Protocol):
    """``upload(array, wide=False)``: a (n,) host integer array, or a list of them
    (concatenated), to a (n,) int32 tensor on the device (``wide``: int64, in the
    same one copy: e.g. an index no kernel then widens)."""

    def __call__(self, array: np.ndarray | list, wide: bool = False) -> torch.Tensor: ...


# CUDA: uploads on a side stream the caller's stream waits for (UNIKV_SIDE_UPLOAD=0: on
# the caller's stream; fixed at import, the A/B switch)
SIDE_COPY = FLAGS.side_upload


def make_uploader(device: torch.device) -> Uploader:
    """Return an ``Uploader`` for ``device``: ``upload(array, wide=False) -> tensor``. It
    takes ownership of ``array`` (pass a fresh array; on CPU the tensor shares its
    memory)."""
    device = torch.device(device)

    def upload_cpu(array: np.ndarray | list, wide: bool = False) -> torch.Tensor:
        dtype = np.int64 if wide else np.int32
        if isinstance(array, list):
            return torch.from_numpy(np.concatenate(array, dtype=dtype, casting="unsafe"))
        return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))

    return PinnedRing(device) if device.type == "cuda" else upload_cpu


class PinnedRing:
    """CUDA uploader: ``slots`` reused pinned int32 buffers, one event each.

    A call copies the array into the next slot (numpy, no allocation unless the
    slot is too small; ``wide``: as int64, two of the slot's int32 words each),
    enqueues an async copy into a fresh device tensor and records the slot's event.
    Before a slot is rewritten its event is queried; when it has not fired (its copy
    is still queued behind the device's work) the ring grows, a fresh slot taking
    that place in the order, up to ``max_slots``; only a ring that cannot grow waits
    for the event (``waits`` counts those host syncs). A step that uploads more arrays
    than the ring held would otherwise wait for the device to drain the previous
    step's work (a prefix-cache prefill step at 16 admissions made about 100
    uploads through 64 slots)."""

    def __init__(
        self, device: torch.device, slots: int = 64, capacity: int = 4096, max_slots: int = 1024
    ) -> None:
        self.device = (
            device
            if device.index is not None
            else torch.device("cuda", torch.cuda.current_device())
        )
        self.pinned = [
            torch.empty(capacity, dtype=torch.int32, pin_memory=True) for _ in range(slots)
        ]
        self.views = [t.numpy() for t in self.pinned]
        self.events: list = [None] * slots
        self.capacity, self.max_slots = capacity, max(max_slots, slots)
        self.waits = 0  # host syncs: a queued slot met with the ring at max_slots
        self.next = 0
        self._index = self.device.index
        self._raw: int | None = None  # the current stream, as a raw handle (cheap) ...
        self._stream: Any = None  # ... and as the Stream object events record on
        self._side = torch.cuda.Stream(self.device) if SIDE_COPY else None

    def __call__(self, array: np.ndarray | list, wide: bool = False) -> torch.Tensor:
        i = self.next
        event = self.events[i]
        if event is not None and not event.query():  # this slot's copy is still queued
            if len(self.pinned) < self.max_slots:  # a fresh slot here; the queued one
                pinned = torch.empty(self.capacity, dtype=torch.int32, pin_memory=True)
                self.pinned.insert(i, pinned)  # moves up and is looked at next call
                self.views.insert(i, pinned.numpy())
                self.events.insert(i, None)
                event = None
            else:
                self.waits += 1
                event.synchronize()  # the ring at its bound: wait for that copy
        self.next = (i + 1) % len(self.pinned)
        parts = array if isinstance(array, list) else None
        n = sum(map(len, parts)) if parts is not None else len(array)
        words = 2 * n if wide else n  # int32 words of the slot it fills
        if words > len(self.views[i]):  # rare: grow this slot (the old block is freed
            # by PyTorch's caching host allocator only after its recorded copies ran)
            size = max(words, 2 * len(self.views[i]))
            self.pinned[i] = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self.views[i] = self.pinned[i].numpy()
        view, staged = self.views[i][:words], self.pinned[i][:words]
        if wide:  # the slot's first bytes as int64 (a pinned block starts aligned)
            view, staged = view.view(np.int64), staged.view(torch.int64)
        if parts is not None:  # concatenated straight into the pinned slot
            np.concatenate(parts, out=view, casting="unsafe")
        else:
            view[:] = array  # casts to the slot's dtype
        if event is None:
            event = self.events[i] = torch.cuda.Event()
        raw = current_raw_stream(self._index)
        if raw != self._raw:  # torch.cuda.current_stream() costs microseconds: only on change
            self._raw, self._stream = raw, torch.cuda.current_stream(self.device)
        if self._side is None:
            out = staged.to(self.device, non_blocking=True)
            record_event(event, self._stream)  # the stream of the copy
            return out
        with torch.cuda.stream(self._side):  # out from the side stream's blocks: no
            out = staged.to(self.device, non_blocking=True)  # pending reader
            record_event(event, self._side)
        self._stream.wait_event(event)  # the caller's work after this sees the copy
        out.record_stream(self._stream)  # not reused before the caller's stream used it
        return out
