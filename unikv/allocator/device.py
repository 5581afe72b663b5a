"""Host -> device copies of small int32 index arrays, without a host sync.

The allocator keeps its bookkeeping on the host (numpy) and pushes table
updates to the device. On CUDA an update is staged in pinned memory and copied
with ``non_blocking=True``: PyTorch's caching host allocator keeps the pinned
block alive until the copy has run, so no buffer is reused too early. On CPU the
array is wrapped without a copy. The choice is made once, at construction
(``make_uploader``); device tables are then written with ``index_put_`` and
device-resident values, never ``t[idx] = scalar`` (LESSONS.md bug 6: a Python
scalar becomes a blocking pageable host-to-device copy).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

Uploader = Callable[[np.ndarray], torch.Tensor]


def make_uploader(device: torch.device) -> Uploader:
    """Return ``upload(array) -> tensor``: a (n,) int32 host array to a (n,) int32
    tensor on ``device``. The uploader takes ownership of ``array`` (pass a
    fresh array; on CPU the tensor shares its memory)."""
    device = torch.device(device)

    def upload_cpu(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))

    def upload_pinned(array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
        return host.pin_memory().to(device, non_blocking=True)

    return upload_pinned if device.type == "cuda" else upload_cpu


def scatter(table: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``table[index] = values`` on the device: table (N,) int32, index (n,)
    int32/int64 positions, values (n,) int32 or a 0-dim int32 device tensor."""
    table.index_put_((index,), values)
