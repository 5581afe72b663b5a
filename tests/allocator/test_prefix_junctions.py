"""Shared junction checkpoints outlive per-request leaves under pressure (issue 41).

A junction: the checkpoint a request takes where its prompt left a cached run it
matched (two prompts share the prefix there, then diverge: ``junction=True``), or one
a hit restored (turn ends aside). Under pressure the pages of a junction's chain (at
or above its node) go after every other evictable page (``prefix_evict.evict_lru``),
and a checkpoint a hit restored after every other one (``StateCheckpoints.victims``).

Independent derivation: the eviction order on a small tree is written out by hand
(below, from the release order of ``prefix_evict.release_pages``: a finished
request's pages join the LRU deepest first); what survived is read back through
``match``. The control (the same tree with the junction taken as a plain
checkpoint) evicts in plain LRU order and loses the shared prefix's hit.
"""

from __future__ import annotations

import numpy as np
import pytest
from allocator_fixtures import full_config

from unikv.allocator import PoolAllocator
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, StatePart

PS = 4
HEAD = np.arange(8) + 100  # two pages every branch shares


def _alloc(pages: int, slots: int) -> PoolAllocator:
    state = MambaSpec(1, (StatePart((3,)),), StatePart((29,)))  # 128 B: two pages' bytes
    configs = [full_config(PS), SubPoolConfig("mamba", state)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages, "mamba": slots}))
    return PoolAllocator(pool, max_requests=8, max_context=64, debug=True)


def _serve(alloc: PoolAllocator, tokens: np.ndarray, points: list[tuple[int, bool]]) -> None:
    """A request computes ``tokens`` (no hit), caches its whole pages, checkpoints its
    state at each (tokens, junction) of ``points`` and finishes."""
    slot = alloc.new_request()
    assert alloc.alloc_mamba(np.array([slot])) is not None
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([len(tokens)]))
    alloc.prefix.insert(slot, tokens[: len(tokens) // PS * PS])
    for at, junction in points:
        assert alloc.prefix.checkpoint(slot, tokens[:at], junction=junction)
    alloc.free_request(slot)


def _tree(alloc: PoolAllocator, junction: bool) -> dict[str, int]:
    """A: HEAD + one page (checkpoint at its end); B: HEAD + another page, the
    junction at HEAD's end (where it left A's run) and its own end; C: two unrelated
    pages (checkpoint at its end). Returns page -> name: h0 h1 (HEAD), a, b, c0 c1."""
    a = np.concatenate([HEAD, np.arange(4) + 200, [1]])
    b = np.concatenate([HEAD, np.arange(4) + 300, [1]])
    c = np.arange(9) + 400
    _serve(alloc, a, [(12, False)])
    hit = alloc.prefix.match(b)
    assert hit.num_tokens == 0 and hit.num_page_tokens == 8, "B matches A's run, no state there"
    alloc.prefix.uncount(hit)
    _serve(alloc, b, [(8, junction), (12, False)])
    _serve(alloc, c, [(8, False)])
    prefix, names = alloc.parts.prefix, {}
    for name, tokens, depth in [("h0", HEAD, 1), ("h1", HEAD, 2), ("a", a, 3), ("b", b, 3),
                                ("c0", c, 1), ("c1", c, 2)]:  # fmt: skip
        node = prefix.walk(tokens[: depth * PS])[-1]
        names[node.page] = name
    return names


@pytest.mark.parametrize("junction", [True, False])
def test_a_junction_chain_survives_pressure_that_evicts_leaves(junction):
    alloc = _alloc(pages=16, slots=8)
    prefix = alloc.parts.prefix
    names = _tree(alloc, junction)
    # LRU by hand: A frees a, h1, h0 (deepest first); B's HEAD pages were its own
    # copies (A's were cached), so it adds b; C adds c1, c0.
    assert [names[p] for p in prefix.lru] == ["a", "h1", "h0", "b", "c1", "c0"]
    order = []
    for _ in range(3):
        before = set(prefix.by_page)
        alloc.parts.writer.write(prefix.evict(1))
        order += [names[p] for p in before - set(prefix.by_page)]
    tail = np.concatenate([HEAD, [9, 9, 9, 9, 9]])  # a new branch off HEAD
    if junction:  # the per-request leaves, oldest first; HEAD and its checkpoint stay
        assert order == ["a", "b", "c1"]
        assert alloc.prefix.match(tail).num_tokens == 8
        assert prefix.states.shared == {prefix.walk(HEAD)[-1].node_id}
    else:  # control: plain LRU takes HEAD's chain (and orphans b below it)
        assert order == ["a", "h1", "h0"]
        assert alloc.prefix.match(tail).num_tokens == 0
    alloc.check_integrity()


@pytest.mark.parametrize("how", ["junction", "hit", "neither"])
def test_a_junction_or_restored_checkpoint_outlives_a_per_request_one(how):
    alloc = _alloc(pages=8, slots=4)
    states = alloc.parts.prefix.states
    a, b = np.arange(9) + 100, np.arange(9) + 200
    _serve(alloc, a, [(8, how == "junction")])
    if how == "hit":  # a request restores a's checkpoint, then finishes
        slot = alloc.new_request(prefix=alloc.prefix.match(a))
        assert alloc.alloc_mamba(np.array([slot])) is not None
        alloc.free_request(slot)
    _serve(alloc, b, [(8, False)])  # the newer
    while not states.evicted:  # requests take state slots until one evicts a checkpoint
        assert alloc.alloc_mamba(np.array([alloc.new_request()])) is not None
    assert states.evicted == 1
    # a junction's or a restored one's node is on a junction chain: b's pages go first
    kept, gone = (b, a) if how == "neither" else (a, b)  # control: the LRU's oldest goes
    assert alloc.prefix.match(kept).num_tokens == 8
    assert alloc.prefix.match(gone).num_tokens == 0
    alloc.check_integrity()


def test_a_waiting_requests_chain_outlives_a_junctions():
    alloc = _alloc(pages=16, slots=8)
    prefix = alloc.parts.prefix
    names = _tree(alloc, junction=True)
    c = np.arange(9) + 400
    node = alloc.prefix.expect(c)  # a waiting request would restore C's checkpoint
    assert node and [names[p] for p in prefix.lru] == ["a", "h1", "h0", "b", "c1", "c0"]
    order = []
    for _ in range(4):
        before = set(prefix.by_page)
        alloc.parts.writer.write(prefix.evict(1))
        order += [names[p] for p in before - set(prefix.by_page)]
    # by hand: the unshared leaves (a, b), then HEAD's junction chain, C's chain last
    assert order == ["a", "b", "h1", "h0"]
    assert alloc.prefix.match(c).num_tokens == 8
    alloc.prefix.unexpect(node)
    alloc.check_integrity()


def _turns(alloc: PoolAllocator, hit: bool) -> dict[int, str]:
    """Conversation X: turn 1 computes ``x[:9]`` (turn end at 8), turn 2 ``x`` (turn
    end at 12), opening with a hit of turn 1's checkpoint (``hit``) or computing all of
    it (the control); then conversation Y computes ``y`` (turn end at 8). Returns page
    -> name: x0 x1 x2, y0 y1."""
    x, y = np.arange(13) + 500, np.arange(9) + 600
    slot = alloc.new_request()
    assert alloc.alloc_mamba(np.array([slot])) is not None
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([9]))
    alloc.prefix.insert(slot, x[:8])
    assert alloc.prefix.checkpoint(slot, x[:8], turn_end=True)
    alloc.free_request(slot)
    match = alloc.prefix.match(x) if hit else None
    assert match is None or match.num_tokens == 8, "turn 2 hits turn 1's end"
    slot = alloc.new_request(prefix=match)
    assert alloc.alloc_mamba(np.array([slot])) is not None  # (restores the hit)
    start = 8 if hit else 0
    assert alloc.alloc_extend(np.array([slot]), np.array([start]), np.array([13 - start]))
    alloc.prefix.insert(slot, x[:12])
    assert alloc.prefix.checkpoint(slot, x[:12], turn_end=True)
    alloc.free_request(slot)
    slot = alloc.new_request()
    assert alloc.alloc_mamba(np.array([slot])) is not None
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([9]))
    alloc.prefix.insert(slot, y[:8])
    assert alloc.prefix.checkpoint(slot, y[:8], turn_end=True)
    alloc.free_request(slot)
    prefix = alloc.parts.prefix
    names = {prefix.walk(x[: (i + 1) * PS])[-1].page: f"x{i}" for i in range(3)}
    names.update({prefix.walk(y[: (i + 1) * PS])[-1].page: f"y{i}" for i in range(2)})
    return names


@pytest.mark.parametrize("hit", [True, False])
def test_a_conversation_that_hit_keeps_its_turn_end_over_a_newer_one(hit):
    alloc = _alloc(pages=16, slots=8)
    prefix = alloc.parts.prefix
    names = _turns(alloc, hit)
    x, y = np.arange(13) + 500, np.arange(9) + 600
    # LRU by hand: turn 1 frees x1, x0 (deepest first); turn 2 with a hit held them
    # and frees x2, x1, x0; without one its x0 x1 were its own copies, so it adds x2;
    # Y adds y1, y0
    lru = ["x2", "x1", "x0"] if hit else ["x1", "x0", "x2"]
    assert [names[p] for p in prefix.lru] == lru + ["y1", "y0"]
    order = []
    for _ in range(2):
        before = set(prefix.by_page)
        alloc.parts.writer.write(prefix.evict(1))
        order += [names[p] for p in before - set(prefix.by_page)]
    if hit:  # X's turn end is carried: the newer, plain conversation Y goes first
        assert order == ["y1", "y0"]
        assert alloc.prefix.match(x).num_tokens == 12
        assert alloc.prefix.match(y).num_tokens == 0
    else:  # control: plain LRU takes X's oldest pages and both its checkpoints
        assert order == ["x1", "x0"]
        assert alloc.prefix.match(x).num_tokens == 0
        assert alloc.prefix.match(y).num_tokens == 8
    alloc.check_integrity()
