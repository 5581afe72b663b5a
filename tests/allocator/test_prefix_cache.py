"""Prefix caching in the allocator (unikv/allocator/prefix.py): shared full pages
by reference, exact token comparison on a hit, LRU eviction counted by the
capacity oracle, compaction moving cached pages, and each new invariant of
``check_integrity`` broken alone.

The stand-in for keys and values: the row of position p of a prompt holds
``kv(tokens[:p+1])``, a function of the prefix only (as attention's K/V are).
A request that took a hit must read, through its own table, exactly the rows
it would have written itself.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
import torch
from allocator_fixtures import full_config, mamba_config

from unikv.allocator import PoolAllocator, PrefixHit
from unikv.allocator import prefix as prefix_module
from unikv.ids import VirtualPageIds, VirtualTokenIds
from unikv.pool import UnifiedPool, pool_bytes_for


def make(ps: int, pages: int = 12, requests: int = 4, **kw) -> PoolAllocator:
    configs = [full_config(ps)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages}))
    return PoolAllocator(pool, max_requests=requests, max_context=16 * ps, debug=True, **kw)


def kv(prefix: np.ndarray) -> float:
    return float(zlib.crc32(np.asarray(prefix, np.int64).tobytes()) % 1_000_003)


def _rows(alloc: PoolAllocator, slot: int, start: int, stop: int):
    ids = alloc.parts.requests.req_to_token[slot, start:stop].clone()
    phys = alloc.translate(VirtualTokenIds(ids), "full", physical=True).data.long()
    ps = alloc.parts.roles.page_size
    return phys // ps, phys % ps


def write(alloc: PoolAllocator, slot: int, tokens: np.ndarray, start: int) -> None:
    """Write kv rows of positions [start, len(tokens)) of request ``slot``."""
    pages, rows = _rows(alloc, slot, start, len(tokens))
    values = torch.tensor([kv(tokens[: p + 1]) for p in range(start, len(tokens))])
    for k, v in alloc.pool["full"].paged_views:
        k[pages, rows] = values.view(-1, 1, 1)
        v[pages, rows] = -values.view(-1, 1, 1)


def read(alloc: PoolAllocator, slot: int, stop: int) -> torch.Tensor:
    pages, rows = _rows(alloc, slot, 0, stop)
    k, v = alloc.pool["full"].paged_views[0]
    return torch.stack([k[pages, rows].reshape(stop, -1), -v[pages, rows].reshape(stop, -1)])


def serve(alloc: PoolAllocator, tokens, cache: bool = True) -> tuple[int, int]:
    """Admit a prompt as the engine does: match (all but the last token), open
    with the hit, extend and write the rest, cache. Returns (slot, hit tokens)."""
    tokens = np.asarray(tokens, np.int64)
    hit = alloc.prefix.match(tokens[:-1])
    slot = alloc.new_request(prefix=hit)
    rest = len(tokens) - hit.num_tokens
    assert alloc.alloc_extend(np.array([slot]), np.array([hit.num_tokens]), np.array([rest]))
    write(alloc, slot, tokens, hit.num_tokens)
    if cache:
        alloc.prefix.insert(slot, tokens)
    return slot, hit.num_tokens


def expected(tokens) -> torch.Tensor:
    tokens = np.asarray(tokens, np.int64)
    values = torch.tensor([kv(tokens[: p + 1]) for p in range(len(tokens))])
    return values.view(1, -1, 1).expand(2, -1, 2)


def room(alloc: PoolAllocator) -> int:
    """Pages not held by anyone (holes, and grid pages no band took yet)."""
    book = alloc.parts.books["full"]
    return book.num_pages - book.first_page - book.num_live - book.num_pending


def physical(alloc: PoolAllocator, slot: int) -> list[int]:
    return alloc.parts.books["full"].physical(alloc.parts.requests.held_pages(slot)).tolist()


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_repeated_prompt_shares_whole_pages_by_reference(ps):
    alloc = make(ps)
    prompt = np.arange(100, 100 + 3 * ps + 1)
    a, hit_a = serve(alloc, prompt)
    b, hit_b = serve(alloc, prompt)
    assert (hit_a, hit_b) == (0, 3 * ps)  # whole pages of prompt[:-1] only
    assert physical(alloc, a)[:3] == physical(alloc, b)[:3]  # the same pages, no copy
    assert physical(alloc, a)[3] != physical(alloc, b)[3]  # each writes its own tail
    assert alloc.parts.prefix.refs[alloc.parts.requests.held_pages(b)[:3]].tolist() == [2] * 3
    torch.testing.assert_close(read(alloc, b, len(prompt)), expected(prompt), rtol=0, atol=0)
    stats = alloc.prefix.counters()
    assert stats["hit_tokens"] == 3 * ps and stats["query_tokens"] == 2 * (len(prompt) - 1)


@pytest.mark.parametrize("ps", [4, 16])
def test_prompts_sharing_part_of_a_page_hit_only_whole_pages(ps):
    alloc = make(ps)
    base = np.arange(7, 7 + 3 * ps)
    serve(alloc, base)
    other = base.copy()
    other[2 * ps + ps // 2] += 1  # differs in the middle of page 2
    b, hit = serve(alloc, other)
    assert hit == 2 * ps
    torch.testing.assert_close(read(alloc, b, len(other)), expected(other), rtol=0, atol=0)
    first_differs = base.copy()
    first_differs[0] += 1
    assert alloc.prefix.match(first_differs).num_tokens == 0


def test_a_full_prompt_hit_leaves_the_last_token_to_compute():
    alloc = make(4)
    prompt = np.arange(8)
    serve(alloc, prompt)
    assert alloc.prefix.match(prompt).num_tokens == 8
    assert alloc.prefix.match(prompt[:-1]).num_tokens == 4  # what the engine asks


def test_released_pages_are_evicted_oldest_and_deepest_first():
    alloc = make(4, pages=8)
    old, new = np.arange(0, 13), np.arange(50, 63)
    a, _ = serve(alloc, old)
    old_pages = alloc.parts.requests.held_pages(a)[:3].tolist()
    alloc.free_request(a)
    b, _ = serve(alloc, new)
    alloc.free_request(b)
    assert (
        list(alloc.parts.prefix.lru) == old_pages[::-1] + list(alloc.parts.prefix.lru)[3:]
    )  # within one release, the deepest block is oldest
    c = alloc.new_request()  # needs the room plus 2 evictions
    free = room(alloc)
    assert alloc.alloc_extend(np.array([c]), np.array([0]), np.array([4 * (free + 2)]))
    assert alloc.prefix.counters()["evicted_pages"] == 2
    assert alloc.prefix.match(old[:-1]).num_tokens == 4  # blocks 1 and 2 went, block 0 stays
    assert alloc.prefix.match(new[:-1]).num_tokens == 12


def test_can_admit_counts_evictable_pages_and_agrees_with_allocation():
    for demand in range(1, 12):
        alloc = make(4, pages=10)
        for start in (0, 40):
            slot, _ = serve(alloc, np.arange(start, start + 9))
            alloc.free_request(slot)  # 2 cached pages each, evictable
        live = alloc.new_request()
        assert alloc.alloc_extend(np.array([live]), np.array([0]), np.array([4]))
        now, after = alloc.can_admit({"full": demand})
        slot = alloc.new_request()
        got = alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([4 * demand]))
        assert after == (got is not None), demand
        assert now == after  # one sub-pool, no fences: nothing needs compaction
    assert after is False  # the loop reached demands past holes + evictable pages


def test_referenced_pages_are_never_evicted():
    alloc = make(4, pages=8)
    a, _ = serve(alloc, np.arange(13))  # 4 pages, 3 cached and held
    held = physical(alloc, a)
    c = alloc.new_request()
    free = room(alloc)
    assert alloc.alloc_extend(np.array([c]), np.array([0]), np.array([4 * (free + 1)])) is None
    assert physical(alloc, a) == held and alloc.prefix.counters()["evicted_pages"] == 0


def test_compaction_moves_cached_pages_and_a_hit_reads_their_bytes():
    alloc = make(4, pages=12)
    prompt = np.arange(30, 47)
    filler = alloc.new_request()
    assert alloc.alloc_extend(np.array([filler]), np.array([0]), np.array([16]))
    a, _ = serve(alloc, prompt)
    before = physical(alloc, a)
    alloc.free_request(filler)  # holes below the cached pages
    alloc.free_request(a)
    assert alloc.compact() > 0
    b, hit = serve(alloc, prompt)
    assert hit == 16 and physical(alloc, b)[:4] != before[:4]
    torch.testing.assert_close(read(alloc, b, len(prompt)), expected(prompt), rtol=0, atol=0)


def test_hash_collisions_are_caught_by_the_token_comparison(monkeypatch):
    monkeypatch.setattr(prefix_module, "hash", lambda _: 7, raising=False)
    alloc = make(4)
    serve(alloc, np.arange(9))  # block 0 takes key 7; block 1 collides and is not cached
    assert alloc.prefix.counters()["cached_pages"] == 1
    assert alloc.prefix.match(np.arange(100, 109)).num_tokens == 0
    assert alloc.prefix.match(np.arange(9)).num_tokens == 4


def test_a_stale_hit_is_refused_and_the_slot_closed():
    alloc = make(4, pages=6)
    prompt = np.arange(9)
    a, _ = serve(alloc, prompt)
    alloc.free_request(a)
    hit = alloc.prefix.match(prompt[:-1])
    c = alloc.new_request()
    free = room(alloc)
    assert alloc.alloc_extend(np.array([c]), np.array([0]), np.array([4 * (free + 2)]))
    open_before = alloc.parts.requests.in_use.sum()
    with pytest.raises(ValueError, match="stale"):
        alloc.new_request(prefix=hit)
    assert alloc.parts.requests.in_use.sum() == open_before
    with pytest.raises(TypeError, match="PrefixHit"):
        alloc.new_request(prefix="tokens")
    assert alloc.parts.requests.in_use.sum() == open_before


def test_pools_without_attention_are_refused():
    configs = [mamba_config()]  # no attention sub-pool keys a prefix (hybrids: test_prefix_hybrid)
    alloc = PoolAllocator(UnifiedPool(configs, pool_bytes_for(configs, {"mamba": 8})),
                          max_requests=2, max_context=32)  # fmt: skip
    with pytest.raises(ValueError, match="needs an attention sub-pool"):
        alloc.prefix.match([1, 2, 3, 4])
    slot = alloc.new_request()
    with pytest.raises(ValueError, match="needs an attention sub-pool"):
        alloc.prefix.insert(slot, [])


def test_bad_input_leaves_state_unchanged():
    alloc = make(4)
    a, _ = serve(alloc, np.arange(10))
    with pytest.raises(ValueError, match="holds 10 tokens"):
        alloc.prefix.insert(a, np.arange(11))
    with pytest.raises(ValueError, match="1-D list of ints"):
        alloc.prefix.match([[1, 2]])
    with pytest.raises(ValueError, match="shared prefix-cache pages"):
        alloc.truncate(np.array([a]), np.array([6]))
    alloc.truncate(np.array([a]), np.array([4]))  # whole pages: fine
    assert alloc.parts.prefix.refs[alloc.parts.requests.held_pages(a)].tolist() == [1]
    v = VirtualPageIds(torch.tensor([int(alloc.parts.requests.held_pages(a)[0])]))
    with pytest.raises(ValueError, match="shared prefix-cache pages"):
        alloc.io.release_physical("full", v)


# -- check_integrity: each new invariant broken alone -----------------------------


def busy() -> PoolAllocator:
    """r0 holds 3 cached pages shared with r1; a freed request left 2 evictable."""
    alloc = make(4, pages=16)
    serve(alloc, np.arange(13))
    serve(alloc, np.arange(13))
    c, _ = serve(alloc, np.arange(60, 69))
    alloc.free_request(c)
    return alloc


def _cached(alloc, held: bool) -> int:
    p = alloc.parts.prefix
    return next(page for page in p.by_page if (p.refs[page] > 0) == held)


def _free_cached_physical(alloc) -> None:
    """Free an evictable page's physical page behind the cache (consistently)."""
    book, vpages = alloc.parts.books["full"], np.array([_cached(alloc, False)], np.int32)
    alloc.parts.writer.unbind(book, vpages, book.unbind_host(vpages, held=False))


def _swap_keys(alloc) -> None:
    by_key = alloc.parts.prefix.by_key
    a, b = list(by_key)[:2]
    by_key[a], by_key[b] = by_key[b], by_key[a]


PREFIX_CASES = {
    "prefix refcount equals the request tables holding each cached page": lambda a: (
        a.parts.prefix.refs.__setitem__(_cached(a, True), 1)
    ),
    "cached pages are bound to LIVE pages, so never on the free stack": _free_cached_physical,
    "evictable prefix pages are exactly the cached pages with refcount 0": lambda a: (
        a.parts.prefix.lru.__setitem__(_cached(a, True), None)
    ),
    "the prefix hash map and the cached pages agree (one node per cached page)": lambda a: (
        a.parts.prefix.by_page.pop(_cached(a, False))
    ),
    "the prefix hash map and the cached pages agree (each node under its key)": _swap_keys,
    "prefix node ids are distinct and never reused": lambda a: setattr(
        a.parts.prefix, "_next_id", 1
    ),
    "each prefix node holds one page of tokens": lambda a: setattr(
        a.parts.prefix.by_page[_cached(a, True)], "tokens", bytes(3)
    ),
}


def test_the_prefix_busy_state_is_intact():
    alloc = busy()
    alloc.check_integrity()
    refs = alloc.parts.prefix.refs
    assert {0, 2} <= set(refs[list(alloc.parts.prefix.by_page)].tolist())


@pytest.mark.parametrize("invariant", list(PREFIX_CASES))
def test_each_broken_prefix_invariant_is_named(invariant):
    alloc = busy()
    PREFIX_CASES[invariant](alloc)
    with pytest.raises(AssertionError, match=re.escape(invariant)):
        alloc.check_integrity()


def test_the_exported_prefix_hit_is_what_match_returns():
    hit = busy().prefix.match(np.arange(9, dtype=np.int64))
    assert type(hit) is PrefixHit
