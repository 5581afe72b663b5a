"""Hypothesis stateful runs of the prefix cache over a tight pool of full attention
and a sliding window (issue 41, item 2): requests share prefixes, prefill in chunks,
decode, free their out-of-window pages after each write, are cached and freed, under
window-binding and page eviction, compaction and forward fences; ``check_integrity()``
after every verb (debug mode). Independent of the allocator, a shadow knows

- each request's tokens and the value written at each position (a counter: a row read
  through the wrong page cannot look right), and the first page its window still
  holds, derived from its length alone (``(len - W) // ps``);
- so the window holds of each cached page, which must equal the allocator's
  ``wrefs``; and every request holds at most the pages its window and its last write
  need, cache on;
- a request's next query reads, in the window sub-pool, exactly the values written at
  those positions (its own, or the cached ones of its hit).

``DeadPagesMachine`` adds one rule and one invariant (issue 41): the dead pages
(``prefix_evict.dead_pages``: evictable, below the last node of their chain whose window
is intact) are exactly those no ``match`` of a cached chain's tokens reaches, derived
through the public lookup; and evicting them first (``evict``) loses no hit: every
other cached chain matches as far after as before (``test_a_live_page_taken_for_dead_
is_caught``: a dead set with a live page in it is named).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import FakeEvent, full_config, same_start
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_prefix_cache_stateful import BASES, FenceRules, derandomized

from unikv.allocator import PoolAllocator, prefix_evict
from unikv.allocator.prefix import CACHED
from unikv.ids import VirtualTokenIds
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

W = 6  # no multiple of either page size
MAX = 24
CHUNK = 8


class WindowMachine(FenceRules, RuleBasedStateMachine):
    PS = 2

    def __init__(self) -> None:
        super().__init__()
        swa = MHASpec(1, 1, 3, dtype=torch.float32, sliding_window=W)
        configs = [full_config(self.PS), SubPoolConfig("swa", swa, page_size=self.PS)]
        # room for two whole requests of full attention; the window sub-pool gets the
        # same bytes: far less than the cached prompts' window bindings would take
        pages = {"full": 2 * MAX // self.PS + 2, "swa": 2 * MAX // self.PS + 2}
        self.pool = UnifiedPool(configs, pool_bytes_for(configs, pages))
        self.alloc = PoolAllocator(self.pool, max_requests=4, max_context=MAX, debug=True)
        self.tokens: dict[int, list[int]] = {}
        self.values: dict[int, list[float]] = {}
        self.counter = 0
        self.event: FakeEvent | None = None
        self.hits = 0

    # -- helpers ------------------------------------------------------------------

    def _rows(self, slot: int, start: int, stop: int, name: str):
        ids = self.alloc.parts.requests.req_to_token[slot, start:stop].clone()
        phys = self.alloc.translate(VirtualTokenIds(ids), name, physical=True).data.long()
        return phys // self.PS, phys % self.PS

    def _write(self, slot: int, start: int) -> None:
        stop = len(self.tokens[slot])
        values = torch.arange(self.counter, self.counter + stop - start, dtype=torch.float32)
        self.counter += stop - start
        for name in ("full", "swa"):
            pages, rows = self._rows(slot, start, stop, name)
            for k, v in self.pool[name].paged_views:
                k[pages, rows] = values.view(-1, 1, 1)
                v[pages, rows] = values.view(-1, 1, 1) + 0.5
        self.values[slot] += values.tolist()

    def _read(self, slot: int, start: int, stop: int, name: str) -> list[float]:
        pages, rows = self._rows(slot, start, stop, name)
        k, _ = self.pool[name].paged_views[0]
        return k[pages, rows][:, 0, 0].tolist()

    def _window_frees(self, slot: int) -> None:
        held = len(self.tokens[slot])
        self.alloc.free_out_of_window(np.array([slot]), np.array([held]))

    def _grow(self, slot: int, prompt: list[int], start: int, share: bool = True) -> bool:
        """Prefill ``prompt[start:]`` in chunks, window frees after each (``share``:
        each chunk cached before, as the engine does); False (the request freed) when
        the pool has no room."""
        while len(self.tokens[slot]) < len(prompt):
            held = len(self.tokens[slot])
            n = min(CHUNK, len(prompt) - held)
            if self.alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([n])) is None:
                self._free(slot)
                return False
            self.tokens[slot] = prompt[: held + n]
            self._write(slot, held)
            if share:
                self.alloc.prefix.insert(slot, np.array(self.tokens[slot]))
            self._window_frees(slot)
        return True

    def _free(self, slot: int) -> None:
        self.alloc.free_request(slot)
        del self.tokens[slot], self.values[slot]

    def _lo(self, slot: int) -> int:
        """The first page request ``slot``'s window still holds, from its length."""
        return max(len(self.tokens[slot]) - W, 0) // self.PS

    # -- rules --------------------------------------------------------------------

    @initialize()
    def cached_chains(self):
        """(Draws nothing: run once per machine class, forked into each later example.)"""
        same_start(self, self._cache_chains)

    def _cache_chains(self) -> None:
        for base in BASES:
            slot = self.alloc.new_request()
            self.tokens[slot], self.values[slot] = [], []
            if self._grow(slot, base[:12], 0):
                self.alloc.prefix.insert(slot, np.array(self.tokens[slot]))
                self._free(slot)

    @precondition(lambda self: len(self.tokens) < 4)
    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(5, 12),
        tail=st.lists(st.integers(0, 3)),
        share=st.booleans(),
    )
    def admit(self, base, cut, tail, share):
        prompt = (base[:cut] + tail)[:20] or [0]
        hit = self.alloc.prefix.match(np.array(prompt[:-1]))
        slot = self.alloc.new_request(prefix=hit)
        k = hit.num_tokens
        self.tokens[slot] = prompt[:k]
        # the window its first query reads: the cached values, bound (window_intact)
        first = max(k + 1 - W, 0)
        self.values[slot] = [float("nan")] * first + self._read(slot, first, k, "swa")
        assert self.values[slot][first:] == self._read(slot, first, k, "full")
        self.hits += k > 0
        self._grow(slot, prompt, k, share)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        held = len(self.tokens[slot])
        if held >= MAX or self.alloc.alloc_decode(np.array([slot]), np.array([held])) is None:
            return
        self.tokens[slot].append(token)
        self._write(slot, held)
        self._window_frees(slot)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache(self, data):
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        self.alloc.prefix.insert(slot, np.array(self.tokens[slot]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        self._free(data.draw(st.sampled_from(sorted(self.tokens))))

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def each_window_reads_what_was_written(self):
        for slot, tokens in self.tokens.items():
            start = max(len(tokens) + 1 - W, 0)  # the next query's first position
            assert self._read(slot, start, len(tokens), "swa") == self.values[slot][start:]

    @invariant()
    def window_holds_match_the_shadow_and_are_bounded(self):
        parts = self.alloc.parts
        expect = np.zeros_like(parts.prefix.wrefs["swa"])
        for slot in self.tokens:
            pages = parts.requests.held_pages(slot)
            lo = self._lo(slot)
            window = pages[lo:]
            # a request holds no more window pages than its window and last write need
            assert len(window) <= -(-(W + CHUNK) // self.PS) + 1
            np.add.at(expect, window[parts.vspace.owner[window] == CACHED], 1)
            # every page it holds in the window is bound in the window sub-pool
            assert (parts.books["swa"].v2p_host[window] > 0).all()
        assert np.array_equal(parts.prefix.wrefs["swa"], expect), "wrefs vs the shadow"


@pytest.mark.parametrize("ps", [2, 4])
def test_prefix_window_state_machine(ps):
    machine = type(f"WindowMachine{ps}", (WindowMachine,), {"PS": ps})
    runs = {"hits": 0, "windows": 0, "pages": 0}

    class Counted(machine):
        def teardown(self):
            stats = self.alloc.prefix.counters()
            runs["hits"] += self.hits
            runs["windows"] += stats["evicted_windows"]
            runs["pages"] += stats["evicted_pages"]

    Counted.TestCase.settings = derandomized(max_examples=60, steps=40)
    Counted.TestCase().runTest()
    # the runs hit, evicted window bindings alone and evicted whole pages (at page 4
    # nearly every binding lies in some chain end's window suffix: few go alone)
    windows = 20 if ps == 2 else 0
    assert runs["hits"] > 20 and runs["windows"] > windows and runs["pages"] > 0, runs


class DeadPagesMachine(WindowMachine):
    """``WindowMachine`` plus the dead-page rule and invariant (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.dead_evicted = self.dead_states = 0

    @precondition(lambda self: self.alloc.parts.prefix.num_reclaimable)
    @rule(count=st.integers(1, 6))
    def pressure(self, count):
        """The room maker's eviction of ``count``: dead pages first, and while they
        last no hit is lost; past them, every dead page is gone."""
        prefix = self.alloc.parts.prefix
        dead = self._dead()
        before = self._hits()
        self.alloc.parts.writer.write(prefix.evict(count))
        gone = set(before) - set(prefix.by_page)
        self.dead_evicted += len(gone & set(dead))
        if count <= len(dead):
            assert gone <= set(dead), "a live page evicted while dead pages were left"
            after = self._hits()
            for page, reach in before.items():
                if page not in dead:
                    assert after[page] == reach, f"a hit lost: page {page} {reach} -> {after[page]}"
        else:
            assert set(dead) <= gone, "a dead page kept while live ones were evicted"

    def _chain(self, node) -> list[int]:
        """The tokens of ``node``'s chain, from the root to it."""
        blocks, by_id = [], self.alloc.parts.prefix.by_id
        while node is not None:
            blocks.append(np.frombuffer(node.tokens, np.int64).tolist())
            node = by_id.get(node.parent_id) if node.parent_id else None
        return [t for b in reversed(blocks) for t in b]

    def _hits(self) -> dict[int, int]:
        """Cached page -> the tokens a lookup of its chain (plus one token) hits."""
        prefix, out = self.alloc.parts.prefix, {}
        for page, node in list(prefix.by_page.items()):
            hit = prefix.match(np.array(self._chain(node) + [0], np.int64))
            prefix.uncount(hit)
            out[page] = hit.num_tokens
        return out

    def _dead(self) -> list[int]:
        """Evictable cached pages no hit of a lookup of any cached chain reaches."""
        prefix, ps = self.alloc.parts.prefix, self.PS
        reached = set()
        for node in prefix.by_page.values():
            chain = self._chain(node)
            if len(prefix.walk(np.array(chain, np.int64))) * ps < len(chain):
                continue  # an orphan: a lookup of its chain does not reach it
            hit = prefix.match(np.array(chain + [0], np.int64))
            prefix.uncount(hit)
            reached.update(hit.nodes.tolist())
        return [p for p in prefix.lru if prefix.by_page[p].node_id not in reached]

    @invariant()
    def dead_pages_are_those_no_lookup_reaches(self):
        got = prefix_evict.dead_pages(self.alloc.parts.prefix).tolist()
        assert sorted(got) == sorted(self._dead()), "dead pages vs the lookups"
        self.dead_states += bool(got)


@pytest.mark.parametrize("ps", [2, 4])
def test_dead_pages_state_machine(ps):
    machine = type(f"DeadPagesMachine{ps}", (DeadPagesMachine,), {"PS": ps})
    runs = {"seen": 0, "dead": 0}

    class Counted(machine):
        def teardown(self):
            runs["seen"] += self.dead_states
            runs["dead"] += self.dead_evicted

    Counted.TestCase.settings = derandomized(max_examples=20, steps=40)
    Counted.TestCase().runTest()
    assert runs["seen"] > 0 and runs["dead"] > 0, runs  # dead pages arose and went first


def test_a_live_page_taken_for_dead_is_caught(monkeypatch):
    """A dead set holding a page a lookup still reaches: the check names it, and
    evicting it loses a hit."""
    machine = DeadPagesMachine()
    machine.cached_chains()
    prefix = machine.alloc.parts.prefix
    live = [p for p in prefix.lru if p not in machine._dead()]
    assert live
    monkeypatch.setattr(prefix_evict, "dead_pages", lambda cache: np.array(live[-1:], np.int32))
    with pytest.raises(AssertionError, match="dead pages vs the lookups"):
        machine.dead_pages_are_those_no_lookup_reaches()
    monkeypatch.setattr(machine, "_dead", lambda: live[-1:])  # the shadow fooled alike
    with pytest.raises(AssertionError, match="a live page evicted|a hit lost"):
        machine.pressure(1)
