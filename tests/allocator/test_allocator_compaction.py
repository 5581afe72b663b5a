"""Compaction moves whole page envelopes and nothing else: the entire buffer,
seeded with random bytes, is compared byte for byte with an expectation derived
only from v2p before and after (page of v now = page of v before, for every
bound virtual page of every sub-pool; all other bytes untouched, except where a
moved page landed). Also: the in-flight forward's pages are neither reused nor
moved before its done-event, and a Mamba shortfall evicts full attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import FakeEvent, build, churn

from unikv.allocator.pages import LIVE


def _bound(alloc):
    """{sub-pool: {virtual page: physical page}} from the host mirrors."""
    out = {}
    for name, sub in alloc.parts.books.items():
        vpages = np.flatnonzero(sub.v2p_host[1:] >= 0) + 1
        out[name] = dict(zip(vpages.tolist(), sub.v2p_host[vpages].tolist()))
    return out


def _expected(pool, before_buffer, before, after):
    expected = before_buffer.clone()
    for name, pages in before.items():
        pb = pool[name].page_bytes
        for vpage, old in pages.items():
            new = after[name][vpage]
            expected[new * pb : (new + 1) * pb] = before_buffer[old * pb : (old + 1) * pb]
    return expected


@pytest.mark.parametrize("chain", ["full+swa", "full+swa+mamba"])
@pytest.mark.parametrize("ps", [1, 16])
def test_buffer_is_byte_exact_after_compaction(chain, ps):
    rng = np.random.default_rng(ps)
    moved = 0
    for trial in range(8):
        pool, alloc = build(chain, ps, requests=6)
        churn(alloc, rng, 60, pins=trial % 2 == 0, events=False)
        pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
        before, before_buffer = _bound(alloc), pool.buffer.clone()
        moved += alloc.compact()
        alloc.check_integrity()
        after = _bound(alloc)
        assert {n: set(p) for n, p in before.items()} == {n: set(p) for n, p in after.items()}, (
            "virtual ids never change"
        )
        assert torch.equal(pool.buffer, _expected(pool, before_buffer, before, after))
        for name, sub in alloc.parts.books.items():  # the band is hole-free after idle compaction
            pinned = sub.pins > 0
            if not pinned.any():
                assert sub.num_free == 0, f"{name}: idle compaction leaves no hole"
    assert moved > 0, "the random states never needed a move"


def test_shortfall_compaction_is_byte_exact():
    """An allocation that falls short compacts first; data follows the moves:
    full attention fills the pool, every other request leaves holes, then Mamba
    slots need bytes that only compacting the full band frees."""
    pool, alloc = build("full+mamba", 1, requests=8, context=24)
    slots = [alloc.new_request() for _ in range(8)]
    for _ in range(24):
        for s in slots:
            if alloc.can_admit({"full": 1})[0]:
                alloc.alloc_extend(np.array([s]), alloc.parts.requests.lens[[s]], np.array([1]))
    for s in slots[1::2]:
        alloc.free_request(s)  # holes all through the full band
    needy = np.array(slots[0::2])
    now, after = alloc.can_admit({"mamba": len(needy)})
    assert (now, after) == (False, True)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
    before, before_buffer = _bound(alloc), pool.buffer.clone()
    assert alloc.alloc_mamba(needy) is not None
    alloc.check_integrity()
    after_map = {
        n: {v: p for v, p in m.items() if v in before[n]} for n, m in _bound(alloc).items()
    }
    assert after_map != before, "this scenario is meant to move pages"
    expected = _expected(pool, before_buffer, before, after_map)
    pb = pool["mamba"].page_bytes
    for vpage, page in _bound(alloc)["mamba"].items():  # new state slots start zeroed
        if vpage not in before["mamba"]:
            expected[page * pb : (page + 1) * pb] = 0
    assert torch.equal(pool.buffer, expected)


def test_in_flight_pages_are_not_reused_or_moved():
    _, alloc = build("full+swa", 1, requests=4, context=20)
    a, b = alloc.new_request(), alloc.new_request()
    assert alloc.alloc_extend(np.array([a, b]), np.array([0, 0]), np.array([3, 3])) is not None
    full = alloc.parts.books["full"]
    freed = set(full.v2p_host[alloc.parts.requests.pages[a, :3]].tolist())
    event = FakeEvent()
    alloc.mark_in_flight(event)
    alloc.free_request(a)
    assert (full.state[list(freed)] != LIVE).all() and full.num_pending == 3
    c = alloc.new_request()
    ids = alloc.alloc_extend(np.array([c]), np.array([0]), np.array([2]))
    got = set(alloc.translate(ids, "full", physical=True).data.tolist())
    assert not got & freed, "pages the running forward may read were reused"
    live_b = full.v2p_host[alloc.parts.requests.pages[b, :3]].copy()
    assert alloc.compact() >= 0 and event.fired, "idle compaction waits for the forward"
    event2 = FakeEvent()
    alloc.mark_in_flight(event2)
    assert alloc.can_admit({"full": 1, "swa": 1})[0]
    alloc.free_request(c)
    event2.fired = True  # fired by the device: the next allocation may reuse them
    d = alloc.new_request()
    assert alloc.alloc_extend(np.array([d]), np.array([0]), np.array([1])) is not None
    assert full.num_pending == 0
    assert (full.v2p_host[alloc.parts.requests.pages[b, :3]] >= 0).all() and len(live_b) == 3


def test_transfer_fence_holds_pages_and_capacity_counts_them():
    """A page released under a transfer fence stays out of reach of compaction and
    capacity (docs/lessons.md bug 8) until its event fires."""
    _, alloc = build("full+mamba", 1, requests=2, context=24)
    r = alloc.new_request()
    full = alloc.parts.books["full"]
    total = full.num_pages - full.first_page
    assert alloc.alloc_extend(np.array([r]), np.array([0]), np.array([20])) is not None
    from unikv.ids import VirtualPageIds

    fence = FakeEvent()
    vpage = int(alloc.parts.requests.pages[r, 0])
    alloc.io.release_physical("full", VirtualPageIds(torch.tensor([vpage])), fence=fence)
    assert full.num_pending == 1
    spare = total - 20  # full pages the empty part of the pool holds
    mamba_pages = full.page_bytes * spare // alloc.parts.books["mamba"].page_bytes
    assert not alloc.can_admit({"mamba": mamba_pages + 1})[1], "a held page is not free"
    holes = full.num_free
    fence.fired = True
    alloc.parts.room.drain()
    assert full.num_pending == 0 and full.num_free == holes + 1
    alloc.check_integrity()


def test_mamba_shortfall_evicts_full_attention():
    """docs/lessons.md bug 9: the callback sees the joint picture and may free full
    attention pages to make room for a Mamba slot."""
    pictures = []

    def evict(shortfall):
        pictures.append(shortfall)
        victims = [s for s in np.flatnonzero(alloc.parts.requests.in_use) if s != needy]
        if not victims:
            return False
        alloc.free_request(
            int(max(victims, key=lambda s: alloc.parts.tokens.request_footprint(int(s))["full"]))
        )
        return True

    _, alloc = build("full+mamba", 1, requests=6, context=24, on_shortfall=evict)
    hogs = [alloc.new_request() for _ in range(4)]
    for s in hogs:
        while alloc.can_admit({"full": 1})[1] and alloc.parts.requests.lens[s] < 24:
            alloc.alloc_extend(np.array([s]), alloc.parts.requests.lens[[s]], np.array([1]))
    needy = alloc.new_request()
    assert alloc.can_admit({"mamba": 1}) == (False, False)
    slot = alloc.alloc_mamba(np.array([needy]))
    assert slot is not None and pictures
    assert pictures[0].demand == {"mamba": 1} and pictures[0].usage["full"]["live"] > 0
    assert sum(alloc.parts.requests.in_use) < 5, "a full-attention request was evicted"
    alloc.check_integrity()
