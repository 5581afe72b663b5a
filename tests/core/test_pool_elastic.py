"""The elastic pool (issue 44, docs/design.md section 4): the emulated backing,
``UnifiedPool.resize`` and ``Room.resize`` (``alloc.resize``).

The state machine interleaves grow, shrink, admit (open + extend), decode,
window frees, finish, compaction and forward fences on 2- and 3-sub-pool chains,
with ``check_integrity`` after every step and a byte shadow: every bound page's
whole envelope is filled with random bytes when it is first seen bound and must
read them back after every later step, wherever compaction moved it, so a shrink
that drops, overlaps or releases a held byte fails. Released chunks of the
emulated backing are poisoned (0xFF), and every bound page must lie in committed
chunks. A refused shrink must leave every piece of state (bytes included)
unchanged, and may only happen when the occupied pages cannot fit by a bound
derived here, not by the packer.
"""

from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest
import torch
from allocator_fixtures import CHAINS, PAGES, FakeEvent, snapshot
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from unikv.allocator import PoolAllocator
from unikv.backing import POISON_BYTE, EmulatedBacking, make_backing
from unikv.engine.budget import (
    addressable_bytes,
    one_request_bytes,
    size_after_capture,
)
from unikv.layout import INT32_LIMIT, IdMap
from unikv.pool import Grow, UnifiedPool, pool_bytes_for

CHUNK = 256  # small chunks: resizes cross many chunk edges


def elastic(chain: str, ps: int, scale: float = 1.0, grow: float = 3.0, **kwargs):
    configs = CHAINS[chain](ps)
    base = pool_bytes_for(configs, {c.name: PAGES[c.name] for c in configs})
    total = int(base * scale)
    pool = UnifiedPool(
        configs, total, max_bytes=int(base * grow), backing=EmulatedBacking(CHUNK), **kwargs
    )
    return pool


# -- the backing --------------------------------------------------------------------------


def test_backing_commits_releases_and_poisons():
    b = EmulatedBacking(chunk=64)
    t = b.reserve(1000)
    assert b.reserved == 1024 and t.numel() == 1024 and b.committed == []
    assert (t == POISON_BYTE).all(), "never-committed memory reads as poison"
    base = t.data_ptr()
    assert b.commit(0, 256) == 256 and b.commit(128, 384) == 128
    assert b.committed == [(0, 384)] and b.committed_bytes == 384
    assert (t[:384] == 0).all()
    t[:384] = 7
    assert b.release(64, 128) == 64 and b.committed == [(0, 64), (128, 384)]
    assert (t[64:128] == POISON_BYTE).all() and (t[:64] == 7).all() and (t[128:384] == 7).all()
    assert not b.is_committed(60, 70) and b.is_committed(0, 64) and b.is_committed(130, 384)
    assert b.tensor.data_ptr() == base, "the base never moves"
    for lo, hi in ((1, 64), (0, 2048), (64, 0)):
        with pytest.raises(ValueError, match="chunk-aligned"):
            b.commit(lo, hi)
    with pytest.raises(ValueError, match="already"):
        b.reserve(10)
    b.close()
    assert b.committed == [] and b.reserved == 0
    assert isinstance(make_backing("cpu"), EmulatedBacking)


def test_pool_geometry_grows_and_shrinks_in_place():
    pool = elastic("full+swa+mamba", 4)
    total = pool.total_bytes
    views = {n: [t.data_ptr() for t in _flat(s.views)] for n, s in pool.subpools.items()}
    base = pool.buffer.data_ptr()
    pool.buffer[pool.sink_bytes :] = 3
    pool.resize(2 * total)
    assert pool.total_bytes == 2 * total and pool.buffer.numel() == 2 * total + pool.tail_pad_bytes
    assert pool.buffer.data_ptr() == base
    assert pool.backing.committed == [(0, -(-(2 * total + pool.tail_pad_bytes) // CHUNK) * CHUNK)]
    for name, sub in pool.subpools.items():
        assert sub.num_pages == 2 * total // sub.page_bytes
        assert [t.data_ptr() for t in _flat(sub.views)] == views[name], "views never change"
    assert (pool.buffer[pool.sink_bytes : total] == 3).all(), "growth keeps the bytes"
    pool.resize(total)
    end = -(-(total + pool.tail_pad_bytes) // CHUNK) * CHUNK
    assert pool.backing.committed == [(0, end)]
    assert (pool.whole[end:] == POISON_BYTE).all(), "released chunks are poisoned"
    with pytest.raises(ValueError, match="max_bytes"):
        pool.resize(pool.max_bytes + 1)
    with pytest.raises(ValueError, match="fits no real page"):
        pool.resize(pool.sink_bytes)
    fixed = UnifiedPool(CHAINS["full+swa"](4), total)
    with pytest.raises(ValueError, match="elastic"):
        fixed.resize(total)
    with pytest.raises(ValueError, match="static_split"):
        elastic("full+swa", 4, static_split={"full": 0.5, "swa": 0.5})


def test_resize_refuses_below_one_worst_case_request():
    pool = elastic("full+swa", 4, max_request_tokens=40)
    with pytest.raises(ValueError, match="one worst-case request"):
        pool.resize(pool.sink_bytes + 2 * pool["full"].page_bytes)
    pool.alone_demand = {"full": 12, "swa": 12}  # a stricter rule (prefix caching's windows)
    with pytest.raises(ValueError, match="one worst-case request"):
        pool.resize(pool_bytes_for(CHAINS["full+swa"](4), {"full": 10, "swa": 10}))
    pool.resize(pool_bytes_for(CHAINS["full+swa"](4), {"full": 12, "swa": 12}))


def test_size_after_capture_arithmetic():
    configs = CHAINS["full+swa"](4)
    least = one_request_bytes(configs, 40, 8)
    UnifiedPool(configs, least, max_request_tokens=40, chunk_tokens=8)  # runs one alone
    with pytest.raises(ValueError, match="cannot run alone"):
        UnifiedPool(configs, least - 200, max_request_tokens=40, chunk_tokens=8)
    pool = UnifiedPool(configs, least, max_bytes=10 * least, backing=EmulatedBacking(CHUNK))
    assert size_after_capture(pool, free=5 * CHUNK + 7, margin=2 * CHUNK) == least + 3 * CHUNK
    assert size_after_capture(pool, free=CHUNK, margin=2 * CHUNK) == least, "never below"
    assert size_after_capture(pool, free=1 << 40, margin=0) == 10 * least, "never above max"
    with pytest.raises(ValueError, match="margin"):
        size_after_capture(pool, free=0, margin=-1)
    most = addressable_bytes(configs)  # kernel ids of the largest grid fit int32, no more
    for c in configs:
        ids, pb = IdMap.of(c.spec, c.page_size), c.spec.page_bytes(c.page_size)
        assert ids.limit(most // pb) <= INT32_LIMIT
    assert any(
        IdMap.of(c.spec, c.page_size).limit(most // c.spec.page_bytes(c.page_size) + 1)
        > INT32_LIMIT
        for c in configs
    )
    with pytest.raises(ValueError, match="kernel ids reach"):  # checked before reserving
        UnifiedPool(configs, least, max_bytes=most + (1 << 20), backing=EmulatedBacking(CHUNK))


def _flat(views):
    if isinstance(views, torch.Tensor):
        return [views]
    if isinstance(views, dict):
        return [t for k in sorted(views) for t in _flat(views[k])]
    return [t for v in views for t in _flat(v)]


# -- the allocator over an elastic pool: a state machine --------------------------------------


class ElasticMachine(RuleBasedStateMachine):
    CHAIN, PS = "full+swa", 4

    def __init__(self) -> None:
        super().__init__()
        self.pool = elastic(self.CHAIN, self.PS, scale=1.0, grow=4.0)
        self.alloc = PoolAllocator(self.pool, max_requests=4, max_context=12 * self.PS)
        self.parts = self.alloc.parts
        self.rng = np.random.default_rng(0)
        self.shadow: dict[tuple[str, int], torch.Tensor] = {}  # (name, vpage) -> envelope
        self.event: FakeEvent | None = None
        self.counts = {"grow": 0, "shrink": 0, "refused": 0, "moved": 0}

    # -- helpers ------------------------------------------------------------------------

    def _open(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(self.parts.requests.in_use)]

    def _bound(self) -> dict[tuple[str, int], int]:
        """(name, virtual page) -> physical page of every bound page."""
        out = {}
        for name, book in self.parts.books.items():
            for v in np.flatnonzero(book.v2p_host[1:] > 0) + 1:
                out[(name, int(v))] = int(book.v2p_host[v])
        return out

    def _sync_shadow(self) -> None:
        """Fill pages first seen bound with random bytes; forget unbound ones."""
        bound = self._bound()
        for key in [k for k in self.shadow if k not in bound]:
            del self.shadow[key]
        for key, page in bound.items():
            if key not in self.shadow:
                envelope = self.pool.page_envelope(key[0], page)
                data = torch.from_numpy(self.rng.integers(0, 255, envelope.numel(), np.uint8))
                envelope.copy_(data)
                self.shadow[key] = data

    def _min_bytes(self) -> int:
        """A size that surely holds every occupied page (each band rounded by one
        page of its grid): an independent bound, not the packer."""
        books = self.parts.books.values()
        return self.pool.sink_bytes + sum(
            (b.num_live + b.num_pending + 1) * b.page_bytes for b in books
        )

    # -- rules ------------------------------------------------------------------------------

    @rule()
    def open_request(self):
        if len(self._open()) < self.parts.requests.max_requests:
            self.alloc.new_request()

    @precondition(lambda self: bool(self._open()))
    @rule(data=st.data())
    def extend(self, data):
        slot = data.draw(st.sampled_from(self._open()))
        held = int(self.parts.requests.lens[slot])
        ext = data.draw(st.integers(1, 3 * self.PS))
        if held + ext <= self.parts.requests.max_context:
            self.alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([ext]))
            if self.parts.mamba is not None and self.parts.books["mamba"].v2p_host[slot + 1] < 0:
                self.alloc.alloc_mamba(np.array([slot]))

    @rule()
    def fill(self):
        """Open a request if a slot is free, then give every request two more pages."""
        self.open_request()
        for slot in self._open():
            held = int(self.parts.requests.lens[slot])
            ext = min(2 * self.PS, self.parts.requests.max_context - held)
            if ext > 0:
                self.alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([ext]))

    @precondition(lambda self: bool(self._open()))
    @rule()
    def decode(self):
        slots = np.array(self._open())
        lens = self.parts.requests.lens[slots]
        keep = lens + 1 <= self.parts.requests.max_context
        if keep.any():
            self.alloc.alloc_decode(slots[keep], lens[keep])

    @precondition(lambda self: bool(self._open()) and "swa" in self.parts.books)
    @rule()
    def free_out_of_window(self):
        slots = np.array(self._open())
        self.alloc.free_out_of_window(slots, self.parts.requests.lens[slots])

    @precondition(lambda self: bool(self._open()))
    @rule(data=st.data())
    def finish(self, data):
        self.alloc.free_request(data.draw(st.sampled_from(self._open())))

    @rule()
    def start_forward(self):
        self.event = FakeEvent()
        self.alloc.mark_in_flight(self.event)

    @precondition(lambda self: self.event is not None)
    @rule()
    def finish_forward(self):
        self.event.fired = True
        self.event = None

    @rule()
    def compact(self):
        self.alloc.compact()

    @rule(data=st.data())
    def grow(self, data):
        old = self.pool.total_bytes
        if old >= self.pool.max_bytes:
            return
        new = data.draw(st.integers(old + 1, self.pool.max_bytes))
        assert self.alloc.resize(new) == 0, "growth moves no page"
        self.counts["grow"] += 1
        gained = {n: b.num_pages for n, b in self.parts.books.items()}
        down = next((b for b in self.parts.books.values() if b.grow == Grow.DOWN), None)
        up = next((b for b in self.parts.books.values() if b.grow == Grow.UP), None)
        if down is not None and down.name != self.parts.roles.owner:
            return
        if down is not None:  # the new top pages are the DOWN band's at once, no page moved
            extra = (new - old) // down.page_bytes
            vfree = self.parts.vspace.num_free
            assert self.alloc.can_admit({down.name: min(extra, vfree)}) == (True, True), gained
        if up is not None:  # and any band's after compaction
            extra = max(0, (new - old) // up.page_bytes - 2)
            assert self.alloc.can_admit({up.name: extra})[1], (extra, gained)

    @rule(data=st.data())
    def shrink(self, data):
        old = self.pool.total_bytes
        low = self.pool.sink_bytes + 2 * max(s.page_bytes for s in self.pool.subpools.values())
        if old <= low:
            return
        tight = self._min_bytes()  # near what the occupied pages need: moves and refusals
        big = max(b.page_bytes for b in self.parts.books.values())
        lo, hi = max(low, tight - 6 * big), max(low, min(old - 1, tight + 2 * big))
        near = st.integers(min(lo, hi), hi)
        new = data.draw(st.one_of(near, near, st.integers(low, old - 1)))
        self.parts.room.drain()  # fired fences' pages become holes (resize drains first)
        before = snapshot(self.alloc)
        try:
            self.counts["moved"] += self.alloc.resize(new)
        except ValueError as e:
            assert "cannot hold what the running requests need" in str(e), str(e)
            assert snapshot(self.alloc) == before, "a refused shrink changed the state"
            assert self._min_bytes() > new, (
                f"refused {new} bytes though {self._min_bytes()} surely hold the occupied pages"
            )
            self.counts["refused"] += 1
            least = int(re.search(r"the least size that holds them is (\d+) bytes", str(e))[1])
            assert new < least <= old, (new, least, old)
            with pytest.raises(ValueError):  # and it is the least
                self.alloc.resize(least - 1)
            assert snapshot(self.alloc) == before
            self.counts["moved"] += self.alloc.resize(least)  # the message's size holds
            self.counts["shrink"] += least < old
            return
        self.counts["shrink"] += 1
        assert self.pool.total_bytes == new
        assert self.pool.backing.committed_bytes < (new + self.pool.tail_pad_bytes) + CHUNK

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def integrity_and_shadow(self):
        self.alloc.check_integrity()
        self._sync_shadow()
        backing = self.pool.backing
        for (name, v), data in self.shadow.items():
            page = int(self.parts.books[name].v2p_host[v])
            pb = self.pool[name].page_bytes
            assert page < self.pool[name].num_pages
            assert backing.is_committed(page * pb, (page + 1) * pb), f"{name}: page uncommitted"
            assert torch.equal(self.pool.page_envelope(name, page), data), (
                f"{name}: virtual page {v} lost its bytes (now at page {page})"
            )


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),
)


@pytest.mark.parametrize(
    ("chain", "ps"), [("full+swa", 4), ("full+swa+mamba", 1), ("mla+swa", 4), ("swa+mamba", 1)]
)
def test_elastic_state_machine(chain, ps):
    counts: dict[str, int] = {}

    class Machine(ElasticMachine):
        CHAIN, PS = chain, ps

        def teardown(self):
            for k, v in self.counts.items():
                counts[k] = counts.get(k, 0) + v

    run_state_machine_as_test(Machine, settings=SETTINGS)
    print(chain, ps, counts)
    assert counts["grow"] >= 20 and counts["shrink"] >= 20 and counts["refused"] >= 5, counts
    assert counts["moved"] >= 10, counts  # shrinks moved live pages below the new top


# -- CudaBacking's driver protocol, against a fake driver (the real one: -m gpu) ------------


class FakeDriver:
    """Just enough of ``cuda.bindings.driver`` to check CudaBacking's bookkeeping:
    every map lies in the reservation on unmapped chunks, access is set only on
    mapped ranges, every handle is released once, and nothing leaks."""

    CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
    CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    GRANULE = 4096

    def __init__(self) -> None:
        self.reserved: dict[int, int] = {}
        self.mapped: dict[int, int] = {}  # address -> handle, one granule each
        self.handles: set[int] = set()
        self.next_handle = 1
        self.fail_create_after: int | None = None
        self.unmap_calls = self.refused_runs = 0

    @staticmethod
    def CUmemAllocationProp():
        return types.SimpleNamespace(location=types.SimpleNamespace())

    CUmemAccessDesc = CUmemAllocationProp

    def cuInit(self, flags):
        return (0,)

    def cuDeviceGet(self, index):
        return (0, index)

    def cuDevicePrimaryCtxRetain(self, device):
        return (0, "ctx")

    def cuCtxSetCurrent(self, ctx):
        assert ctx == "ctx"
        return (0,)

    def cuGetErrorName(self, err):
        return (0, b"CUDA_ERROR_OUT_OF_MEMORY")

    def cuMemGetAllocationGranularity(self, prop, flag):
        return (0, self.GRANULE)

    def cuMemAddressReserve(self, size, align, addr, flags):
        assert size % self.GRANULE == 0 and align % self.GRANULE == 0
        base = (1 << 40) + len(self.reserved) * (1 << 36)
        self.reserved[base] = size
        return (0, base)

    def cuMemAddressFree(self, ptr, size):
        assert self.reserved.pop(ptr) == size
        assert not any(ptr <= a < ptr + size for a in self.mapped), "freed a mapped range"
        return (0,)

    def cuMemCreate(self, size, prop, flags):
        assert size == self.GRANULE * (size // self.GRANULE) and prop.location.id == 0
        if self.fail_create_after is not None:
            if self.fail_create_after == 0:
                return (2, None)
            self.fail_create_after -= 1
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.handles.add(handle)
        return (0, handle)

    def cuMemRelease(self, handle):
        self.handles.remove(handle)
        assert handle not in self.mapped.values(), "released a mapped handle"
        return (0,)

    def _inside(self, ptr, size):
        return any(b <= ptr and ptr + size <= b + s for b, s in self.reserved.items())

    def cuMemMap(self, ptr, size, offset, handle, flags):
        assert self._inside(ptr, size) and size == self.GRANULE and handle in self.handles
        assert ptr not in self.mapped, "mapped twice"
        self.mapped[ptr] = handle
        return (0,)

    def cuMemSetAccess(self, ptr, size, descs, count):
        assert count == len(descs) == 1 and descs[0].flags == 3
        for a in range(ptr, ptr + size, self.GRANULE):
            assert a in self.mapped, "access set on an unmapped address"
        return (0,)

    unmap_runs = True  # False: a driver that unmaps one mapping per call only

    def cuMemUnmap(self, ptr, size):
        """A range of whole mappings (CUDA's samples unmap several at once); with
        ``unmap_runs`` off, more than one mapping is CUDA_ERROR_INVALID_VALUE."""
        assert size % self.GRANULE == 0 and size > 0
        if size > self.GRANULE and not self.unmap_runs:
            self.refused_runs += 1
            return (1,)
        for a in range(ptr, ptr + size, self.GRANULE):
            assert a in self.mapped, "unmapped an unmapped chunk"
        for a in range(ptr, ptr + size, self.GRANULE):
            del self.mapped[a]
        self.unmap_calls += 1
        return (0,)


def test_cuda_backing_protocol_against_a_fake_driver(monkeypatch):
    from unikv.backing import CudaBacking

    fake = FakeDriver()
    package = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = fake
    package.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)

    class HostWrapped(CudaBacking):
        def _start_torch(self):
            pass

        def _wrap(self, memory):
            self.memory = memory
            return torch.zeros(memory.__cuda_array_interface__["shape"], dtype=torch.uint8)

    b = HostWrapped("cuda", chunk=3000)  # rounded up to the granularity
    g = FakeDriver.GRANULE
    assert b.chunk == g
    b.reserve(10 * g + 1)
    base = b.memory.__cuda_array_interface__["data"][0]
    assert b.reserved == 11 * g and b.committed == [(0, g)], "chunk 0 mapped for the wrap"
    assert set(fake.mapped) == {base}
    b.commit(0, 5 * g)
    b.release(g, 3 * g)
    b.commit(2 * g, 8 * g)
    assert b.committed == [(0, g), (2 * g, 8 * g)]
    assert set(fake.mapped) == {base + i * g for i in (0, 2, 3, 4, 5, 6, 7)}
    fake.fail_create_after = 1  # out of memory on the second chunk of a run
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        b.commit(8 * g, 11 * g)
    assert b.committed == [(0, g), (2 * g, 8 * g)], "a failed run commits nothing"
    assert set(fake.mapped) == {base + i * g for i in (0, 2, 3, 4, 5, 6, 7)}
    assert len(fake.handles) == 7
    fake.fail_create_after = None
    for _ in range(50):  # resize cycles: no handle leaks
        b.commit(8 * g, 11 * g)
        b.release(4 * g, 11 * g)
        b.commit(4 * g, 8 * g)
    calls = fake.unmap_calls
    b.release(4 * g, 8 * g)  # one run of 4 chunks: one unmap call
    assert fake.unmap_calls == calls + 1 and b.committed == [(0, g), (2 * g, 4 * g)]
    fake.unmap_runs = False  # a driver refusing a run: one unmap per chunk instead
    b.commit(4 * g, 8 * g)
    b.release(3 * g, 8 * g)
    assert fake.refused_runs == 1 and fake.unmap_calls == calls + 1 + 5
    assert set(fake.mapped) == {base, base + 2 * g} and len(fake.handles) == 2
    b.close()
    assert not fake.mapped and not fake.handles and not fake.reserved, "everything went back"


@pytest.mark.parametrize("held", ["pin", "transfer"])
def test_shrink_keeps_pinned_and_transfer_held_pages_in_place(held):
    """A pinned page, or one a transfer fence still holds, is never moved: a
    shrink below it is refused with nothing changed, and accepted once it goes."""
    from unikv.ids import PhysicalPageIds, VirtualPageIds

    pool = elastic("full+swa", 4, scale=2.0, grow=2.0)
    alloc = PoolAllocator(pool, max_requests=4, max_context=48, debug=True)
    full = alloc.parts.books["full"]
    a, b = alloc.new_request(), alloc.new_request()
    for slot in (a, b):
        alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([16]))
    vpages = alloc.parts.requests.held_pages(a)
    vpage = int(vpages[np.argmax(full.v2p_host[vpages])])
    top = int(full.v2p_host[vpage])  # a's highest page, above the half
    assert top * full.page_bytes >= pool.total_bytes // 2
    event = FakeEvent()
    if held == "pin":
        alloc.io.pin("full", PhysicalPageIds(torch.tensor([top]), "full"))
    else:
        alloc.io.release_physical("full", VirtualPageIds(torch.tensor([vpage])), event)
    alloc.free_request(b)  # holes below: everything else could move down
    small = pool.total_bytes // 2
    before = snapshot(alloc)
    with pytest.raises(ValueError, match="running requests need"):
        alloc.resize(small)
    assert snapshot(alloc) == before
    if held == "pin":
        alloc.io.unpin("full", PhysicalPageIds(torch.tensor([top]), "full"))
    else:
        event.fired = True
    assert alloc.resize(small) >= 0
    alloc.check_integrity()
    assert pool.total_bytes == small
