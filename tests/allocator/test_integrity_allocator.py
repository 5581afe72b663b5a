"""check_integrity can fail: on a busy allocator (holes, live and pinned pages,
pages a forward fence holds, a freed pinned page, sliding-window tombstones,
Mamba slots, closed request slots), each case breaks ONE invariant of the
allocator or of its pool and expects the AssertionError that names it. The
intact state passes; every case names a different invariant.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
from allocator_fixtures import FakeEvent, full_config, swa_config

from unikv.allocator import PoolAllocator
from unikv.allocator.pages import FREE, LIVE, OUT, PENDING
from unikv.ids import PhysicalPageIds
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, StatePart

PS = 4  # sliding window 10 (allocator_fixtures.WINDOW)


def busy() -> PoolAllocator:
    """full (DOWN) + swa (FLOAT) + mamba (UP). r0: 22 tokens, 3 SWA pages freed out
    of the window; r1: 5 tokens, one pinned live page; r2 freed with a pinned
    page (PENDING by its pin); r3 freed under an outstanding forward (PENDING by
    the fence); r4 never opened."""
    configs = [
        full_config(PS),
        swa_config(PS),
        SubPoolConfig("mamba", MambaSpec(1, (StatePart((3,)),), StatePart((5,)))),
    ]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": 20, "swa": 12, "mamba": 8}))
    alloc = PoolAllocator(pool, max_requests=5, max_context=40)
    r0, r1, r2, r3 = (alloc.new_request() for _ in range(4))
    for slot, tokens in ((r0, 22), (r1, 5), (r2, 8), (r3, 3)):
        assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([tokens])) is not None
        assert alloc.alloc_mamba(np.array([slot])) is not None
    alloc.free_out_of_window(np.array([r0]), np.array([22]))
    alloc.io.pin("full", _pages(alloc, "full", r1, 0))
    alloc.io.pin("full", _pages(alloc, "full", r2, 0))
    alloc.free_request(r2)
    alloc.mark_in_flight(FakeEvent())
    alloc.free_request(r3)
    return alloc


def _pages(alloc, name: str, slot: int, col: int) -> PhysicalPageIds:
    page = alloc.parts.books[name].v2p_host[alloc.parts.requests.pages[slot, col]]
    return PhysicalPageIds(torch.tensor([int(page)]), name)


def _page(sub, state: int, outside: bool = False) -> int:
    """Some page of ``sub`` in ``state`` (outside the band when ``outside``)."""
    pages = np.flatnonzero(sub.state == state)
    in_band = (pages >= sub.lo) & (pages < sub.hi)
    pages = pages[~in_band] if outside else pages[pages >= sub.first_page]
    return int(pages[0])


def _free_virtual(alloc) -> int:
    return int(alloc.parts.vspace.free_ids()[-1])


def _bind_virtual(alloc, name: str, vpage: int) -> None:
    """Bind ``vpage`` to a hole of ``name`` consistently (host and device)."""
    sub = alloc.parts.books[name]
    pages = sub.take(1)
    vpages = np.array([vpage], np.int32)
    sub.bind_host(vpages, pages)
    alloc.parts.writer.bind(sub, vpages, pages)


def _swap_v2p(alloc) -> None:
    full = alloc.parts.books["full"]
    a, b = alloc.parts.requests.pages[0, 0], alloc.parts.requests.pages[0, 1]
    full.v2p_host[[a, b]] = full.v2p_host[[b, a]]


def _swap_owner(alloc) -> None:
    a, b = alloc.parts.requests.pages[0, 0], alloc.parts.requests.pages[1, 0]
    alloc.parts.vspace.owner[[a, b]] = alloc.parts.vspace.owner[[b, a]]


def _duplicate_free_virtual(alloc) -> None:
    vs = alloc.parts.vspace
    vs._stack[vs.num_free - 1] = vs._stack[vs.num_free - 2]


def _free_window_page_early(alloc) -> None:
    """The state the truncate bug left: a page the next query reads tombstoned and
    counted as out of the window (r0: 22 tokens, W 10 -> it reads from page 3)."""
    swa = alloc.parts.books["swa"]
    col = int(alloc.parts.requests.window_lo["swa"][0])
    vpages = alloc.parts.requests.pages[0, col : col + 1].copy()
    alloc.parts.writer.unbind(swa, vpages, swa.unbind_host(vpages, held=False))
    alloc.parts.requests.window_lo["swa"][0] = col + 1


def _overlap_bands(alloc) -> None:
    mamba, swa = alloc.parts.books["mamba"], alloc.parts.books["swa"]
    reach = -(-swa.lo * swa.page_bytes // mamba.page_bytes) + 1  # one slot into swa's band
    mamba.set_band(mamba.lo, min(reach, mamba.num_pages))


def _shift_view(alloc) -> None:
    geom = alloc.pool["full"]
    k, v = geom.views[0]
    geom.views = [(v, k)]


SUB = "full"  # the sub-pool most cases corrupt (DOWN, with every page state)

CASES: dict[str, Callable[[PoolAllocator], None]] = {
    # the pool's geometry
    "the buffer is uint8, total_bytes plus the tail pad long": lambda a: setattr(
        a.pool, "buffer", a.pool.buffer[:-1]
    ),
    "page 0 lies in the sink": lambda a: setattr(a.pool, "sink_bytes", 1),
    "first_page is the lowest page wholly above the sink": lambda a: setattr(
        a.pool["full"], "first_page", a.pool["full"].first_page + 1
    ),
    "num_pages counts the whole pages inside total_bytes": lambda a: setattr(
        a.pool["swa"], "num_pages", a.pool["swa"].num_pages - 1
    ),
    "kernel ids fit int32": lambda a: setattr(a.pool["full"], "page_size", 2**28),
    "the views are the layout's views of the pool's buffer": _shift_view,
    # one sub-pool
    "entry 0 is pinned to the sink": lambda a: a.parts.books[SUB].v2p_host.__setitem__(0, 3),
    "band inside the grid": lambda a: setattr(
        a.parts.books[SUB], "hi", a.parts.books[SUB].num_pages + 1
    ),
    "pages outside the band are OUT": lambda a: a.parts.books[SUB].state.__setitem__(
        _page(a.parts.books[SUB], OUT, outside=True), FREE
    ),
    "pages inside the band are FREE, LIVE or PENDING": lambda a: a.parts.books[
        SUB
    ].state.__setitem__(_page(a.parts.books[SUB], FREE), OUT),
    "the free stack holds exactly the holes": lambda a: setattr(
        a.parts.books[SUB], "num_free", a.parts.books[SUB].num_free - 1
    ),
    "num_live counts the LIVE pages": lambda a: setattr(
        a.parts.books[SUB], "num_live", a.parts.books[SUB].num_live + 1
    ),
    "num_pending counts PENDING pages": lambda a: setattr(
        a.parts.books[SUB], "num_pending", a.parts.books[SUB].num_pending + 1
    ),
    "pin counts are non-negative": lambda a: a.parts.books[SUB].pins.__setitem__(
        _page(a.parts.books[SUB], LIVE), -1
    ),
    "any_pinned mirrors pins": lambda a: setattr(a.parts.books[SUB], "any_pinned", False),
    "PENDING pages are exactly the fence-held and the freed pinned pages": lambda a: (
        a.parts.fences._groups.clear()
    ),
    "p2v >= 0 exactly on LIVE pages": lambda a: a.parts.books[SUB].p2v_host.__setitem__(
        _page(a.parts.books[SUB], FREE), 1
    ),
    "v2p inverts p2v on live pages": _swap_v2p,
    "v2p holds pages or -1 (tombstone)": lambda a: a.parts.books[SUB].v2p_host.__setitem__(
        _free_virtual(a), -5
    ),
    "p2v inverts v2p on bound virtual pages": lambda a: a.parts.books[SUB].v2p_host.__setitem__(
        _free_virtual(a), _page(a.parts.books[SUB], LIVE)
    ),
    "device v2p mirrors the host": lambda a: a.parts.books[SUB].v2p.__setitem__(1, 77),
    "device p2v mirrors the host": lambda a: a.parts.books[SUB].p2v.__setitem__(
        _page(a.parts.books[SUB], FREE), 5
    ),
    # requests, windows, virtual space
    "virtual free stack has no duplicates": _duplicate_free_virtual,
    "free plus owned virtual pages cover [1, V) exactly": lambda a: setattr(
        a.parts.vspace, "num_free", a.parts.vspace.num_free - 1
    ),
    "closed requests hold no tokens": lambda a: a.parts.requests.lens.__setitem__(2, 1),
    "requests hold exactly the owned virtual pages": lambda a: a.parts.requests.lens.__setitem__(
        1, a.parts.requests.lens[1] + PS
    ),
    "each request's pages are owned by it": _swap_owner,
    "each virtual page knows its page index in its request": lambda a: (
        a.parts.vspace.column.__setitem__(a.parts.requests.pages[0, 1], 4)
    ),
    "unowned virtual pages are unbound": lambda a: _bind_virtual(a, "full", _free_virtual(a)),
    "out-of-window pages are tombstones": lambda a: a.parts.requests.window_lo["swa"].__setitem__(
        0, a.parts.requests.window_lo["swa"][0] + 1
    ),
    "no page the next query reads was freed out of the window": _free_window_page_early,
    "req_to_token holds each request's virtual ids": lambda a: (
        a.parts.requests.req_to_token.__setitem__((0, 0), a.parts.requests.req_to_token[0, 0] + 1)
    ),
    "only open requests hold a Mamba slot": lambda a: _bind_virtual(a, "mamba", 3),  # r2
    # the chain
    "bands lie in byte order UP <= FLOAT <= DOWN without overlap": _overlap_bands,
}


def test_the_busy_state_is_intact_and_busy():
    alloc = busy()
    alloc.check_integrity()
    for name, sub in alloc.parts.books.items():
        states = set(np.unique(sub.state[sub.first_page :]).tolist())
        assert {OUT, FREE, LIVE} <= states, name
    assert (alloc.parts.books["full"].state == PENDING).sum() >= 2  # fence-held and freed pinned
    assert alloc.parts.requests.window_lo["swa"][0] == 3


@pytest.mark.parametrize("invariant", list(CASES))
def test_each_broken_invariant_is_named(invariant):
    alloc = busy()
    CASES[invariant](alloc)
    with pytest.raises(AssertionError, match=_pattern(invariant)):
        alloc.check_integrity()


def _pattern(text: str) -> str:
    return re.escape(text)


def test_the_cases_name_distinct_invariants():
    names = list(CASES)
    assert all(a not in b for a in names for b in names if a != b)


# -- static split ranges ------------------------------------------------------------


def split_alloc() -> PoolAllocator:
    configs = [full_config(PS), swa_config(PS)]
    pool = UnifiedPool(
        configs,
        pool_bytes_for(configs, {"full": 20, "swa": 20}),
        static_split={"full": 0.4, "swa": 0.4},
    )
    alloc = PoolAllocator(pool, max_requests=2, max_context=40)
    slot = alloc.new_request()
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([9])) is not None
    return alloc


def _past_static_range(alloc) -> None:
    swa = alloc.parts.books["swa"]  # UP: the unused fifth of the bytes lies above its range
    swa.set_band(swa.lo, alloc.pool.band_limits["swa"][1] + 1)


def _ranges_overlap(alloc) -> None:
    limits = alloc.pool.band_limits
    full, swa = alloc.pool["full"], alloc.pool["swa"]
    limits["swa"] = (
        limits["swa"][0],
        -(-limits["full"][0] * full.page_bytes // swa.page_bytes) + 1,
    )


SPLIT_CASES: dict[str, Callable[[PoolAllocator], None]] = {
    "inside its static range": _past_static_range,
    "static range inside its grid, above the sink": lambda a: a.pool.band_limits.__setitem__(
        "full", (a.pool["full"].first_page - 1, a.pool.band_limits["full"][1])
    ),
    "static ranges lie in byte order UP, FLOAT, DOWN apart": _ranges_overlap,
}


@pytest.mark.parametrize("invariant", list(SPLIT_CASES))
def test_each_broken_static_split_invariant_is_named(invariant):
    alloc = split_alloc()
    alloc.check_integrity()
    SPLIT_CASES[invariant](alloc)
    with pytest.raises(AssertionError, match=_pattern(invariant)):
        alloc.check_integrity()
