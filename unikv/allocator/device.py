"""Host -> device copies of small int32 index arrays, without a host sync.

The allocator keeps its bookkeeping on the host (numpy) and pushes table
updates to the device. On CUDA an update is staged in a persistent ring of
pinned buffers (``PinnedRing``; no pinning or allocation per call) and copied
with ``non_blocking=True``; a CUDA event per ring slot, recorded after its copy,
guards reuse: the ring only waits when every slot is still in flight. On CPU
the array is wrapped without a copy. The choice is made once, at construction
(``make_uploader``, ``make_table_ops``); device tables are then written by one
fused launch per verb (``unikv.kernels.table_update``) from device-resident
values, never ``t[idx] = scalar`` (LESSONS.md bug 6: a Python scalar becomes a
blocking pageable host-to-device copy).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

Uploader = Callable[[np.ndarray | list], torch.Tensor]


def make_uploader(device: torch.device) -> Uploader:
    """Return ``upload(array) -> tensor``: a (n,) host integer array, or a list of
    them (concatenated), to a (n,) int32 tensor on ``device``. The uploader takes
    ownership of ``array`` (pass a fresh array; on CPU the tensor shares its memory)."""
    device = torch.device(device)

    def upload_cpu(array: np.ndarray | list) -> torch.Tensor:
        if isinstance(array, list):
            return torch.from_numpy(np.concatenate(array, dtype=np.int32, casting="unsafe"))
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))

    return PinnedRing(device) if device.type == "cuda" else upload_cpu


class PinnedRing:
    """CUDA uploader: ``slots`` reused pinned int32 buffers, one event each.

    A call copies the array into the next slot (numpy, no allocation unless the
    slot is too small), enqueues an async copy into a fresh device tensor and
    records the slot's event. Before a slot is rewritten its event is queried;
    only when it has not fired (all ``slots`` uploads still queued) does the
    call wait for it."""

    def __init__(self, device: torch.device, slots: int = 64, capacity: int = 4096) -> None:
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
        self.next = 0
        self._index = self.device.index
        self._raw = None  # the current stream, as a raw handle (cheap to read) ...
        self._stream = None  # ... and as the Stream object events record on

    def __call__(self, array: np.ndarray | list) -> torch.Tensor:
        i = self.next
        self.next = (i + 1) % len(self.pinned)
        event = self.events[i]
        if event is not None and not event.query():
            event.synchronize()  # ring exhausted: the copy from this slot is still queued
        parts = array if isinstance(array, list) else None
        n = sum(map(len, parts)) if parts is not None else len(array)
        if n > len(self.views[i]):  # rare: grow this slot (the old block is freed
            # by PyTorch's caching host allocator only after its recorded copies ran)
            size = max(n, 2 * len(self.views[i]))
            self.pinned[i] = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self.views[i] = self.pinned[i].numpy()
        if parts is not None:  # concatenated straight into the pinned slot
            np.concatenate(parts, out=self.views[i][:n], casting="unsafe")
        else:
            self.views[i][:n] = array  # casts to int32
        out = self.pinned[i][:n].to(self.device, non_blocking=True)
        if event is None:
            event = self.events[i] = torch.cuda.Event()
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        if raw != self._raw:  # torch.cuda.current_stream() costs microseconds: only on change
            self._raw, self._stream = raw, torch.cuda.current_stream(self.device)
        torch._C._CudaEventBase.record(event, self._stream)  # the stream of the copy
        return out


def make_table_ops(device: torch.device, backend: str | None = None) -> SimpleNamespace:
    """``update_tables``, ``translate_ids`` and ``prepare_step`` for ``device``, chosen once: the
    fused Triton kernels on CUDA, their torch references elsewhere. backend:
    None (by device), ``"triton"`` (e.g. under ``TRITON_INTERPRET=1``) or ``"torch"``."""
    from unikv.kernels import step_tables, table_update

    if backend is None:
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
    if backend == "triton":
        from unikv.kernels._interpret import patch_interpreter

        patch_interpreter()
        return SimpleNamespace(
            update_tables=table_update.update_tables,
            translate_ids=table_update.translate_ids,
            prepare_step=step_tables.prepare,
        )
    if backend == "torch":
        return SimpleNamespace(
            update_tables=table_update.update_tables_ref,
            translate_ids=table_update.translate_ids_ref,
            prepare_step=step_tables.prepare_ref,
        )
    raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")


def pack_updates(
    arrays: list[np.ndarray], segments: list[tuple[int, int, int]]
) -> tuple[np.ndarray, int, int]:
    """The packed int32 array of ``table_update.update_tables``, as a list of parts
    for the uploader (which concatenates them into its staging buffer).

    arrays: host integer arrays (indices or values); segments: ``(table,
    index_array, value_array)`` positions into ``arrays`` (value_array -1: write
    the tombstone -1). Returns ``(parts, num_segments, max_count)``; array k
    starts at ``4 * num_segments + sum(len(arrays[:k]))`` in the packed array."""
    num = len(segments)
    sizes = [len(a) for a in arrays]
    starts, at = [], 4 * num
    for size in sizes:
        starts.append(at)
        at += size
    header = []
    for table, i, v in segments:
        header += (table, starts[i], starts[v] if v >= 0 else -1, sizes[i])
    max_count = max((sizes[i] for _, i, _ in segments), default=0)
    return [np.array(header, np.int32), *arrays], num, max_count
