"""Hypothesis stateful runs of the prefix cache over a tight full-attention pool
(page sizes 1 and 4): requests sharing prefixes (a few base prompts, random
suffixes), decode, caching, frees, LRU eviction under pressure, compaction and
forward fences; ``check_integrity()`` after every step (debug mode) and:

- no page is freed while referenced: every page of every open request is bound;
- no cached page is written: the shadow dict holds the bytes of every cached
  page from the moment it was cached, compared after every rule;
- a hit reads exactly the bytes that were cached, and those are the rows of the
  same tokens (the shadow records each cached block's tokens).

Each written token row holds a value used once (a counter), so a row read
through the wrong page cannot look right.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import FakeEvent, full_config, same_start
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from unikv.allocator import PoolAllocator
from unikv.ids import VirtualTokenIds
from unikv.pool import UnifiedPool, pool_bytes_for

BASES = [list(range(1, 13)), [1, 2, 3, 4, 5, 6, 70, 71, 72, 73], [9] * 11]


def derandomized(max_examples: int, steps: int, shrink: bool = True) -> settings:
    """The prefix state machines' settings: derandomized (their coverage checks must
    not depend on the seed); ``shrink=False``: no shrinking (minutes on a failure)."""
    phases = {} if shrink else {"phases": [Phase.explicit, Phase.generate]}
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
        **phases,
    )


class FenceRules:
    """The rules every prefix machine shares (``self.alloc``, ``self.event``):
    compaction, a forward's fence, and that fence firing."""

    @rule()
    def compact(self):
        self.alloc.compact()
        self.event = None  # compaction waits for the fences

    @rule()
    def forward(self):
        self.event = FakeEvent()
        self.alloc.mark_in_flight(self.event)

    @precondition(lambda self: self.event is not None)
    @rule()
    def fire(self):
        self.event.fired = True
        self.event = None


class PrefixMachine(FenceRules, RuleBasedStateMachine):
    PS = 4

    def __init__(self) -> None:
        super().__init__()
        configs = [full_config(self.PS)]
        self.pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": 24 // self.PS + 6}))
        self.alloc = PoolAllocator(self.pool, max_requests=4, max_context=24, debug=True)
        self.book = self.alloc.parts.books["full"]
        self.tokens: dict[int, list[int]] = {}  # request -> token ids held
        self.values: dict[int, list[float]] = {}  # request -> row value per position
        self.shadow: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}  # vpage -> (bytes, block)
        self.counter = 0
        self.event: FakeEvent | None = None
        self.hits = 0

    # -- helpers ------------------------------------------------------------------

    def _rows(self, slot: int, start: int, stop: int):
        ids = self.alloc.parts.requests.req_to_token[slot, start:stop].clone()
        phys = self.alloc.translate(VirtualTokenIds(ids), "full", physical=True).data.long()
        return phys // self.PS, phys % self.PS

    def _write(self, slot: int, start: int) -> None:
        stop = len(self.tokens[slot])
        values = torch.arange(self.counter, self.counter + stop - start, dtype=torch.float32)
        self.counter += stop - start
        pages, rows = self._rows(slot, start, stop)
        for k, v in self.pool["full"].paged_views:
            k[pages, rows] = values.view(-1, 1, 1)
            v[pages, rows] = values.view(-1, 1, 1) + 0.5
        self.values[slot] += values.tolist()

    def _read(self, slot: int, stop: int) -> list[float]:
        pages, rows = self._rows(slot, 0, stop)
        k, _ = self.pool["full"].paged_views[0]
        return k[pages, rows][:, 0, 0].tolist()

    def _page_bytes(self, vpage: int) -> torch.Tensor:
        ppage = int(self.book.v2p_host[vpage])
        return torch.stack([t[ppage].clone() for kv in self.pool["full"].paged_views for t in kv])

    def _cached(self) -> set[int]:
        return set(self.alloc.parts.prefix.by_page)

    # -- rules --------------------------------------------------------------------

    @precondition(lambda self: len(self.tokens) < 4)
    @rule(base=st.sampled_from(BASES), cut=st.integers(5, 12), tail=st.lists(st.integers(0, 3)))
    def admit(self, base, cut, tail):
        prompt = (base[:cut] + tail)[:20] or [0]
        hit = self.alloc.prefix.match(np.array(prompt[:-1]))
        slot = self.alloc.new_request(prefix=hit)
        pages = self.alloc.parts.requests.held_pages(slot)
        for i, vpage in enumerate(pages.tolist()):  # a hit: exactly the cached bytes and tokens
            saved, block = self.shadow[vpage]
            assert block == tuple(prompt[i * self.PS : (i + 1) * self.PS])
            assert torch.equal(self._page_bytes(vpage), saved)
        self.hits += len(pages) > 0
        self._prefill(slot, prompt, hit.num_tokens)

    def _prefill(self, slot: int, prompt: list[int], cached: int) -> None:
        """Request ``slot`` opened with ``cached`` tokens of ``prompt`` hit: allocate
        and write the rest, or free it when the pool has no room."""
        self.tokens[slot] = prompt[:cached]
        self.values[slot] = self._read(slot, cached) if cached else []
        rest = len(prompt) - cached
        if self.alloc.alloc_extend(np.array([slot]), np.array([cached]), np.array([rest])) is None:
            self._free(slot)
            return
        self.tokens[slot] = prompt
        self._write(slot, cached)

    def _free(self, slot: int) -> None:
        self.alloc.free_request(slot)
        del self.tokens[slot], self.values[slot]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        held = len(self.tokens[slot])
        if held >= 24 or self.alloc.alloc_decode(np.array([slot]), np.array([held])) is None:
            return
        self.tokens[slot].append(token)
        self._write(slot, held)

    @initialize()
    def cached_chains(self):
        """Every example starts with each base's first 12 tokens cached by finished
        requests (evictable), so its admissions hit and evict whatever the generated
        sequence: the coverage checks below do not hang on the seed. It draws nothing:
        run once per machine class and forked into each later example (``same_start``)."""
        same_start(self, self._cache_chains)

    def _cache_chains(self) -> None:
        for base in BASES:
            slot = self.alloc.new_request()
            self._prefill(slot, base[:12], 0)
            if slot in self.tokens:
                self._cache(slot)
                self._free(slot)
        self._after_chains()

    def _after_chains(self) -> None:
        """What a subclass does once the initial chains are cached (nothing here)."""

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache(self, data):
        self._cache(data.draw(st.sampled_from(sorted(self.tokens))))

    def _cache(self, slot: int) -> None:
        """Share request ``slot``'s full pages; the shadow records the new ones."""
        before = self._cached()
        self.alloc.prefix.insert(slot, np.array(self.tokens[slot]))
        pages = self.alloc.parts.requests.held_pages(slot).tolist()
        for vpage in self._cached() - before:
            i = pages.index(vpage)
            block = tuple(self.tokens[slot][i * self.PS : (i + 1) * self.PS])
            self.shadow[vpage] = (self._page_bytes(vpage), block)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        self._free(data.draw(st.sampled_from(sorted(self.tokens))))

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def shared_pages_hold_what_was_cached(self):
        cached = self._cached()
        for vpage in list(self.shadow):
            if vpage not in cached:  # evicted: the shadow forgets it
                del self.shadow[vpage]
        assert set(self.shadow) == cached
        for vpage, (saved, _) in self.shadow.items():
            assert torch.equal(self._page_bytes(vpage), saved), f"cached page {vpage} written"

    @invariant()
    def requests_read_their_own_rows(self):
        for slot, tokens in self.tokens.items():
            pages = self.alloc.parts.requests.held_pages(slot)
            assert (self.book.v2p_host[pages] > 0).all(), "a referenced page was freed"
            assert self._read(slot, len(tokens)) == self.values[slot]


@pytest.mark.parametrize("ps", [1, 4])
def test_prefix_cache_state_machine(ps):
    machine = type(f"PrefixMachine{ps}", (PrefixMachine,), {"PS": ps})
    runs = {"hits": 0, "evicted": 0}

    class Counted(machine):
        def teardown(self):
            runs["hits"] += self.hits
            runs["evicted"] += self.alloc.prefix.counters()["evicted_pages"]

    Counted.TestCase.settings = derandomized(max_examples=100, steps=40)
    Counted.TestCase().runTest()
    assert runs["hits"] > 20 and runs["evicted"] > 20, runs  # the runs shared and evicted
