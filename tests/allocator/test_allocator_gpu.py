"""GPU only: the per-step path (alloc_decode, free_out_of_window, translate,
block table, done-event polling) runs with no host synchronisation, proved by
``torch.cuda.set_sync_debug_mode("error")``, and the device tables still mirror
the host afterwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unikv.allocator import PoolAllocator
from unikv.ids import VirtualTokenIds
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ps", [1, 16])
def test_decode_steps_do_not_sync(ps):
    batch, prompt, steps = 64, 100, 24
    configs = [
        SubPoolConfig("full", MHASpec(2, 2, 16), page_size=ps),
        SubPoolConfig("swa", MHASpec(2, 2, 16, sliding_window=40), page_size=ps),
    ]
    pages = batch * (prompt + 2 * steps) // ps + 64
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages, "swa": pages}), "cuda")
    alloc = PoolAllocator(pool, max_requests=batch, max_context=prompt + 2 * steps)
    slots = np.array([alloc.new_request() for _ in range(batch)])
    lens = np.zeros(batch, np.int64)
    assert alloc.alloc_extend(slots, lens, np.full(batch, prompt)) is not None
    lens += prompt
    table = torch.zeros((batch, alloc.parts.requests.max_pages), dtype=torch.int32, device="cuda")
    locs = torch.zeros(batch, dtype=torch.int32, device="cuda")
    slots_dev = torch.from_numpy(slots.astype(np.int32)).cuda()

    def step():
        ids = alloc.alloc_decode(slots, lens)
        assert ids is not None
        lens[:] += 1
        alloc.free_out_of_window(slots, lens)
        lens_dev = alloc.parts.writer.upload(lens.astype(np.int32))
        for name in ("full", "swa"):
            alloc.translate(ids, name, out=locs)
            alloc.block_table(slots_dev, lens_dev, name, table)
        event = torch.cuda.Event()
        event.record()
        alloc.mark_in_flight(event)
        return ids

    for _ in range(3):  # warm the caching allocators outside the check
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        last = [step() for _ in range(steps)][-1]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    alloc.check_integrity()
    want = alloc.parts.books["full"].v2p_host[last.data.cpu().numpy() // ps]
    got = (
        alloc.translate(VirtualTokenIds(last.data), "full", physical=True).data.cpu().numpy() // ps
    )
    assert np.array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_ring_never_overwrites_a_queued_upload():
    """More uploads than ring slots, some larger than a slot, queued behind a long
    kernel: every device tensor still holds its own array afterwards."""
    from unikv.allocator.device import PinnedRing

    rng = np.random.default_rng(0)
    arrays = [rng.integers(-(2**31), 2**31, int(rng.integers(0, 40))) for _ in range(50)]
    for max_slots in (4, 1024):  # a ring that must wait, one that grows instead
        ring = PinnedRing(torch.device("cuda"), slots=4, capacity=8, max_slots=max_slots)
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            big = big @ big / 64  # keep the stream busy while uploads queue up
        got = [ring(a) for a in arrays]
        torch.cuda.synchronize()
        for a, g in zip(arrays, got):
            assert np.array_equal(g.cpu().numpy(), a.astype(np.int32))
        if max_slots == 4:
            assert ring.waits > 0 and len(ring.pinned) == 4
        else:  # every upload queued behind the matmuls: the ring grew, no host sync
            assert ring.waits == 0 and len(ring.pinned) == len(arrays)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_ring_grows_to_a_step_of_uploads_then_reuses_its_slots():
    """Rounds of 100 uploads, each round queued behind a sleeping kernel (a step's
    uploads behind the previous step's forward): the first round grows the ring to
    its upload count with no host wait; later rounds, once the device has caught up,
    reuse those slots without growing; every device tensor holds its array."""
    from unikv.allocator.device import PinnedRing

    ring = PinnedRing(torch.device("cuda"), slots=8, capacity=64)
    gen = np.random.default_rng(2)
    for _ in range(3):
        torch.cuda._sleep(50_000_000)  # tens of ms of queued device work
        arrays = [gen.integers(-(2**30), 2**30, size=int(gen.integers(1, 100))) for _ in range(100)]
        got = [ring(a.copy()) for a in arrays]
        torch.cuda.synchronize()
        for a, g in zip(arrays, got, strict=True):
            assert np.array_equal(g.cpu().numpy(), a)
    assert ring.waits == 0
    assert 100 <= len(ring.pinned) <= 101  # grown once, by the first round


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_ring_wide_uploads_hold_int64():
    """``wide`` uploads (int64 in the slot's words, values past int32) mixed with int32
    ones and concatenated lists, more than the ring holds and some larger than a
    slot, queued behind a long kernel: each device tensor has its dtype and its own
    values afterwards."""
    from unikv.allocator.device import PinnedRing

    ring = PinnedRing(torch.device("cuda"), slots=4, capacity=8)
    rng = np.random.default_rng(1)
    cases = []
    for i in range(60):
        wide, size = i % 3 != 0, int(rng.integers(0, 24))
        top = 2**40 if wide else 2**31
        parts = [rng.integers(-top, top, size), rng.integers(0, 99, i % 5)]
        cases.append((wide, parts if i % 2 else np.concatenate(parts)))
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 64  # keep the stream busy while uploads queue up
    got = [ring(a if isinstance(a, np.ndarray) else list(a), wide=w) for w, a in cases]
    torch.cuda.synchronize()
    for (wide, a), g in zip(cases, got, strict=True):
        want = np.concatenate(a) if isinstance(a, list) else a
        assert g.dtype == (torch.int64 if wide else torch.int32)
        assert np.array_equal(g.cpu().numpy(), want.astype(np.int64 if wide else np.int32))


def _gpu_chain(ps, batch, context):
    configs = [
        SubPoolConfig("full", MHASpec(2, 2, 16), page_size=ps),
        SubPoolConfig("swa", MHASpec(2, 2, 16, sliding_window=40), page_size=ps),
    ]
    pages = batch * context // ps + 64
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages, "swa": pages}), "cuda")
    return PoolAllocator(pool, max_requests=batch, max_context=context)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ps", [1, 16])
def test_decode_step_does_not_sync_and_equals_the_separate_verbs(ps):
    """decode_step (direct Triton launches) under set_sync_debug_mode("error"), step
    by step equal to alloc_decode + free_out_of_window + block_table + translate
    on a twin allocator: tables, write ids and every device table."""
    batch, prompt, steps = 48, 70, 40
    verbs, fused = (
        _gpu_chain(ps, batch, prompt + steps + 1),
        _gpu_chain(ps, batch, prompt + steps + 1),
    )
    rng = np.random.default_rng(ps)
    prompts = rng.integers(1, prompt, batch)
    for alloc in (verbs, fused):
        slots = np.array([alloc.new_request() for _ in range(batch)])
        assert alloc.alloc_extend(slots, np.zeros(batch, np.int64), prompts) is not None
    cols = fused.parts.requests.max_pages
    tables = {
        n: torch.full((batch, cols), -3, dtype=torch.int32, device="cuda") for n in ("full", "swa")
    }
    locs = {n: torch.full((batch,), -3, dtype=torch.int64, device="cuda") for n in ("full", "swa")}
    for step in range(steps):
        batch_slots = np.sort(rng.choice(batch, int(rng.integers(1, batch + 1)), replace=False))
        lens = verbs.parts.requests.lens[batch_slots].copy()
        ids = verbs.alloc_decode(batch_slots, lens)
        verbs.free_out_of_window(batch_slots, lens + 1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = fused.decode_step(batch_slots, lens, block_tables=tables, write_ids=locs)
            event = torch.cuda.Event()
            event.record()
            fused.mark_in_flight(event)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert got is not None and torch.equal(got.virtual_ids.data, ids.data)
        slots_dev = torch.from_numpy(batch_slots.astype(np.int32)).cuda()
        lens_dev = torch.from_numpy((lens + 1).astype(np.int32)).cuda()
        for name, window in (("full", 0), ("swa", 40)):
            table = torch.empty((len(batch_slots), cols), dtype=torch.int32, device="cuda")
            verbs.block_table(slots_dev, lens_dev, name, table, window=window)
            assert torch.equal(got.block_tables[name].data, table), (step, name)
            want = verbs.translate(ids, name).data.long()
            assert torch.equal(got.write_ids[name].data, want), (step, name)
        for name in ("full", "swa"):
            assert torch.equal(fused.parts.books[name].v2p, verbs.parts.books[name].v2p)
            assert torch.equal(fused.parts.books[name].p2v, verbs.parts.books[name].p2v)
        assert torch.equal(fused.parts.requests.req_to_token, verbs.parts.requests.req_to_token)
    torch.cuda.synchronize()
    fused.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("side", [True, False])
def test_pinned_ring_uploads_are_seen_in_stream_order(monkeypatch, side):
    """The ring's copies (on a side stream or on the caller's) against the arrays they
    were given: 200 uploads through 8 slots, read on the caller's stream, alternately
    behind a sleeping kernel there (a slot or device block rewritten under a pending
    reader reads wrong values) and with the side stream asleep (a reader not made to
    wait for its copy reads them before they land)."""
    from unikv.allocator import device

    monkeypatch.setattr(device, "SIDE_COPY", side)
    ring = device.PinnedRing(torch.device("cuda"), slots=8, capacity=64)
    gen = np.random.default_rng(0)
    arrays = [gen.integers(-(2**30), 2**30, size=int(gen.integers(1, 300))) for _ in range(200)]
    reads = []
    for i, array in enumerate(arrays):
        if i % 2 or ring._side is None:
            torch.cuda._sleep(20_000)  # the caller's stream is busy when the copy is enqueued
        else:
            with torch.cuda.stream(ring._side):
                torch.cuda._sleep(20_000)  # the copy lands late
        reads.append(ring(array.copy()).to(torch.int64) + 0)
    torch.cuda.synchronize()
    for array, got in zip(arrays, reads, strict=True):
        assert np.array_equal(got.cpu().numpy(), array)
