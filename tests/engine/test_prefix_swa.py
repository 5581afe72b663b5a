"""Prefix caching of sliding-window models end to end on CPU (fp32, torch
reference kernels): Mistral (SWA only, window 7) and gpt-oss (full and SWA
layers, window 6), windows that are no multiple of the page size, pages 4 and
16. Greedy tokens with hits equal the same run without the cache and
transformers' ``generate`` on the same weights, for repeated prompts, prompts
sharing only part of a page, and a tight pool with eviction and preemption.
The allocator-level rules (a hit needs its window pages; a request's window
frees release cached pages to the cache, which evicts window bindings alone under
pressure, suffixes last; the invariants and their corruption tests) follow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import full_config
from engine_fixtures import hf_greedy, one_thread, save_tiny_model  # noqa: F401
from prefix_fixtures import (
    partial_hit,
    pool_budget,
    prefix_llm,
    run_without_and_with_cache,
    tight_pool_prompts,
)

from unikv.allocator import PoolAllocator, PrefixHit
from unikv.allocator.prefix import stage_unbind
from unikv.allocator.tables import TablePatch
from unikv.engine import SamplingParams
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

NEW_TOKENS = 10
ARCHS = ["mistral", "gpt_oss"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return path, save_tiny_model(request.param, path)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("ps", [4, 16])
def test_window_hits_give_the_tokens_of_no_cache_and_of_transformers(tiny, ps):
    path, hf = tiny
    # each prefill chunk was cached before its pages left the window: all whole pages hit
    run = run_without_and_with_cache(path, hf, ps, NEW_TOKENS, seed=4)
    run.llm.alloc.check_integrity()
    _, part = partial_hit(path, ps, run)
    assert part.num_cached_tokens == 2 * ps and part.output_ids == run.want[3]


@pytest.mark.usefixtures("one_thread")
def test_tight_pool_evicts_and_preempts_with_the_same_tokens(tiny):
    from unikv.hf_config import specs_from_hf_config

    path, hf = tiny
    ps = 4
    prompts = tight_pool_prompts(seed=6)
    configs = specs_from_hf_config(path, page_size=ps, dtype=torch.float32)
    budget = pool_budget(configs, 22)  # 88 tokens a band
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = prefix_llm(path, ps, True, kv_cache_bytes=budget, max_model_len=48)
    for _ in range(2):
        assert [o.output_ids for o in llm.generate(prompts, params)] == want
    stats = llm.alloc.prefix.counters()
    assert stats["evicted_pages"] > 0 and stats["hit_tokens"] > 0
    llm.alloc.check_integrity()


# -- the allocator's rules -------------------------------------------------------------

PS, W = 4, 6  # a window that is no multiple of the page


def _alloc() -> PoolAllocator:
    swa = SubPoolConfig("swa", MHASpec(1, 1, 3, dtype=torch.float32, sliding_window=W), PS)
    configs = [full_config(PS), swa]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {c.name: 24 for c in configs}))
    return PoolAllocator(pool, max_requests=4, max_context=64, debug=True)


def _prefill(alloc: PoolAllocator, tokens: np.ndarray, chunk: int, cache_each: bool) -> int:
    """A request holding ``tokens``, written ``chunk`` at a time, freed out of the
    window after each chunk; with ``cache_each`` cached before each window free."""
    slot, held = alloc.new_request(), 0
    while held < len(tokens):
        n = min(chunk, len(tokens) - held)
        assert alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([n])) is not None
        held += n
        if cache_each:
            alloc.prefix.insert(slot, tokens[:held])
        alloc.free_out_of_window(np.array([slot]), np.array([held]))
    alloc.prefix.insert(slot, tokens)
    return slot


def _swa_bound(alloc: PoolAllocator, pages: np.ndarray) -> np.ndarray:
    return alloc.parts.books["swa"].physical(pages) >= 0


def test_a_hit_falls_back_to_the_longest_prefix_whose_window_is_intact():
    alloc = _alloc()
    tokens = np.arange(100, 124)  # 6 pages
    _prefill(alloc, tokens, chunk=24, cache_each=False)  # frees pages 0-3 before caching
    hit = alloc.prefix.match(tokens)
    chain = np.array([n.page for n in alloc.parts.prefix.walk(tokens)])  # before the fallback
    assert len(chain) == 6  # every block is cached ...
    assert _swa_bound(alloc, chain).tolist() == [False] * 4 + [True] * 2  # ... 4 left the window
    # a request at k pages reads positions >= 4k + 1 - W: k = 6 reads pages 4-5
    assert hit.num_tokens == 24
    # k = 5 needs page 3, k = 4 page 2, ... k = 1 page 0: all gone, a miss
    assert alloc.prefix.match(tokens[:20]).num_tokens == 0
    b = alloc.new_request(prefix=hit)
    assert alloc.alloc_extend(np.array([b]), np.array([24]), np.array([3])) is not None
    alloc.check_integrity()


def test_caching_each_chunk_keeps_every_window_until_pressure():
    alloc = _alloc()
    tokens = np.arange(200, 224)
    a = _prefill(alloc, tokens, chunk=5, cache_each=True)
    chain = alloc.parts.requests.pages[a, :6].copy()
    assert _swa_bound(alloc, chain).all()  # the cache kept them past a's window
    for k in range(1, 7):  # every prefix is a hit now
        assert alloc.prefix.match(tokens[: 4 * k]).num_tokens == 4 * k
    b = alloc.new_request(prefix=alloc.prefix.match(tokens[:8]))  # at 2 pages
    c = alloc.new_request(prefix=alloc.prefix.match(tokens[:20]))  # at 5 pages
    wrefs = alloc.parts.prefix.wrefs["swa"]
    # windows hold: a (24 tokens) pages 4-5; b (8) pages 0-1 (reads from 3); c (20) 3-4
    assert wrefs[chain].tolist() == [1, 1, 0, 1, 2, 1]
    assert alloc.alloc_extend(np.array([c]), np.array([20]), np.array([12])) is not None
    alloc.free_out_of_window(np.array([c]), np.array([32]))  # c's window leaves pages 0-5
    assert wrefs[chain].tolist() == [1, 1, 0, 0, 1, 1]
    assert _swa_bound(alloc, chain).all()  # no pressure: the cache keeps them all
    assert alloc.alloc_extend(np.array([b]), np.array([8]), np.array([1])) is not None
    for slot in (a, b, c):
        alloc.free_request(slot)
    assert alloc.prefix.counters()["evictable"] >= 6
    alloc.check_integrity()


def test_a_window_page_a_request_reads_unbound_is_named():
    """Corruption: a cached page that a live request's next query reads loses
    its SWA binding behind the allocator's back."""
    alloc = _alloc()
    tokens = np.arange(300, 316)
    _prefill(alloc, tokens, chunk=16, cache_each=True)
    hit = alloc.prefix.match(tokens)
    b = alloc.new_request(prefix=hit)
    page = int(hit.pages[-1])  # b's next query (position 16) reads page 3
    parts, patch = alloc.parts, TablePatch()  # an unbind as a window free would do it
    stage_unbind(parts.books, ("swa",), parts.fences, parts.writer, np.array([page]), patch)
    parts.writer.write(patch)
    with pytest.raises(AssertionError, match="cached pages an open request's window reads"):
        alloc.check_integrity()
    assert b >= 0


def test_a_hit_longer_than_the_intact_window_breaks_the_invariant():
    """A hand-made hit past the fallback (its window page unbound) would have the
    request read a freed page: check_integrity names it."""
    alloc = _alloc()
    tokens = np.arange(400, 424)
    _prefill(alloc, tokens, chunk=24, cache_each=False)
    cache = alloc.parts.prefix
    nodes = cache.walk(tokens[:20])
    bad = PrefixHit(np.array([n.page for n in nodes], np.int32),
                    np.array([n.node_id for n in nodes], np.int64), 20, 20)  # fmt: skip
    with pytest.raises(AssertionError, match="cached pages an open request's window reads"):
        alloc.new_request(prefix=bad)  # debug: check_integrity after the verb


def test_window_bindings_no_window_holds_go_alone_under_pressure_suffix_last():
    """Pages that left every request's window are the cache's: ``evict`` unbinds them
    in the window sub-pool alone (nodes stay), those outside the chain end's window
    suffix first; a hit then falls back to where its window is still bound."""
    alloc = _alloc()
    cache = alloc.parts.prefix
    tokens = np.arange(500, 524)  # 6 pages, each chunk cached before its window frees
    a = _prefill(alloc, tokens, chunk=4, cache_each=True)
    chain = alloc.parts.requests.pages[a, :6].copy()
    alloc.free_request(a)
    assert (cache.wrefs["swa"][chain] == 0).all() and _swa_bound(alloc, chain).all()
    # ends: every insert's last block (pages 0..5) -> every page is some end's suffix;
    # forget the chunk ends but the last: pages 4-5 are the suffix, 0-3 are not
    cache.ends = {cache.by_page[int(chain[-1])].node_id}
    alloc.parts.writer.write(cache.evict(3))
    assert _swa_bound(alloc, chain).tolist() == [False] * 3 + [True] * 3
    assert alloc.prefix.counters()["evicted_windows"] == 3 and len(cache.by_page) == 6  # nodes stay
    assert alloc.prefix.match(tokens).num_tokens == 24  # the chain end still hits
    assert alloc.prefix.match(tokens[:16]).num_tokens == 0  # k = 4 needs page 3: gone, then a miss
    alloc.check_integrity()


def test_a_window_refcount_off_by_one_is_named():
    """Corruption: one cached page's window refcount disagrees with the request
    windows that hold it."""
    alloc = _alloc()
    tokens = np.arange(600, 616)
    _prefill(alloc, tokens, chunk=4, cache_each=True)
    page = int(alloc.prefix.match(tokens).pages[0])
    alloc.parts.prefix.wrefs["swa"][page] += 1
    with pytest.raises(AssertionError, match="window refcount equals the open request windows"):
        alloc.check_integrity()


def test_a_held_window_page_unbound_is_named():
    """Corruption: a cached page inside a request's window (columns from window_lo),
    not read by its next query, loses its binding: the window hold is broken."""
    alloc = _alloc()
    tokens = np.arange(700, 716)
    slot = alloc.new_request()
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([16])) is not None
    alloc.prefix.insert(slot, tokens)  # no window free yet: window_lo is 0
    page = int(alloc.parts.requests.pages[slot, 0])  # the next query reads pages 2-3 only
    parts, patch = alloc.parts, TablePatch()
    stage_unbind(parts.books, ("swa",), parts.fences, parts.writer, np.array([page]), patch)
    parts.writer.write(patch)
    with pytest.raises(AssertionError, match="cached pages a request window holds are bound"):
        alloc.check_integrity()
