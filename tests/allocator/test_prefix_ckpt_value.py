"""Which cached pages and state checkpoints go first on a hybrid (issue 41, item 1):

- pages below no checkpoint are dead (a hybrid hit ends at a checkpoint:
  ``prefix_evict.dead_pages``) and go before any other, whatever their LRU age;
- a checkpoint that a waiting request's prompt would restore (``PrefixVerbs.expect``,
  called by ``Scheduler.add`` through ``PrefixCaching.expect``) goes after every other
  evictable one, and is an ordinary LRU entry again once that request opens or leaves;
- the integrity check names a corrupt ``wanted`` entry.

Independent derivations: the dead pages are those no lookup of any cached chain
reaches (``alloc.prefix.match`` of each chain's tokens, as
``test_prefix_window_stateful.DeadPagesMachine`` derives them for windows); which
checkpoint survived is read back through ``match`` too.
"""

from __future__ import annotations

import numpy as np
import pytest
from allocator_fixtures import full_config

from unikv.allocator import PoolAllocator
from unikv.allocator.checkpoints import check_checkpoints
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, StatePart

PS = 4


def _alloc(pages: int, slots: int) -> PoolAllocator:
    state = MambaSpec(1, (StatePart((3,)),), StatePart((29,)))  # 128 B: two pages' bytes
    configs = [full_config(PS), SubPoolConfig("mamba", state)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages, "mamba": slots}))
    return PoolAllocator(pool, max_requests=8, max_context=64, debug=True)


def _cache(alloc: PoolAllocator, tokens: np.ndarray, at: int | None, pages: int) -> None:
    """A request over ``tokens`` caches its first ``pages`` whole pages, checkpoints its
    state at ``at`` tokens (None: none) and finishes."""
    slot = alloc.new_request()
    assert alloc.alloc_mamba(np.array([slot])) is not None
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([len(tokens)]))
    alloc.prefix.insert(slot, tokens[: pages * PS])
    if at is not None:
        assert alloc.prefix.checkpoint(slot, tokens[:at])
    alloc.free_request(slot)


def _reach(alloc: PoolAllocator) -> dict[int, int]:
    """Cached page -> the tokens a lookup of its chain (plus one token) hits."""
    prefix, out = alloc.parts.prefix, {}
    for page, node in prefix.by_page.items():
        blocks, walk = [], node
        while walk is not None:
            blocks.append(np.frombuffer(walk.tokens, np.int64))
            walk = prefix.by_id.get(walk.parent_id) if walk.parent_id else None
        chain = np.concatenate([*reversed(blocks), [0]])
        hit = alloc.prefix.match(chain)
        alloc.prefix.uncount(hit)
        out[page] = (hit.num_tokens, set(hit.nodes.tolist()))
    return out


def test_pages_below_no_checkpoint_go_first_whatever_their_age():
    alloc = _alloc(pages=16, slots=6)
    prefix = alloc.parts.prefix
    z, x, y = np.arange(9) + 100, np.arange(13) + 200, np.arange(9) + 300
    _cache(alloc, z, at=8, pages=2)  # the oldest: both pages end at its checkpoint
    _cache(alloc, x, at=4, pages=3)  # pages 1-2 lie past its checkpoint
    _cache(alloc, y, at=None, pages=2)  # no checkpoint at all
    before = _reach(alloc)
    reached = set().union(*(nodes for _, nodes in before.values()))
    dead = [p for p in prefix.lru if prefix.by_page[p].node_id not in reached]
    assert len(dead) == 4 and next(iter(prefix.lru)) not in dead  # LRU order would differ
    alloc.parts.writer.write(prefix.evict(len(dead)))
    assert set(before) - set(prefix.by_page) == set(dead), "the dead pages, and only they, went"
    after = _reach(alloc)
    assert all(after[p][0] == before[p][0] for p in after), "no hit lost"
    assert alloc.prefix.match(z).num_tokens == 8 and alloc.prefix.match(x).num_tokens == 4
    alloc.check_integrity()


def _two_checkpoints(alloc: PoolAllocator) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.arange(9) + 100, np.arange(9) + 200
    _cache(alloc, a, at=8, pages=2)  # the older
    _cache(alloc, b, at=8, pages=2)
    return a, b


def _need_a_slot(alloc: PoolAllocator) -> None:
    """Requests take state slots until one had to evict a checkpoint."""
    states = alloc.parts.prefix.states
    while not states.evicted:
        assert alloc.alloc_mamba(np.array([alloc.new_request()])) is not None


@pytest.mark.parametrize("expect", [True, False])
def test_a_waiting_requests_checkpoint_goes_last(expect):
    alloc = _alloc(pages=8, slots=4)
    states = alloc.parts.prefix.states
    a, b = _two_checkpoints(alloc)
    node = alloc.prefix.expect(np.concatenate([a, [7, 7]])) if expect else 0
    assert bool(node) == expect and (node in states.wanted) == expect
    alloc.check_integrity()
    _need_a_slot(alloc)
    assert states.evicted == 1
    kept, gone = (a, b) if expect else (b, a)  # control: the LRU's oldest goes
    assert alloc.prefix.match(kept).num_tokens == 8
    assert alloc.prefix.match(gone).num_tokens == 0
    alloc.prefix.unexpect(node)
    assert not states.wanted
    alloc.check_integrity()


def test_expecting_a_miss_marks_nothing_and_a_dropped_one_is_forgotten():
    alloc = _alloc(pages=8, slots=4)
    states = alloc.parts.prefix.states
    a, _ = _two_checkpoints(alloc)
    assert alloc.prefix.expect(np.arange(9) + 900) == 0 and not states.wanted
    node = alloc.prefix.expect(a)
    alloc.parts.writer.write(alloc.parts.prefix.evict(alloc.parts.prefix.num_evictable))
    assert not states.by_node and not states.wanted, "its node went: so did the mark"
    alloc.prefix.unexpect(node)  # the request opens later: nothing left to undo
    assert not states.wanted
    alloc.check_integrity()


@pytest.mark.parametrize("how", ["gone", "zero"])
def test_a_corrupt_wanted_entry_is_named(how):
    alloc = _alloc(pages=8, slots=4)
    states = alloc.parts.prefix.states
    a, _ = _two_checkpoints(alloc)
    node = alloc.prefix.expect(a)
    check_checkpoints(alloc.parts)
    if how == "gone":
        states.wanted[10**6] = 1
    else:
        states.wanted[node] = 0
    with pytest.raises(AssertionError, match="checkpoints waiting requests expect to hit exist"):
        check_checkpoints(alloc.parts)
