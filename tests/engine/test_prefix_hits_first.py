"""Hits first (issue 41): with prefix caching, a waiting request whose prompt hit the
cache when it was added is admitted ahead of the misses queued before it, when it
fits. Its prefill is cheap, and while it waits the misses' prefill may evict the
pages (and, on a hybrid, the state checkpoint) its hit needs.

The engine's own ``Scheduler`` over a ``PoolAllocator`` on a CPU pool, no model: each
step's "sample" is the next token of a planned output, fed to ``Scheduler.complete``
as the engine does. Conversation A's first turn runs and is cached; then a miss M
(new tokens) and A's next turn H (A's prompt and answer plus a message) are added, M
first. The pool holds A's cached pages beside one of M or H, not both: in arrival
order M's admission evicts A's pages and H recomputes them.

Independent derivation: the hit H should take is read from ``alloc.prefix.match``
(a walk of the cache) before either is admitted, and compared with the tokens H
found cached at its admission (``num_cached_tokens``) and with A's whole pages.
"""

from __future__ import annotations

import numpy as np
import pytest
from allocator_fixtures import full_config

from unikv.allocator import PoolAllocator
from unikv.engine.request import Request
from unikv.engine.sampling import SamplingParams
from unikv.engine.scheduler import Scheduler
from unikv.pool import UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, StatePart

PS, CONTEXT = 4, 32


def _scheduler(pages: int, state: bool = False, seats: int = 2) -> Scheduler:
    configs = [full_config(PS)]
    if state:  # a recurrent layer: a hit also needs the state checkpoint at its end
        spec = MambaSpec(1, (StatePart((3,)),), StatePart((5,)))  # 8 float32: half a page
        from unikv.pool import SubPoolConfig

        configs.append(SubPoolConfig("mamba", spec))
    budget = pool_bytes_for(configs[:1], {"full": pages - 1})
    if state:  # the live slots, and one checkpoint
        budget += (seats + 2) * configs[1].spec.page_bytes(1)
    pool = UnifiedPool(configs, budget)
    alloc = PoolAllocator(pool, max_requests=seats, max_context=CONTEXT, debug=True)
    return Scheduler(
        alloc, pool.subpools.values(), max_num_seqs=seats, max_num_batched_tokens=64,
        prefix_caching=True,
    )  # fmt: skip


def _request(rid: int, prompt: list[int], new: int = 1) -> Request:
    params = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)
    return Request(rid, list(prompt), params, 0, frozenset(), CONTEXT)


def _drain(sched: Scheduler, plans: dict[int, list[int]]) -> list[int]:
    """Steps until no work is left; returns the request ids in admission order."""
    order, seen = [], set()
    while sched.has_work():
        batch = sched.schedule()
        for r in batch.requests:
            if r.request_id not in seen:
                seen.add(r.request_id)
                order.append(r.request_id)
        tokens = [plans[r.request_id][len(r.output_ids)] for r in batch.requests]
        sched.complete(batch, tokens)
    return order


def _chat(hits_first: bool, state: bool = False) -> tuple[int, int, list[int]]:
    """(H's cached tokens at admission, the hit ``match`` read before, admission order)."""
    sched = _scheduler(pages=7, state=state)
    sched.prefix.hits_first = hits_first
    a = _request(0, list(range(100, 115)))  # 15 tokens: 3 whole pages cached
    sched.add(a)
    plans = {0: [115]}
    _drain(sched, plans)
    m = _request(1, list(range(200, 224)))  # a miss of 6 pages
    h = _request(2, a.prompt_ids + a.output_ids + list(range(300, 308)))  # 24 tokens
    plans.update({1: [224], 2: [308]})
    expected = sched.alloc.prefix.match(h.prompt_ids[:-1]).num_tokens
    sched.add(m)
    sched.add(h)
    order = _drain(sched, plans)
    assert m.output_ids == [224] and h.output_ids == [308]
    return h.num_cached_tokens, expected, order


@pytest.mark.parametrize("state", [False, True], ids=["attention", "hybrid"])
def test_hit_admitted_before_earlier_miss(state):
    cached, expected, order = _chat(hits_first=True, state=state)
    assert expected == 12, "A's three whole prompt pages are cached"
    assert order == [2, 1], "the hit H is admitted before the miss M queued ahead of it"
    assert cached == expected, "H takes the whole hit the cache held when it was added"


@pytest.mark.parametrize("state", [False, True], ids=["attention", "hybrid"])
def test_arrival_order_loses_the_hit(state):
    """The scenario is tight: in arrival order (``hits_first`` off, as before) M's
    admission evicts A's pages and H finds less cached (what the test above guards)."""
    cached, expected, order = _chat(hits_first=False, state=state)
    assert order == [1, 2]
    assert cached < expected


def test_jumped_head_goes_first():
    """No starvation: a head that ``max_num_seqs`` picks have jumped goes next."""
    sched = _scheduler(pages=9)
    prefix, waiting = sched.prefix, sched.waiting
    head, hit = _request(1, list(range(200, 224))), _request(2, list(range(300, 324)))
    waiting.extend([head, hit])
    prefix.hits.add(2)  # (as ``expect`` marks a prompt that hit)
    assert [prefix.pick(waiting, 2) for _ in range(3)] == [1, 1, 0]
    head.num_preemptions, prefix.jumped = 1, {}
    assert prefix.pick(waiting, 2) == 0, "a preempted head goes first"


def test_hits_first_keeps_outputs():
    """The order changes nothing but the order: every request's tokens are its plan
    and every page goes back (``debug`` checks the allocator after each verb)."""
    sched = _scheduler(pages=9)
    rng = np.random.default_rng(0)
    plans, requests = {}, []
    base = rng.integers(1000, 2000, 10).tolist()
    for i in range(6):
        prompt = base + rng.integers(3000, 4000, 3 + i).tolist() if i % 2 else base
        requests.append(_request(i, prompt, new=2))
        plans[i] = rng.integers(5000, 6000, 2).tolist()
        sched.add(requests[-1])
    _drain(sched, plans)
    assert [r.output_ids for r in requests] == [plans[i] for i in range(6)]
    assert not sched.prefix.hits and not sched.prefix.jumped
