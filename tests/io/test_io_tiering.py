"""Offload / reload by virtual page through the allocator's I/O hooks.

The oracle: every page's contents read through the layout's (page, slot) views
at the physical page ``v2p`` names, before the offload and after the reload
(which lands in other physical pages); other requests' contents are unchanged;
the allocator's own ``check_integrity`` holds after every step. A fake
done-event (fired by the test) drives the fence and pin protocol on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import FakeEvent
from test_io_support import assert_same_contents, page_contents

from unikv.allocator import PoolAllocator
from unikv.ids import VirtualPageIds
from unikv.io import HostTier
from unikv.io.tiering import Tiering
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, MHASpec, StatePart

PS = 4
CONFIGS = [
    SubPoolConfig("full", MHASpec(2, 2, 8, dtype=torch.bfloat16), page_size=PS),
    SubPoolConfig("swa", MHASpec(1, 2, 4, dtype=torch.float16, sliding_window=16), page_size=PS),
    SubPoolConfig("mamba", MambaSpec(2, (StatePart((3, 4)),), StatePart((2, 4)))),
]


def _scramble(pool: UnifiedPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=gen))


def _setup(pages: int = 12):
    pool = UnifiedPool(CONFIGS, pool_bytes_for(CONFIGS, {"full": pages, "swa": pages, "mamba": 4}))
    _scramble(pool, 0)
    alloc = PoolAllocator(pool, max_requests=4, max_context=64)
    return pool, alloc


def _request(alloc: PoolAllocator, tokens: int) -> int | None:
    slot = alloc.new_request()
    if alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([tokens])) is None:
        alloc.free_request(slot)
        return None
    assert alloc.alloc_mamba(np.array([slot])) is not None
    return slot


def _vpages(alloc: PoolAllocator, slot: int, tokens: int, name: str) -> VirtualPageIds:
    """The request's virtual pages, from req_to_token (Mamba: slot + 1)."""
    if name == "mamba":
        return VirtualPageIds(torch.tensor([slot + 1]), name)
    return VirtualPageIds(alloc.parts.requests.req_to_token[slot, :tokens:PS].long() // PS, name)


def _contents(pool, alloc, vpages: VirtualPageIds, name: str) -> list[torch.Tensor]:
    phys = alloc.parts.books[name].v2p_host[vpages.data.numpy()]
    assert (phys > 0).all()
    return page_contents(pool, name, phys.tolist())


def _host_state(alloc: PoolAllocator) -> list[np.ndarray]:
    return [
        a.copy()
        for s in alloc.parts.books.values()
        for a in (s.v2p_host, s.p2v_host, s.state, s.pins)
    ]


def test_offload_then_reload_elsewhere_keeps_every_byte() -> None:
    pool, alloc = _setup()
    r0, r1 = _request(alloc, 20), _request(alloc, 12)
    tiers = {n: Tiering(alloc, HostTier(pool, n, 8)) for n in ("full", "swa", "mamba")}
    vp = {n: _vpages(alloc, r0, 20, n) for n in tiers}
    before = {n: _contents(pool, alloc, vp[n], n) for n in tiers}
    old_phys = {n: alloc.parts.books[n].v2p_host[vp[n].data.numpy()].copy() for n in tiers}
    off = {n: tiers[n].offload(vp[n]) for n in tiers}
    for n in tiers:  # tombstones on host and device; the request still owns them
        assert (alloc.parts.books[n].v2p_host[vp[n].data.numpy()] == -1).all()
        assert (alloc.parts.books[n].v2p[vp[n].data] == -1).all()
    alloc.check_integrity()

    _scramble(pool, 1)  # the freed pages get new bytes; reload must read the host
    others = {n: _contents(pool, alloc, _vpages(alloc, r1, 12, n), n) for n in tiers}
    r2 = _request(alloc, 16)  # takes freed pages: the reload has to land elsewhere
    assert r2 is not None
    for n, tiering in tiers.items():
        assert tiering.reload(off[n]) is not None
        assert tiering.tier.num_free == 8 and tiering.num_in_flight == 0
    alloc.check_integrity()
    for n in tiers:
        assert_same_contents(_contents(pool, alloc, vp[n], n), before[n])
        assert_same_contents(_contents(pool, alloc, _vpages(alloc, r1, 12, n), n), others[n])
        new_phys = alloc.parts.books[n].v2p_host[vp[n].data.numpy()]
        assert not np.array_equal(new_phys, old_phys[n])  # really other physical pages
        assert (alloc.parts.books[n].pins == 0).all()


def test_full_host_tier_or_full_pool_returns_none_and_changes_nothing() -> None:
    pool, alloc = _setup(pages=8)
    r0 = _request(alloc, 20)
    small = Tiering(alloc, HostTier(pool, "full", 2))
    state, buffer = _host_state(alloc), pool.buffer.clone()
    assert small.offload(_vpages(alloc, r0, 20, "full")) is None
    assert all(np.array_equal(a, b) for a, b in zip(state, _host_state(alloc)))
    assert torch.equal(pool.buffer, buffer) and small.tier.num_free == 2

    tiering = Tiering(alloc, HostTier(pool, "full", 8))
    vp = _vpages(alloc, r0, 20, "full")
    want = _contents(pool, alloc, vp, "full")
    off = tiering.offload(vp)
    filler, tokens = alloc.new_request(), 0
    while alloc.alloc_extend(np.array([filler]), np.array([tokens]), np.array([PS])) is not None:
        tokens += PS  # grow one request until the pool is full
    assert tokens < 64, "the pool, not max_context, must stop the filler"
    state = _host_state(alloc)
    assert tiering.reload(off) is None
    assert all(np.array_equal(a, b) for a, b in zip(state, _host_state(alloc)))
    assert tiering.tier.num_free == 8 - 5  # the host copy is kept
    alloc.free_request(filler)
    assert tiering.reload(off) is not None
    assert_same_contents(_contents(pool, alloc, vp, "full"), want)
    alloc.check_integrity()


def test_fences_and_pins_hold_until_the_copy_event_fires() -> None:
    pool, alloc = _setup()
    r0 = _request(alloc, 20)
    tiering = Tiering(alloc, HostTier(pool, "full", 12))
    event = FakeEvent()

    def launch(stream, copy, pages, slots, writers):  # a copy whose event the test fires
        copy(pages, slots, None)
        return event

    tiering.tier._launch = launch
    vp = _vpages(alloc, r0, 20, "full")
    off = tiering.offload(vp)
    assert (
        alloc.parts.room.shortfall({}, 0).usage["full"]["pending"] == 5
    )  # released, but not reusable yet
    event.fired = True
    alloc.can_admit({})  # drains fired fences
    assert alloc.parts.room.shortfall({}, 0).usage["full"]["pending"] == 0

    event = FakeEvent()
    copy = tiering.reload(off)
    assert not copy.done() and tiering.num_in_flight == 1
    assert alloc.parts.room.shortfall({}, 0).usage["full"]["pinned"] == 5
    assert tiering.tier.num_free == 7  # slots read by the running reload stay taken
    pages = alloc.parts.books["full"].v2p_host[vp.data.numpy()].copy()
    alloc.compact()
    assert np.array_equal(alloc.parts.books["full"].v2p_host[vp.data.numpy()], pages)  # not moved
    with pytest.raises(ValueError, match="pinned"):
        tiering.offload(vp)  # a page still being written cannot leave again
    assert tiering.tier.num_free == 7  # the refused offload gave its slots back
    event.fired = True
    assert (
        tiering.num_in_flight == 0
        and alloc.parts.room.shortfall({}, 0).usage["full"]["pinned"] == 0
    )
    assert tiering.tier.num_free == 12
    alloc.check_integrity()


def test_offload_refuses_unbound_pages() -> None:
    pool, alloc = _setup()
    r0 = _request(alloc, 8)
    tiering = Tiering(alloc, HostTier(pool, "full", 8))
    vp = _vpages(alloc, r0, 8, "full")
    tiering.offload(vp)
    with pytest.raises(ValueError, match="hold no physical page"):
        tiering.offload(vp)
    assert tiering.tier.num_free == 6
