"""The pool's memory: a reserved address range whose chunks are committed and
released at run time (issue 44; docs/design.md section 4).

    base                                                          base + reserved
    | committed | committed | released (poisoned / unmapped) | never committed |
      chunk 0     chunk 1     ...

``reserve(max_bytes)`` takes the address range once; its base never moves, so
every view of ``tensor`` (the whole range, uint8) stays valid while chunks come
and go. ``commit(lo, hi)`` backs the chunks of ``[lo, hi)`` with memory,
``release(lo, hi)`` gives them back; both take chunk-aligned bounds. Only bytes
inside committed chunks may be read or written.

- ``EmulatedBacking`` (CPU, CI): the range is one host tensor; a released chunk is
  filled with ``POISON_BYTE`` (NaN in every float dtype), so a read of released
  memory shows in the tests' data, and ``committed`` says what is backed.
- ``CudaBacking`` (GPU): the CUDA driver's virtual memory API through
  ``cuda-bindings`` (the ``gpu`` extra): ``cuMemAddressReserve`` once, then per
  chunk ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` to commit and
  ``cuMemUnmap`` + ``cuMemRelease`` to release. The range is wrapped as a torch
  tensor through ``__cuda_array_interface__`` (no copy).

``make_backing(device)`` picks one. ``SliceBacking`` is a sub-range of another
backing's reservation: several pools (one per model, ``engine/budget_broker.py``)
in one reserved range, their committed chunks counted together.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_BYTES = 2 << 20  # 2 MiB: the CUDA allocation granularity of current GPUs
# CudaBacking's default: one cuMemCreate + cuMemMap per chunk costs ~36-40 us on an H100,
# so a 1 GiB grow took 18.6 ms at 2 MiB chunks, 5.1 ms at 8 MiB and 1.7 ms at 32 MiB
# (bench_elastic's chunk_sweep, 2026-12-06; issue 44's target: <= 10 ms)
CUDA_CHUNK_BYTES = 8 << 20
POISON_BYTE = 0xFF  # NaN in fp32, fp16, bf16 and both fp8 formats


def round_up(n: int, chunk: int) -> int:
    return -(-n // chunk) * chunk


class Backing:
    """A reserved range of ``reserved`` bytes committed in chunks of ``chunk``
    bytes (see the module docstring). ``committed`` is a sorted list of disjoint
    ``(lo, hi)`` byte ranges."""

    chunk: int
    reserved: int
    tensor: torch.Tensor  # (reserved,) uint8: the whole range

    def __init__(self, chunk: int = CHUNK_BYTES) -> None:
        if not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        self.chunk = chunk
        self.reserved = 0
        self._chunks: set[int] = set()  # indices of committed chunks

    # -- the contract ---------------------------------------------------------------

    def reserve(self, max_bytes: int) -> torch.Tensor:
        """Reserve ``max_bytes`` (rounded up to a chunk) once; returns ``tensor``."""
        if self.reserved:
            raise ValueError("reserve: this backing already holds a reservation")
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"reserve: max_bytes must be a positive int, got {max_bytes!r}")
        self.reserved = round_up(max_bytes, self.chunk)
        self.tensor = self._reserve(self.reserved)
        return self.tensor

    def commit(self, lo: int, hi: int) -> int:
        """Back the chunks of ``[lo, hi)`` (chunk-aligned) with memory; chunks
        already committed are kept. Returns the bytes newly committed."""
        new = [c for c in self._span(lo, hi, "commit") if c not in self._chunks]
        start = 0
        for i in range(1, len(new) + 1):  # one call per run of adjacent new chunks
            if i == len(new) or new[i] != new[i - 1] + 1:
                self._commit_run(new[start] * self.chunk, (new[i - 1] + 1) * self.chunk)
                self._chunks.update(new[start:i])
                start = i
        return len(new) * self.chunk

    def release(self, lo: int, hi: int) -> int:
        """Give the committed chunks of ``[lo, hi)`` (chunk-aligned) back. The caller
        makes sure no queued work still touches them. Returns the bytes released."""
        gone = [c for c in self._span(lo, hi, "release") if c in self._chunks]
        start = 0
        for i in range(1, len(gone) + 1):  # one call per run of adjacent chunks
            if i == len(gone) or gone[i] != gone[i - 1] + 1:
                self._release_run(gone[start] * self.chunk, (gone[i - 1] + 1) * self.chunk)
                self._chunks.difference_update(gone[start:i])
                start = i
        return len(gone) * self.chunk

    @property
    def committed(self) -> list[tuple[int, int]]:
        """The committed byte ranges, merged, in order."""
        out: list[tuple[int, int]] = []
        for c in sorted(self._chunks):
            lo = c * self.chunk
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], lo + self.chunk)
            else:
                out.append((lo, lo + self.chunk))
        return out

    @property
    def committed_bytes(self) -> int:
        return len(self._chunks) * self.chunk

    def is_committed(self, lo: int, hi: int) -> bool:
        """Whether every byte of ``[lo, hi)`` lies in a committed chunk."""
        if hi <= lo:
            return True
        return all(c in self._chunks for c in range(lo // self.chunk, -(-hi // self.chunk)))

    def close(self) -> None:
        """Release every chunk and the reservation (idempotent)."""
        if self.reserved:
            self.release(0, self.reserved)
            self._unreserve()
            self.reserved = 0

    def _span(self, lo: int, hi: int, what: str) -> range:
        if not self.reserved:
            raise ValueError(f"{what}: reserve first")
        if lo % self.chunk or hi % self.chunk or not 0 <= lo <= hi <= self.reserved:
            raise ValueError(
                f"{what}: [{lo}, {hi}) must be chunk-aligned ({self.chunk} bytes) and lie in "
                f"the {self.reserved}-byte reservation"
            )
        return range(lo // self.chunk, hi // self.chunk)

    # -- the implementation's part --------------------------------------------------------

    def _reserve(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    def _commit_run(self, lo: int, hi: int) -> None:
        """Back the chunks of ``[lo, hi)`` (none committed yet)."""
        for offset in range(lo, hi, self.chunk):
            self._commit(offset)

    def _commit(self, offset: int) -> None:
        raise NotImplementedError

    def _release(self, offset: int) -> None:
        raise NotImplementedError

    def _release_run(self, lo: int, hi: int) -> None:
        """Give back the chunks of ``[lo, hi)`` (all committed)."""
        for offset in range(lo, hi, self.chunk):
            self._release(offset)

    def _unreserve(self) -> None:
        pass


class EmulatedBacking(Backing):
    """The CPU stand-in: one host tensor; released chunks are poisoned (0xFF) and
    committed ones zeroed, so data that survives a release is a bug the tests see."""

    def __init__(self, chunk: int = CHUNK_BYTES, device: torch.device | str = "cpu") -> None:
        super().__init__(chunk)
        self.device = torch.device(device)

    def _reserve(self, size: int) -> torch.Tensor:
        return torch.full((size,), POISON_BYTE, dtype=torch.uint8, device=self.device)

    def _commit(self, offset: int) -> None:
        self.tensor[offset : offset + self.chunk].zero_()

    def _release(self, offset: int) -> None:
        self.tensor[offset : offset + self.chunk].fill_(POISON_BYTE)


class _CudaRange:
    """``__cuda_array_interface__`` of a raw device range, for ``torch.as_tensor``;
    the tensor keeps it (and so ``mapping``) alive as long as any view lives."""

    def __init__(self, ptr: int, size: int, mapping: _Mapping) -> None:
        self.mapping = mapping
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda-bindings ``(CUresult, *values)`` tuple; raise on an error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != getattr(type(err), "CUDA_SUCCESS", 0):  # (no import per call: a resize
        from cuda.bindings import driver  # of 1 GiB makes a thousand of these calls)

        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if name else err}")
    return values[0] if len(values) == 1 else values


class _Mapping:
    """The driver-side state of one reservation: base, size, chunk handles. Owned
    by the backing and by every tensor over the range (no cycle), so the memory
    goes back when the last of them goes, or at ``CudaBacking.close``."""

    def __init__(self, driver: Any, context: Any) -> None:
        self.driver, self.context, self.base, self.size, self.chunk = driver, context, 0, 0, 0
        self.handles: dict[int, Any] = {}  # chunk offset -> physical allocation handle

    def enter(self) -> None:
        """Make the device's primary context (torch's) current on this thread: a
        resize may run on the serving loop's thread, not the one that built the pool."""
        _check(self.driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def unmap(self, offset: int) -> None:
        self.enter()
        _check(self.driver.cuMemUnmap(self.base + offset, self.chunk), "cuMemUnmap")
        _check(self.driver.cuMemRelease(self.handles.pop(offset)), "cuMemRelease")

    def unmap_run(self, lo: int, hi: int) -> None:
        """Unmap and release the chunks of ``[lo, hi)``: the context made current
        once, one ``cuMemUnmap`` over the run when the driver takes a range of whole
        mappings (else one per chunk), then each chunk's handle released."""
        if hi - lo == self.chunk:
            return self.unmap(lo)
        self.enter()
        d = self.driver
        if d.cuMemUnmap(self.base + lo, hi - lo)[0] != d.CUresult.CUDA_SUCCESS:
            for offset in range(lo, hi, self.chunk):
                _check(d.cuMemUnmap(self.base + offset, self.chunk), "cuMemUnmap")
        for offset in range(lo, hi, self.chunk):
            _check(d.cuMemRelease(self.handles.pop(offset)), "cuMemRelease")
        return None

    def free(self) -> None:
        for offset in list(self.handles):
            self.unmap(offset)
        if self.size:
            self.enter()
            _check(self.driver.cuMemAddressFree(self.base, self.size), "cuMemAddressFree")
            self.base = self.size = 0

    def __del__(self) -> None:  # every view and the backing are gone: hand the memory back
        try:
            self.free()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: the driver may be gone
            pass


class CudaBacking(Backing):
    """The CUDA driver's virtual memory (module docstring). ``chunk`` is rounded up
    to the device's allocation granularity; ``reserve`` commits chunk 0 (torch
    needs a mapped pointer to wrap). Needs the ``gpu`` extra (cuda-bindings)."""

    def __init__(self, device: torch.device | str = "cuda", chunk: int = CUDA_CHUNK_BYTES) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as e:  # pragma: no cover - the CPU image has no cuda-bindings
            raise ImportError("CudaBacking needs cuda-bindings: pip install 'unikv[gpu]'") from e
        device = torch.device(device)
        self.device = torch.device("cuda", device.index if device.index is not None else 0)
        self._start_torch()
        _check(driver.cuInit(0), "cuInit")
        cu_device = _check(driver.cuDeviceGet(self.device.index), "cuDeviceGet")
        context = _check(driver.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain")
        self._driver = driver
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        self._prop = prop
        flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        granularity = int(_check(driver.cuMemGetAllocationGranularity(prop, flag), "granularity"))
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self._map = _Mapping(driver, context)
        super().__init__(round_up(chunk, granularity))

    def _reserve(self, size: int) -> torch.Tensor:
        d = self._driver
        self._map.enter()
        ptr = _check(d.cuMemAddressReserve(size, self.chunk, 0, 0), "cuMemAddressReserve")
        self._map.base, self._map.size, self._map.chunk = int(ptr), size, self.chunk
        # torch asks the driver which device a pointer is on, which an unmapped
        # address cannot answer: the first chunk is committed before the wrap
        self._commit_run(0, self.chunk)
        self._chunks.add(0)
        return self._wrap(_CudaRange(self._map.base, size, self._map))

    def _start_torch(self) -> None:
        """torch's primary context exists and is current on this thread."""
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.empty(0, device=self.device)

    def _wrap(self, memory: _CudaRange) -> torch.Tensor:
        """The range as a (size,) uint8 tensor, no copy (it keeps ``memory`` alive)."""
        return torch.as_tensor(memory, device=self.device)

    def _commit_run(self, lo: int, hi: int) -> None:
        """Create and map one physical chunk per chunk of ``[lo, hi)``, then set
        access once for the whole run (one driver call instead of one per chunk)."""
        d = self._driver
        self._map.enter()
        try:
            for offset in range(lo, hi, self.chunk):
                handle = _check(d.cuMemCreate(self.chunk, self._prop, 0), "cuMemCreate")
                try:
                    _check(d.cuMemMap(self._map.base + offset, self.chunk, 0, handle, 0), "map")
                except RuntimeError:
                    _check(d.cuMemRelease(handle), "cuMemRelease")
                    raise
                self._map.handles[offset] = handle
            base = self._map.base + lo
            _check(d.cuMemSetAccess(base, hi - lo, [self._access], 1), "cuMemSetAccess")
        except RuntimeError:  # out of memory midway: unmap this run, nothing committed
            for offset in range(lo, hi, self.chunk):
                if offset in self._map.handles:
                    self._map.unmap(offset)
            raise

    def _release(self, offset: int) -> None:
        self._map.unmap(offset)

    def _release_run(self, lo: int, hi: int) -> None:
        self._map.unmap_run(lo, hi)

    def _unreserve(self) -> None:
        """Views still alive would point at freed addresses: close only a pool no
        one reads any more."""
        self.tensor = self.tensor[:0]
        self._map.free()


class SliceBacking(Backing):
    """``[offset, offset + capacity)`` of ``parent``'s reservation as a backing of its
    own: ``reserve`` (at most ``capacity`` bytes) views the parent's tensor, commit
    and release go to the parent's chunks at ``offset``. Each pool of a shared
    budget holds one; the parent's ``committed_bytes`` is what all of them hold."""

    def __init__(self, parent: Backing, offset: int, capacity: int) -> None:
        super().__init__(parent.chunk)
        if not parent.reserved:
            raise ValueError("SliceBacking: reserve the parent's range first")
        if offset % self.chunk or capacity % self.chunk or capacity <= 0:
            raise ValueError(
                f"SliceBacking: offset {offset} and capacity {capacity} must be positive "
                f"multiples of the parent's chunk ({self.chunk} bytes)"
            )
        if offset + capacity > parent.reserved:
            raise ValueError(
                f"SliceBacking: [{offset}, {offset + capacity}) runs past the parent's "
                f"{parent.reserved}-byte reservation"
            )
        self.parent, self.offset, self.capacity = parent, offset, capacity

    def _reserve(self, size: int) -> torch.Tensor:
        if size > self.capacity:
            raise ValueError(
                f"reserve: {size} bytes asked of a {self.capacity}-byte slice of the shared "
                "reservation; give the slice more room (its capacity)"
            )
        return self.parent.tensor[self.offset : self.offset + size]

    def _commit_run(self, lo: int, hi: int) -> None:
        self.parent.commit(self.offset + lo, self.offset + hi)

    def _release(self, offset: int) -> None:
        self.parent.release(self.offset + offset, self.offset + offset + self.chunk)

    def _release_run(self, lo: int, hi: int) -> None:
        self.parent.release(self.offset + lo, self.offset + hi)

    def _unreserve(self) -> None:
        self.tensor = self.tensor[:0]


def make_backing(device: torch.device | str, chunk: int | None = None) -> Backing:
    """The backing for ``device``: ``CudaBacking`` on CUDA, else ``EmulatedBacking``;
    ``chunk`` None: ``CUDA_CHUNK_BYTES`` on CUDA, ``CHUNK_BYTES`` elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaBacking(device, CUDA_CHUNK_BYTES if chunk is None else chunk)
    return EmulatedBacking(CHUNK_BYTES if chunk is None else chunk, device)
