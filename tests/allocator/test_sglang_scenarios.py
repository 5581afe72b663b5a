"""SGLang's unified-pool scenarios (its multi-ended allocator and SWA composite
unit tests), re-told against unikv's PoolAllocator in unikv's own terms.

Oracles, all independent of the allocator's bookkeeping:
- a marker cache in the real pool: each bound virtual page's envelope holds a
  byte pattern derived from (sub-pool, virtual page), so after any compaction the
  data must be found where ``v2p`` now points;
- hole-free bands after compaction, read from ``p2v`` alone: the live pages are
  one run at the band's far end (UP from its first page, DOWN up to its last);
- live virtual pages plus free ones cover the id space; ``v2p``/``p2v`` inverse;
- availability from a brute-force enumeration of byte placements.

SGLang compacts eagerly on every free; unikv compacts lazily, so the scenarios
call ``compact()`` where SGLang's free would have compacted.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from allocator_fixtures import snapshot

from unikv.allocator import PoolAllocator
from unikv.ids import VirtualPageIds, VirtualTokenIds
from unikv.pool import Grow, SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, MHASpec, StatePart

F16 = torch.float16


def full_mamba(ps: int = 1, full_pages: int = 64, mamba_slots: int = 16) -> PoolAllocator:
    """SGLang's pair: 2-layer MHA (2 heads, dim 4, fp16) and a 2-layer Mamba state
    (conv (4, 3), temporal (2, 2, 2), fp32). unikv's default placement: full
    attention grows down, Mamba up."""
    configs = [
        SubPoolConfig("full", MHASpec(2, 2, 4, dtype=F16), ps),
        SubPoolConfig("mamba", MambaSpec(2, (StatePart((4, 3)),), StatePart((2, 2, 2)))),
    ]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": full_pages, "mamba": mamba_slots}))
    context = (pool["full"].num_pages + 1) * ps  # one request may take every page
    return PoolAllocator(pool, max_requests=mamba_slots + 8, max_context=context)


def full_swa(ps: int = 1, full_pages: int = 32, swa_pages: int = 16, layers=(4, 2)):
    """SGLang's SWA composite: full attention and a sliding-window sub-pool of the
    same heads; the window is wide (only explicit SWA frees release SWA pages)."""
    full = MHASpec(layers[0], 2, 4, dtype=F16)
    swa = MHASpec(layers[1], 2, 4, dtype=F16, sliding_window=10**6)
    configs = [SubPoolConfig("full", full, ps), SubPoolConfig("swa", swa, ps)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": full_pages, "swa": swa_pages}))
    return PoolAllocator(pool, max_requests=16, max_context=full_pages * ps)


class Markers:
    """Per sub-pool, the virtual pages whose envelope carries a known pattern."""

    def __init__(self, alloc: PoolAllocator) -> None:
        self.alloc = alloc
        self.marked: dict[str, set[int]] = {name: set() for name in alloc.parts.books}

    def _pattern(self, name: str, vpage: int) -> torch.Tensor:
        pb = self.alloc.pool[name].page_bytes
        seed = 7 * vpage + 3 * len(name)
        return ((torch.arange(pb, dtype=torch.int64) * 13 + seed) % 251).to(torch.uint8)

    def stamp(self, name: str, vpages) -> None:
        sub = self.alloc.parts.books[name]
        for v in np.asarray(vpages).tolist():
            page = int(sub.v2p_host[v])
            self.alloc.pool.page_envelope(name, page).copy_(self._pattern(name, v))
            self.marked[name].add(v)

    def check(self) -> None:
        """Every marked page still bound holds its pattern; unbound ones are forgotten."""
        for name, vpages in self.marked.items():
            sub = self.alloc.parts.books[name]
            for v in sorted(vpages):
                page = int(sub.v2p_host[v])
                if page < 0:
                    vpages.discard(v)
                    continue
                envelope = self.alloc.pool.page_envelope(name, page)
                assert torch.equal(envelope, self._pattern(name, v)), f"{name}: page {v} drifted"


def request_vpages(alloc: PoolAllocator, slot: int) -> np.ndarray:
    return alloc.parts.requests.pages[
        slot, : int(alloc.parts.requests.num_pages(np.array([slot]))[0])
    ].copy()


def extend(alloc: PoolAllocator, slot: int, pages: int, markers: Markers | None = None) -> bool:
    held = int(alloc.parts.requests.lens[slot])
    got = alloc.alloc_extend(
        np.array([slot]), np.array([held]), np.array([pages * alloc.parts.roles.page_size])
    )
    if got is not None and markers is not None:
        new = request_vpages(alloc, slot)[-pages:]
        for name in alloc.parts.roles.token_names:
            markers.stamp(name, new)
    return got is not None


def mamba_slot(alloc: PoolAllocator, slot: int, markers: Markers | None = None) -> bool:
    got = alloc.alloc_mamba(np.array([slot])) is not None
    if got and markers is not None:
        markers.stamp("mamba", [slot + 1])
    return got


def check_tables(alloc: PoolAllocator) -> None:
    """v2p and p2v inverse on every bound page (host mirrors equal the device)."""
    for sub in alloc.parts.books.values():
        v2p, p2v = sub.v2p.cpu().numpy(), sub.p2v.cpu().numpy()
        assert np.array_equal(v2p, sub.v2p_host) and np.array_equal(p2v, sub.p2v_host)
        bound = np.flatnonzero(v2p[1:] >= 0) + 1
        assert (p2v[v2p[bound]] == bound).all(), sub.name
        assert len(bound) == int((p2v[sub.first_page :] >= 0).sum()), sub.name


def check_hole_free(alloc: PoolAllocator, compacted: bool = True) -> None:
    """The live pages are one run at the band's far end; after compaction the band
    is exactly that run (a band that grew holds spare fresh pages before)."""
    for sub in alloc.parts.books.values():
        live = np.flatnonzero(sub.p2v_host[sub.first_page :] >= 0) + sub.first_page
        n = len(live)
        if sub.grow == Grow.UP:
            assert np.array_equal(live, np.arange(sub.first_page, sub.first_page + n)), sub.name
        elif sub.grow == Grow.DOWN:
            assert np.array_equal(live, np.arange(sub.num_pages - n, sub.num_pages)), sub.name
        else:
            assert n == 0 or live[-1] - live[0] + 1 == n, sub.name
        assert not compacted or sub.hi - sub.lo == n, f"{sub.name}: the frontier retreated"


def check_id_space(alloc: PoolAllocator) -> None:
    """Free virtual pages plus the pages requests hold cover [1, V), disjointly."""
    free = set(alloc.parts.vspace.free_ids().tolist())
    held = set()
    for slot in np.flatnonzero(alloc.parts.requests.in_use):
        held |= set(request_vpages(alloc, int(slot)).tolist())
    assert not free & held and free | held == set(range(1, alloc.parts.vspace.size))


# -- the multi-ended allocator ---------------------------------------------------------


@pytest.mark.parametrize("ps", [1, 8])
def test_freeing_a_middle_batch_then_compacting_leaves_a_hole_free_band(ps):
    """Three batches on the full side (3, 5, 2 pages), free the middle one: after
    compaction the band is hole-free, the survivors kept their virtual ids and
    their data followed them; freeing the rest leaves nothing allocated."""
    alloc = full_mamba(ps)
    markers = Markers(alloc)
    a, b, c = (alloc.new_request() for _ in range(3))
    for slot, pages in ((a, 3), (b, 5), (c, 2)):
        assert extend(alloc, slot, pages, markers)
    kept = {s: request_vpages(alloc, s) for s in (a, c)}
    check_hole_free(alloc, compacted=False)
    alloc.free_request(b)
    alloc.compact()
    check_hole_free(alloc)
    markers.check()
    check_tables(alloc)
    for s, vpages in kept.items():
        assert np.array_equal(request_vpages(alloc, s), vpages)
        assert (alloc.parts.books["full"].v2p_host[vpages] >= 0).all()
    for s in (c, a):
        alloc.free_request(s)
        alloc.compact()
        check_hole_free(alloc)
    assert all(sub.num_live == 0 and sub.lo == sub.hi for sub in alloc.parts.books.values())


def test_the_grow_up_side_compacts_the_same_way():
    """Mamba slots of three groups of requests (2, 3, 1): free the middle group."""
    alloc = full_mamba()
    markers = Markers(alloc)
    groups = [[alloc.new_request() for _ in range(n)] for n in (2, 3, 1)]
    for group in groups:
        for slot in group:
            assert mamba_slot(alloc, slot, markers)
    for slot in groups[1]:
        alloc.free_request(slot)
    alloc.compact()
    check_hole_free(alloc)
    markers.check()
    check_tables(alloc)
    for slot in groups[0] + groups[2]:
        alloc.free_request(slot)
    alloc.compact()
    assert all(sub.num_live == 0 and sub.lo == sub.hi for sub in alloc.parts.books.values())


def _most_full_pages(alloc: PoolAllocator) -> int:
    return max(
        k for k in range(alloc.parts.books["full"].num_pages + 1) if alloc.can_admit({"full": k})[1]
    )


def _alone_brute_force(pool: UnifiedPool, name: str, pages: int) -> bool:
    """``pages`` pages of ``name`` alone fit as a run on its grid above the sink."""
    pb = pool[name].page_bytes
    return any(
        lo * pb >= pool.sink_bytes and (lo + pages) * pb <= pool.total_bytes
        for lo in range(pool.total_bytes // pb + 1)
    )


def test_one_side_growing_shrinks_what_the_other_can_take():
    """A pool of 8 full pages' and 8 Mamba slots' bytes: three Mamba slots lower
    the full pages on offer, and asking for one more than offered returns None
    with nothing changed."""
    alloc = full_mamba(full_pages=8, mamba_slots=8)
    before = _most_full_pages(alloc)
    assert before == max(k for k in range(64) if _alone_brute_force(alloc.pool, "full", k))
    for _ in range(3):
        assert mamba_slot(alloc, alloc.new_request())
    offered = _most_full_pages(alloc)
    assert offered < before
    slot = alloc.new_request()
    state = snapshot(alloc)
    assert not extend(alloc, slot, offered + 1)
    assert snapshot(alloc) == state
    assert extend(alloc, slot, offered)


def test_randomized_churn_on_both_sides_with_eager_compaction():
    """400 operations, 60 % on the full side: allocate 1-5 pages (or a Mamba slot),
    or free and compact. Allocation succeeds exactly when can_admit said so;
    bands stay hole-free, data follows, the id space is conserved."""
    rng = np.random.default_rng(0xC0FFEE)
    alloc = full_mamba(full_pages=48, mamba_slots=24)
    markers = Markers(alloc)
    full_side, mamba_side = [], []
    for _ in range(400):
        full = rng.random() < 0.6
        live = full_side if full else mamba_side
        free_slots = alloc.parts.requests.max_requests - int(alloc.parts.requests.in_use.sum())
        if (rng.random() < 0.55 or not live) and free_slots:
            slot = alloc.new_request()
            if full:
                pages = int(rng.integers(1, 6))
                expect = alloc.can_admit({"full": pages})[1]
                ok = extend(alloc, slot, pages, markers)
            else:
                expect = alloc.can_admit({"mamba": 1})[1]
                ok = mamba_slot(alloc, slot, markers)
            assert ok == expect
            (live.append(slot) if ok else alloc.free_request(slot))
        elif live:  # SGLang compacts on every free
            alloc.free_request(live.pop(int(rng.integers(len(live)))))
            alloc.compact()
            check_hole_free(alloc)
        check_hole_free(alloc, compacted=False)  # growth alone never leaves holes
        check_tables(alloc)
        check_id_space(alloc)
        markers.check()
    for slot in full_side + mamba_side:
        alloc.free_request(slot)
    alloc.compact()
    assert all(sub.num_live == 0 for sub in alloc.parts.books.values())


def test_lazy_churn_near_capacity_leaves_no_ghost_pages():
    """Churn close to capacity with no idle compaction (allocations compact only
    when short): every page inside a band is either bound or on the free stack,
    never neither (a ghost); draining ends empty."""
    rng = np.random.default_rng(0x5373)
    alloc = full_mamba(full_pages=64, mamba_slots=4)
    live = []
    for _ in range(1500):
        free_slots = alloc.parts.requests.max_requests - int(alloc.parts.requests.in_use.sum())
        if (rng.random() < 0.55 and free_slots) or not live:
            slot = alloc.new_request()
            if extend(alloc, slot, int(rng.integers(1, 6))):
                live.append(slot)
            else:
                alloc.free_request(slot)
        else:
            alloc.free_request(live.pop(int(rng.integers(len(live)))))
        for sub in alloc.parts.books.values():
            band = np.arange(sub.lo, sub.hi)
            bound = set(band[sub.p2v_host[sub.lo : sub.hi] >= 0].tolist())
            stacked = sub.free_ids().tolist()
            assert len(stacked) == len(set(stacked)) and not bound & set(stacked)
            assert bound | set(stacked) == set(band.tolist()), f"{sub.name}: a ghost page"
    for slot in live:
        alloc.free_request(slot)
    alloc.compact()
    assert all(sub.num_live == 0 and sub.lo == sub.hi for sub in alloc.parts.books.values())


def test_double_free_is_refused_with_state_unchanged():
    alloc = full_mamba()
    slot = alloc.new_request()
    assert extend(alloc, slot, 3) and mamba_slot(alloc, slot)
    alloc.parts.mamba.free(np.array([slot]))
    state = snapshot(alloc)
    with pytest.raises(ValueError, match="hold no slot"):
        alloc.parts.mamba.free(np.array([slot]))
    assert snapshot(alloc) == state
    alloc.free_request(slot)
    state = snapshot(alloc)
    with pytest.raises(ValueError, match="not open"):
        alloc.free_request(slot)
    assert snapshot(alloc) == state


@pytest.mark.parametrize("ps", [1, 8])
def test_translation_clamps_tombstones_and_the_sink_survives_churn(ps):
    """Virtual 0 -> physical 0 (the sink) at start and after alloc/free/compaction
    churn, so zero-filled id buffers read the sink; a tombstoned page reads the
    sink too; translating in place (out= its input) equals translating apart."""
    alloc = full_swa(ps)
    zeros = VirtualTokenIds(torch.zeros(4, dtype=torch.int32))

    def sink_ok():
        for name in alloc.parts.roles.token_names:
            assert not alloc.translate(zeros, name).data.any()

    sink_ok()
    a, b = alloc.new_request(), alloc.new_request()
    assert extend(alloc, a, 6) and extend(alloc, b, 6)
    alloc.free_request(a)
    c = alloc.new_request()
    assert extend(alloc, c, 4)
    alloc.compact()
    ids = alloc.parts.requests.req_to_token[b, : 6 * ps].clone()
    want = alloc.translate(VirtualTokenIds(ids), "swa").data.clone()
    buf = ids.clone()
    got = alloc.translate(VirtualTokenIds(buf), "swa", out=buf)
    assert torch.equal(buf, want) and got.data.data_ptr() == buf.data_ptr()
    vpage = int(alloc.parts.requests.pages[b, 1])
    alloc.io.release_physical("swa", VirtualPageIds(torch.tensor([vpage])))
    tomb = alloc.translate(VirtualTokenIds(ids), "swa").data
    sink_rows = ps * alloc.parts.books["swa"].blocks_per_page  # kernel ids of page 0
    assert (tomb[ps : 2 * ps] < sink_rows).all() and torch.equal(tomb[:ps], want[:ps])
    alloc.free_request(b)
    alloc.free_request(c)
    sink_ok()


# -- the SWA composite ---------------------------------------------------------------------


def test_swa_allocation_binds_both_sub_pools_and_free_releases_both():
    alloc = full_swa()
    slot = alloc.new_request()
    assert extend(alloc, slot, 3)
    vpages = request_vpages(alloc, slot)
    for name in ("full", "swa"):
        assert (alloc.parts.books[name].v2p_host[vpages] >= 0).all()
    assert not set(vpages.tolist()) & set(alloc.parts.vspace.free_ids().tolist())
    alloc.free_request(slot)
    for name in ("full", "swa"):
        assert (alloc.parts.books[name].v2p_host[vpages] == -1).all()
    assert set(vpages.tolist()) <= set(alloc.parts.vspace.free_ids().tolist())


def test_an_swa_only_free_keeps_the_virtual_page_and_its_full_page():
    alloc = full_swa()
    slot = alloc.new_request()
    assert extend(alloc, slot, 3)
    middle = int(request_vpages(alloc, slot)[1])
    alloc.io.release_physical("swa", VirtualPageIds(torch.tensor([middle])))
    assert (
        alloc.parts.books["full"].v2p_host[middle] >= 0
        and alloc.parts.books["swa"].v2p_host[middle] == -1
    )
    assert middle not in set(alloc.parts.vspace.free_ids().tolist())
    alloc.free_request(slot)  # the composite free skips the tombstoned SWA page
    assert middle in set(alloc.parts.vspace.free_ids().tolist())
    alloc.check_integrity()


def test_swa_compaction_diverges_only_the_side_that_freed_moves():
    """a, b, c one page each; free b's SWA page only. Compaction moves c's SWA page
    into b's hole and leaves every full-attention page where it was."""
    alloc = full_swa()
    markers = Markers(alloc)
    a, b, c = (alloc.new_request() for _ in range(3))
    for slot in (a, b, c):
        assert extend(alloc, slot, 1, markers)
    vb, vc = int(request_vpages(alloc, b)[0]), int(request_vpages(alloc, c)[0])
    full_before = alloc.parts.books["full"].v2p_host.copy()
    swa_c = int(alloc.parts.books["swa"].v2p_host[vc])
    alloc.io.release_physical("swa", VirtualPageIds(torch.tensor([vb])))
    assert alloc.compact() == 1
    assert np.array_equal(alloc.parts.books["full"].v2p_host, full_before)
    assert int(alloc.parts.books["swa"].v2p_host[vc]) != swa_c
    check_hole_free(alloc)
    check_tables(alloc)
    markers.check()


def test_swa_joint_budget_shrinks_as_tokens_arrive():
    alloc = full_swa(full_pages=8, swa_pages=8)

    def most():
        return max(k for k in range(9) if alloc.can_admit({"full": k, "swa": k})[1])

    before = most()
    slot = alloc.new_request()
    assert extend(alloc, slot, 3)
    offered = most()
    assert offered < before
    other = alloc.new_request()
    state = snapshot(alloc)
    assert not extend(alloc, other, offered + 1)
    assert snapshot(alloc) == state


def test_swa_randomized_alloc_free_and_swa_free():
    """400 operations: allocate 1-4 pages, free a request, or free a request's SWA
    pages only; invariants after every one, compaction every tenth."""
    rng = np.random.default_rng(0xBADBEE)
    alloc = full_swa(full_pages=48, swa_pages=24, layers=(3, 3))
    markers = Markers(alloc)
    live: list[int] = []
    for step in range(400):
        r = rng.random()
        free_slots = alloc.parts.requests.max_requests - int(alloc.parts.requests.in_use.sum())
        if (r < 0.5 or not live) and free_slots:
            slot = alloc.new_request()
            pages = int(rng.integers(1, 5))
            expect = alloc.can_admit({"full": pages, "swa": pages})[1]
            ok = extend(alloc, slot, pages, markers)
            assert ok == expect
            (live.append(slot) if ok else alloc.free_request(slot))
        elif r < 0.8 and live:
            alloc.free_request(live.pop(int(rng.integers(len(live)))))
        elif live:
            slot = live[int(rng.integers(len(live)))]
            vpages = request_vpages(alloc, slot)
            bound = vpages[alloc.parts.books["swa"].v2p_host[vpages] >= 0]
            if len(bound):
                alloc.io.release_physical("swa", VirtualPageIds(torch.from_numpy(bound)))
        if step % 10 == 9:
            alloc.compact()
            check_hole_free(alloc)
        check_tables(alloc)
        check_id_space(alloc)
        markers.check()
        held = np.concatenate([request_vpages(alloc, int(s)) for s in live] or [np.zeros(0, int)])
        assert alloc.parts.books["full"].num_live == len(held)  # slot conservation
        assert alloc.parts.books["swa"].num_live == int(
            (alloc.parts.books["swa"].v2p_host[held] >= 0).sum()
        )
    for slot in live:
        alloc.free_request(slot)
    assert all(sub.num_live == 0 for sub in alloc.parts.books.values())


# -- page size > 1 -------------------------------------------------------------------------


def test_paged_allocation_returns_whole_pages_of_contiguous_token_ids():
    alloc = full_swa(ps=8, full_pages=16, swa_pages=8, layers=(2, 2))
    slot = alloc.new_request()
    ids = alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([16]))
    tokens = ids.data.tolist()
    pages = sorted({t // 8 for t in tokens})
    assert len(pages) == 2
    assert sorted(tokens) == [p * 8 + i for p in pages for i in range(8)]


def test_paged_compaction_moves_whole_pages_and_their_tokens():
    alloc = full_swa(ps=8, full_pages=16, swa_pages=8, layers=(2, 2))
    markers = Markers(alloc)
    a, b, c = (alloc.new_request() for _ in range(3))
    for slot in (a, b, c):
        assert extend(alloc, slot, 1, markers)
    alloc.free_request(b)
    assert alloc.compact() >= 1
    check_hole_free(alloc)
    markers.check()  # every token row of the moved page came with it


def _joint_brute_force(pool: UnifiedPool, pages: int) -> bool:
    """``pages`` pages of each token sub-pool, each band a run on its own grid above
    the sink and below total_bytes, in byte order UP then DOWN, disjoint."""
    runs = []
    for grow in (Grow.UP, Grow.DOWN):
        sub = pool.by_grow(grow)
        pb = sub.page_bytes
        runs.append(
            [
                (lo * pb, (lo + pages) * pb)
                for lo in range(pool.total_bytes // pb + 1)
                if lo * pb >= pool.sink_bytes and (lo + pages) * pb <= pool.total_bytes
            ]
        )
    return pages == 0 or any(u[1] <= d[0] for u, d in itertools.product(*runs))


@pytest.mark.parametrize("ps", [1, 8])
def test_joint_byte_budget_in_page_units(ps):
    """What the empty SWA chain admits, jointly and for each sub-pool alone (the
    other band empty), is what a byte enumeration finds; jointly is less. Three
    full layers to two SWA layers: the SWA page does not divide the sink."""
    alloc = full_swa(ps=ps, full_pages=8, swa_pages=8, layers=(3, 2))
    joint = max(k for k in range(40) if _joint_brute_force(alloc.pool, k))
    assert max(k for k in range(40) if alloc.can_admit({"full": k, "swa": k})[1]) == joint
    for name in ("full", "swa"):
        alone = max(k for k in range(40) if _alone_brute_force(alloc.pool, name, k))
        assert max(k for k in range(40) if alloc.can_admit({name: k})[1]) == alone, name
        assert joint < alone
