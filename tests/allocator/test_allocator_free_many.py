"""``free_request`` of many requests at once (issue 43, the step's finish path): the
requests finishing in one step give back their pages, state slots (with their
per-draft-position ones) and window bindings in one table write and one debug-mode
``check_integrity``.

The oracle is a second allocator driven through the same verbs that frees the same
requests one by one, in the same order: every host table, free stack (in pop
order), prefix-cache reference count and LRU, checkpoint pin and device table must
be equal byte for byte, before and after the fenced pages come back
(``compact``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import CHAINS, FakeEvent, full_config

from unikv.allocator import PoolAllocator
from unikv.backing import EmulatedBacking
from unikv.pool import UnifiedPool, pool_bytes_for

K = 2  # per-draft-position state slots per request
PAGES = {"full": 40, "swa": 24, "mamba": 24}


def _busy(in_flight: bool = True) -> tuple[PoolAllocator, list[int], FakeEvent]:
    """A debug allocator (full + sliding window + Mamba, page size 4, K draft slots)
    with five open requests: two sharing a cached prompt (one restoring its
    checkpoint, one still pinning it), one that cached its own prompt, one whose
    window pages left the window, one bare; a forward in flight (``in_flight``: else
    the pages freed go straight onto the free stacks). Deterministic."""
    configs = CHAINS["full+swa+mamba"](4)
    pool = UnifiedPool(configs, pool_bytes_for(configs, PAGES), state_slots=1 + K)
    alloc = PoolAllocator(pool, max_requests=8, max_context=40, debug=True)

    def opened(tokens: int, hit=None, state: bool = True) -> int:
        slot = alloc.new_request(prefix=hit)
        held = hit.num_tokens if hit is not None else 0
        alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([tokens - held]))
        if state:
            alloc.alloc_mamba(np.array([slot]))
        return slot

    prompt = np.arange(16)
    r0 = opened(18)
    assert alloc.prefix.insert(r0, prompt) == 4
    assert alloc.prefix.checkpoint(r0, prompt)
    r1 = opened(21, alloc.prefix.reload(alloc.prefix.match(np.arange(21))))  # restores it
    r2 = opened(19, alloc.prefix.reload(alloc.prefix.match(np.arange(19))), state=False)
    r3 = opened(13)
    alloc.prefix.insert(r3, np.arange(100, 112))
    r4 = opened(33)
    alloc.free_out_of_window(np.array([r4]), np.array([33]))
    event = FakeEvent()
    if in_flight:
        alloc.mark_in_flight(event)
    counters = alloc.prefix.counters()
    assert counters["hit_tokens"] == 32 and counters["checkpoints"] == 1, counters
    return alloc, [r3, r0, r4, r2, r1], event


def allocator_state(alloc: PoolAllocator) -> dict[str, object]:
    """Every piece of allocator state the frees touch, as host values."""
    p = alloc.parts
    req, cache, states = p.requests, p.prefix, p.prefix.states
    out: dict[str, object] = {
        "in_use": req.in_use.copy(),
        "lens": req.lens.copy(),
        "pages": req.pages.copy(),
        "free slots (pop order)": list(req._free_slots),
        "req_to_token": req.req_to_token.cpu().numpy().copy(),
        "vspace owner": p.vspace.owner.copy(),
        "vspace free (pop order)": p.vspace.free_ids().copy(),
        "cache refs": cache.refs.copy(),
        "cache lru": list(cache.lru),
        "cache pages": sorted(cache.by_page),
        "cache tails": dict(cache.tails),
    }
    if states is not None:
        out |= {
            "ckpt by node": dict(states.by_node),
            "ckpt lru": list(states.lru),
            "ckpt pending": dict(states.pending),
            "ckpt pins": dict(states.pins),
        }
    for name, lo in req.window_lo.items():
        out[f"window_lo {name}"] = lo.copy()
        out[f"wrefs {name}"], out[f"wtime {name}"] = cache.wrefs[name].copy(), cache.wtime[name]
    for name, book in p.books.items():
        out |= {
            f"{name} v2p host": book.v2p_host.copy(),
            f"{name} p2v host": book.p2v_host.copy(),
            f"{name} v2p device": book.v2p.cpu().numpy().copy(),
            f"{name} p2v device": book.p2v.cpu().numpy().copy(),
            f"{name} page states": book.state.copy(),
            f"{name} free stack (pop order)": book.free_ids().copy(),
            f"{name} counts": (book.lo, book.hi, book.num_live, book.num_pending),
        }
    return out


def assert_same_state(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for key, x in a.items():
        y = b[key]
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f"{key}: {x} != {y}"
        else:
            assert x == y, f"{key}: {x} != {y}"


class _Spy:
    """Counts the calls of a bound method it replaces on the instance."""

    def __init__(self, obj: object, name: str) -> None:
        self.calls, self._inner = 0, getattr(obj, name)
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._inner(*args, **kwargs)


@pytest.mark.parametrize("in_flight", [True, False])
def test_five_requests_free_in_one_write_as_five_single_frees(in_flight):
    one_by_one, order, event_a = _busy(in_flight)
    together, order_b, event_b = _busy(in_flight)
    assert order == order_b
    assert_same_state(allocator_state(one_by_one), allocator_state(together))  # the same start

    writes = _Spy(one_by_one.parts.writer, "write")
    for slot in order:
        one_by_one.free_request(slot)
    assert writes.calls == len(order)  # today's one write per request

    writes, checks = _Spy(together.parts.writer, "write"), _Spy(together, "check_integrity")
    together.free_request(np.array(order))
    assert writes.calls == 1, f"{writes.calls} table writes for {len(order)} finishing requests"
    assert checks.calls == 1
    after = allocator_state(together)
    assert_same_state(allocator_state(one_by_one), after)
    assert not after["in_use"].any()
    assert (after["mamba counts"][3] > 0) == in_flight  # fenced: not free yet

    for alloc, event in ((one_by_one, event_a), (together, event_b)):
        event.synchronize()
        alloc.compact()  # the fenced pages come back, bands packed
        alloc.check_integrity()
    assert_same_state(allocator_state(one_by_one), allocator_state(together))
    # the freed slots are handed out again in the same order
    assert [one_by_one.new_request() for _ in range(3)] == [
        together.new_request() for _ in range(3)
    ]


@pytest.mark.parametrize(
    "slots, match",
    [
        (lambda order: np.array([order[0], order[0]]), "distinct"),
        (lambda order: np.array([order[0], 7]), "not open"),
        (lambda order: np.array([order[0], 9]), r"\[0, 8\)"),
        (lambda order: np.array([[order[0]]]), "1-D"),
        (lambda order: np.array([0.0]), "1-D"),
        (lambda order: 1.5, "int slot or a 1-D"),
    ],
)
def test_bad_slots_change_nothing(slots, match):
    alloc, order, _ = _busy()
    before = allocator_state(alloc)
    with pytest.raises(ValueError, match=match):
        alloc.free_request(slots(order))
    assert_same_state(before, allocator_state(alloc))


def test_deferred_free_then_a_shrink_writes_on_the_old_grid():
    """``free_request(defer=True)`` (a preemption's) leaves its tombstones for the next
    table write; a resize between them writes them first, on the grid they index:
    the freed pages above the new top are cut, and the next write and the integrity
    check still see tables that equal the host mirrors."""
    configs = [full_config(4)]
    base = pool_bytes_for(configs, {"full": 8})
    pool = UnifiedPool(configs, base, max_bytes=3 * base, backing=EmulatedBacking(256))
    alloc = PoolAllocator(pool, max_requests=4, max_context=40)
    alloc.resize(3 * base)
    slot = alloc.new_request()  # ten pages: some above the base grid
    alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([40]))
    assert int(alloc.request_pages(slot)["full"][1].max()) >= 8
    writes = alloc.parts.writer.writes
    alloc.free_request(slot, defer=True)
    assert alloc.parts.writer.writes == writes  # its tombstones wait
    assert alloc.resize(base) == 0  # nothing moves: the freed pages are cut
    again = alloc.new_request()
    assert alloc.alloc_extend(np.array([again]), np.array([0]), np.array([8])) is not None
    alloc.check_integrity()
    book = alloc.parts.books["full"]
    assert torch.equal(book.v2p.cpu(), torch.from_numpy(book.v2p_host))
    assert torch.equal(book.p2v.cpu(), torch.from_numpy(book.p2v_host))
