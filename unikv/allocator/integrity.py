"""check_integrity: every invariant of the chain, checked on host mirrors and
device tables (host syncs; for tests and debug mode). Each assert names its
invariant; ``tests/allocator/test_integrity_allocator.py`` breaks each one alone and
expects its name (docs/design.md section 10 lists them).

    check_pool      the buffer, the sink, each grid and view (the geometry)
    check_subpool   one sub-pool: band, states, free stack, counts, v2p/p2v
    check_requests  virtual space, request pages, windows, req_to_token
    check_prefix    shared prefix pages: references, LRU, the hash map, state checkpoints
    check_chain     all of them, plus bands byte-disjoint and static ranges
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from unikv.allocator.bands import disjoint
from unikv.allocator.capacity import bands_disjoint
from unikv.allocator.checkpoints import check_checkpoints
from unikv.allocator.pages import FREE, LIVE, OUT, PENDING, PageBook
from unikv.allocator.prefix import CACHED, check_prefix_windows
from unikv.pool import INT32_LIMIT, SubPool, UnifiedPool, _build_views

if TYPE_CHECKING:
    from unikv.allocator.parts import Parts


def _tensors(views: object) -> list[torch.Tensor]:
    """The tensors of a nested views structure, in a fixed order."""
    if isinstance(views, torch.Tensor):
        return [views]
    if isinstance(views, dict):
        return [t for key in sorted(views) for t in _tensors(views[key])]
    if isinstance(views, (list, tuple)):
        return [t for item in views for t in _tensors(item)]
    return []


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


_LAYOUTS: dict[tuple, list[tuple]] = {}  # the layout's views, by what they are built from


def _layout_views(whole: torch.Tensor, sub: SubPool) -> list[tuple]:
    """``_layout`` of each view the layout builds over ``whole``: a function of the
    buffer's address, size and device and of the grid alone, so built once per such
    key (debug mode checks the pool after every verb; building the views was most
    of that check's time)."""
    spec, page_size, pages = sub.spec, sub.page_size, sub.max_pages
    key = (whole.data_ptr(), whole.numel(), whole.dtype, whole.device, spec, page_size, pages)
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        dense, paged = _build_views(whole, spec, page_size, pages)
        _LAYOUTS[key] = [_layout(t) for t in _tensors(dense) + _tensors(paged)]
    return _LAYOUTS[key]


def check_pool(pool: UnifiedPool) -> None:
    """The pool's geometry: one buffer with its tail pad, a sink below every
    first page, page grids inside total_bytes, and views that are the layout's."""
    buffer = pool.buffer
    assert (
        buffer.dtype == torch.uint8
        and buffer.dim() == 1
        and buffer.numel() == pool.total_bytes + pool.tail_pad_bytes
    ), "pool: the buffer is uint8, total_bytes plus the tail pad long"
    for name, sub in pool.subpools.items():
        pb = sub.page_bytes
        assert pool.sink_bytes >= pb, f"{name}: page 0 lies in the sink"
        assert (sub.first_page - 1) * pb < pool.sink_bytes <= sub.first_page * pb, (
            f"{name}: first_page is the lowest page wholly above the sink"
        )
        assert sub.num_pages * pb <= pool.total_bytes < (sub.num_pages + 1) * pb, (
            f"{name}: num_pages counts the whole pages inside total_bytes"
        )
        assert sub.num_pages <= sub.max_pages and sub.ids.limit(sub.max_pages) <= INT32_LIMIT, (
            f"{name}: kernel ids fit int32 (up to max_pages, an elastic pool's reach)"
        )
        want = _layout_views(pool.whole, sub)
        got = [_layout(t) for t in _tensors(sub.views) + _tensors(sub.paged_views)]
        assert got == want, f"{name}: the views are the layout's views of the pool's buffer"
    limits = pool.band_limits or {}
    for name, (lo, hi) in limits.items():
        sub = pool.subpools[name]
        assert sub.first_page <= lo <= hi <= sub.num_pages, (
            f"{name}: static range inside its grid, above the sink"
        )
    grids = {n: (pool.subpools[n].grow, pool.subpools[n].page_bytes, r) for n, r in limits.items()}
    assert bands_disjoint(grids), "pool: static ranges lie in byte order UP, FLOAT, DOWN apart"


def check_subpool(sub: PageBook, held: np.ndarray) -> None:
    """Invariants of one sub-pool; ``held`` = pages the fence queue holds for it."""
    name, state = sub.name, sub.state
    assert sub.v2p_host[0] == 0 and sub.p2v_host[0] == 0, f"{name}: entry 0 is pinned to the sink"
    assert sub.first_page <= sub.lo <= sub.hi <= sub.num_pages, f"{name}: band inside the grid"
    inside = np.zeros(sub.num_pages, bool)
    inside[sub.lo : sub.hi] = True
    assert (state[~inside] == OUT).all(), f"{name}: pages outside the band are OUT"
    assert (state[inside] != OUT).all(), f"{name}: pages inside the band are FREE, LIVE or PENDING"
    stack = np.sort(sub.free_ids())
    assert np.array_equal(stack, np.flatnonzero(state == FREE)), (
        f"{name}: the free stack holds exactly the holes, once each (no ghost pages)"
    )
    live = np.flatnonzero(state == LIVE)
    assert sub.num_live == len(live), f"{name}: num_live counts the LIVE pages"
    assert sub.num_pending == int((state == PENDING).sum()), (
        f"{name}: num_pending counts PENDING pages"
    )
    assert (sub.pins >= 0).all(), f"{name}: pin counts are non-negative"
    assert sub.any_pinned == bool((sub.pins > 0).any()), f"{name}: any_pinned mirrors pins"
    freed_pinned = np.flatnonzero((sub.pins > 0) & (state != LIVE))
    assert np.array_equal(np.union1d(held, freed_pinned), np.flatnonzero(state == PENDING)), (
        f"{name}: PENDING pages are exactly the fence-held and the freed pinned pages "
        "(a pinned page is live or pending)"
    )
    real = np.arange(sub.num_pages) >= sub.first_page
    assert np.array_equal(np.flatnonzero((sub.p2v_host >= 0) & real), live), (
        f"{name}: p2v >= 0 exactly on LIVE pages"
    )
    assert (sub.v2p_host[sub.p2v_host[live]] == live).all(), (
        f"{name}: v2p inverts p2v on live pages"
    )
    assert (sub.v2p_host[1:] >= -1).all(), f"{name}: v2p holds pages or -1 (tombstone)"
    bound = np.flatnonzero(sub.v2p_host[1:] >= 0) + 1
    pages = sub.v2p_host[bound]
    assert (pages < sub.num_pages).all() and (sub.p2v_host[pages] == bound).all(), (
        f"{name}: p2v inverts v2p on bound virtual pages (each names its own live page)"
    )
    assert torch.equal(sub.v2p.cpu(), torch.from_numpy(sub.v2p_host)), (
        f"{name}: device v2p mirrors the host"
    )
    assert torch.equal(sub.p2v.cpu(), torch.from_numpy(sub.p2v_host)), (
        f"{name}: device p2v mirrors the host"
    )


def check_requests(parts: Parts) -> None:
    """Virtual space, request pages, windows and req_to_token (``parts``: the
    allocator's ``Parts``)."""
    req, vspace, roles = parts.requests, parts.vspace, parts.roles
    ps = roles.page_size
    free_ids = np.sort(vspace.free_ids())
    assert len(np.unique(free_ids)) == len(free_ids), "virtual free stack has no duplicates"
    owned = np.flatnonzero(vspace.owner >= 0)
    cached = np.flatnonzero(vspace.owner == CACHED)
    taken = np.r_[free_ids, owned, cached]
    assert np.array_equal(np.sort(taken), np.arange(1, vspace.size)), (
        "free plus owned virtual pages cover [1, V) exactly"
    )
    assert (req.lens[~req.in_use] == 0).all(), "closed requests hold no tokens"
    npages = -(-req.lens // ps)
    cols = np.arange(req.max_pages)
    held = cols[None, :] < npages[:, None]  # (R, max_pages)
    rows = np.broadcast_to(np.arange(req.max_requests)[:, None], held.shape)
    pages = req.pages[held]
    private = vspace.owner[pages] != CACHED
    assert np.array_equal(np.sort(pages[private]), owned), (
        "requests hold exactly the owned virtual pages (their own ones once each)"
    )
    assert (vspace.owner[pages] == rows[held])[private].all(), (
        "each request's pages are owned by it"
    )
    check_prefix(parts, pages[~private], cached)
    assert (vspace.column[pages] == np.broadcast_to(cols, held.shape)[held]).all(), (
        "each virtual page knows its page index in its request"
    )
    for name in roles.token_names:
        v2p = parts.books[name].v2p_host
        assert (v2p[free_ids] == -1).all(), f"{name}: unowned virtual pages are unbound"
        if name in roles.windows:
            lo = req.window_lo[name]
            gone = held & (cols[None, :] < lo[:, None])
            gone_pages = req.pages[gone]
            gone_pages = gone_pages[vspace.owner[gone_pages] != CACHED]  # the cache's own
            assert (v2p[gone_pages] == -1).all(), f"{name}: out-of-window pages are tombstones"
            first = np.maximum(req.lens + 1 - roles.windows[name], 0) // ps  # the next query's
            assert (lo <= first)[req.in_use & (npages > first)].all(), (
                f"{name}: no page the next query reads was freed out of the window"
            )
    positions = np.arange(req.max_context)
    filled = positions[None, :] < req.lens[:, None]  # (R, max_ctx)
    expect = req.pages[:, positions // ps].astype(np.int64) * ps + positions % ps
    actual = req.req_to_token.cpu().numpy()
    assert np.array_equal(actual[filled], expect[filled]), (
        "req_to_token holds each request's virtual ids"
    )
    if roles.mamba_name is not None:
        v2p = parts.books[roles.mamba_name].v2p_host
        has = v2p[1 : req.max_requests + 1] >= 0
        assert not (has & ~req.in_use).any(), "only open requests hold a Mamba slot"
        assert parts.mamba is not None, "a Mamba sub-pool has its state slots part"
        k = parts.mamba.k
        drafts = v2p[req.max_requests + 1 : req.max_requests * (1 + k) + 1] >= 0
        assert (drafts.reshape(req.max_requests, k) == has[:, None]).all(), (
            "a request holds its k draft state slots exactly while it holds a Mamba slot"
        )


def check_prefix(parts: Parts, held_cached: np.ndarray, cached: np.ndarray) -> None:
    """The prefix cache (``prefix.py``): ``held_cached`` are the cached pages in
    request tables (one entry per holder), ``cached`` the pages owned by the cache."""
    prefix, vspace = parts.prefix, parts.vspace
    counts = np.bincount(held_cached, minlength=vspace.size)
    assert np.array_equal(prefix.refs, counts), (
        "prefix refcount equals the request tables holding each cached page"
    )
    for name in parts.roles.token_names:
        book = parts.books[name]
        ppages = book.v2p_host[cached]
        if name in parts.roles.windows:  # a page cached after it left its window: unbound
            ppages = ppages[ppages != -1]
        assert (ppages > 0).all() and (book.state[ppages] == LIVE).all(), (
            f"{name}: cached pages are bound to LIVE pages, so never on the free stack"
        )
    check_prefix_windows(parts)
    lru = np.fromiter(prefix.lru, np.int64, len(prefix.lru))
    assert np.array_equal(np.sort(lru), cached[prefix.refs[cached] == 0]), (
        "evictable prefix pages are exactly the cached pages with refcount 0"
    )
    assert sorted(prefix.by_page) == cached.tolist() and all(
        n.page == p for p, n in prefix.by_page.items()
    ), "the prefix hash map and the cached pages agree (one node per cached page)"
    nodes = list(prefix.by_id.values())  # on the device (by_page) and on the host tier
    assert len(prefix.by_key) == len(nodes) and all(prefix.by_key.get(n.key) is n for n in nodes), (
        "the prefix hash map and the cached pages agree (each node under its key)"
    )
    ids = [n.node_id for n in nodes]
    assert len(set(ids)) == len(ids) and all(0 < i < prefix._next_id for i in ids), (
        "prefix node ids are distinct and never reused"
    )
    ps = parts.roles.page_size
    assert all(len(n.tokens) == 8 * ps for n in nodes), "each prefix node holds one page of tokens"
    if prefix.states is not None:
        check_checkpoints(parts)
    if prefix.host is not None:  # the host tier's own invariants (unikv.io.prefix_host)
        prefix.host.check_integrity(parts)


def check_chain(pool: UnifiedPool, parts: Parts) -> None:
    """Every invariant of a PoolAllocator over ``pool`` (``parts``: its ``Parts``).
    Table writes staged for a step's one write (``TableWriter.batch``, inside a
    verb that called this one) go out first: the device tables are compared with
    the host mirrors they follow."""
    parts.writer.settle()
    check_pool(pool)
    for name, book in parts.books.items():
        check_subpool(book, parts.fences.held(name))
    assert disjoint(parts.books, {n: b.band for n, b in parts.books.items()}), (
        "bands lie in byte order UP <= FLOAT <= DOWN without overlap"
    )
    for name, (lo, hi) in (pool.band_limits or {}).items():
        band = parts.books[name].band
        assert band[0] == band[1] or lo <= band[0] <= band[1] <= hi, (
            f"{name}: band {band} inside its static range [{lo}, {hi})"
        )
    if parts.roles.owner is not None:
        check_requests(parts)
