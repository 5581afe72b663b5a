"""``Tokens.stage_grow`` skips ``Room.reserve`` when the free stacks already hold
the step's pages (``Room.covers``). Against a twin allocator that always takes
the reserve path: the same random decode/extend/free/fence sequence on a tight
pool gives the same results (None or not) and the same bytes of state after
every operation, and under pressure the reserve path still runs (band growth,
eviction, fence waits, a no)."""

from __future__ import annotations

import numpy as np
import pytest
from allocator_fixtures import FakeEvent, build, snapshot

from unikv.allocator.room import Room


class _Slow(Room):
    """The pre-fast-path behaviour: every grow goes through reserve."""

    def covers(self, books, count):
        return False


def _spy(alloc):
    calls = {"reserve": 0, "short": 0}
    reserve = alloc.parts.room.reserve

    def counted(*args, **kwargs):
        calls["reserve"] += 1
        ok = reserve(*args, **kwargs)
        calls["short"] += not ok
        return ok

    alloc.parts.room.reserve = counted
    return calls


def _op(alloc, rng_state, held, event):
    """One random verb on ``alloc``; returns a comparable outcome."""
    rng = np.random.default_rng(rng_state)
    choice = rng.integers(0, 10)
    reqs = alloc.parts.requests
    open_slots = np.flatnonzero(reqs.in_use)
    if choice == 0 or not len(open_slots):
        try:
            return ("new", alloc.new_request())
        except (ValueError, RuntimeError) as error:  # no free slot: both say so alike
            return ("new", type(error).__name__)
    if choice == 1:
        slot = int(rng.choice(open_slots))
        alloc.free_request(slot)
        return ("free", slot)
    if choice == 2:
        event.fired = bool(rng.integers(0, 2))
        alloc.mark_in_flight(None if event.fired else event)
        return ("fence", event.fired)
    slots = open_slots[rng.permutation(len(open_slots))][: rng.integers(1, len(open_slots) + 1)]
    lens = reqs.lens[slots].astype(np.int64)
    if (lens + 4 > reqs.max_context).any():
        alloc.free_request(int(slots[np.argmax(lens)]))
        return ("free-long",)
    if choice == 3 or (lens == 0).any():
        ext = rng.integers(1, 4, len(slots))
        ids = alloc.alloc_extend(slots, lens, ext)
        return ("extend", None if ids is None else ids.data.tolist())
    step = alloc.decode_step(slots, lens)
    return ("decode", None if step is None else step.virtual_ids.data.tolist())


@pytest.mark.parametrize("chain,ps", [("full+swa", 1), ("full+swa", 4), ("full+swa+mamba", 4)])
def test_fast_path_equals_reserve_path_under_pressure(chain, ps, monkeypatch):
    _, fast = build(chain, ps, requests=4, context=12 * ps)
    monkeypatch.setattr("unikv.allocator.parts.Room", _Slow)
    _, slow = build(chain, ps, requests=4, context=12 * ps)
    monkeypatch.undo()
    assert isinstance(slow.parts.room, _Slow) and not isinstance(fast.parts.room, _Slow)
    fast_calls, slow_calls = _spy(fast), _spy(slow)
    events = (FakeEvent(), FakeEvent())
    outcomes = 0
    for i in range(400):
        a = _op(fast, (ps, i), None, events[0])
        b = _op(slow, (ps, i), None, events[1])
        assert a == b, f"op {i}: fast path {a} vs reserve path {b}"
        assert snapshot(fast) == snapshot(slow), f"op {i} ({a[0]}): state differs"
        outcomes += a[0] in ("extend", "decode") and a[1] is None
    fast.check_integrity()
    # the pool is tight: some grows were refused, through reserve on both
    assert outcomes > 0 and fast_calls["short"] == slow_calls["short"] > 0
    # the fast path was taken (fewer reserves), and reserve still ran under pressure
    assert 0 < fast_calls["reserve"] < slow_calls["reserve"]
