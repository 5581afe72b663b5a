"""The requests finishing in one step leave in one table write (issue 43): the
scheduler shares each one's pages in the prefix cache, then frees them all with one
``free_request``. Both finish paths: ``complete`` (by length) and ``resolve`` (a stop
token, the overlapped loop). The requests a step preempts free theirs with the
step's own write (``free_request(defer=True)``). No model: the step's tokens are
given.

The oracle is the same step on a second scheduler that ends its requests the way
the engine did before, one by one (share, free, next): the allocator's state
afterwards (``allocator_state``: tables, free stacks in pop order, the prefix
cache's references and LRU) is equal byte for byte, and the pages shared are found
by a later lookup."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import full_config, mamba_config
from test_allocator_free_many import allocator_state, assert_same_state

from unikv.allocator import PoolAllocator
from unikv.engine.request import Request, Status
from unikv.engine.sampling import SamplingParams
from unikv.engine.scheduler import Scheduler
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

STOP = 7
SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]  # three pages of 4, shared by every prompt
TAILS = [[11], [12, 13, 14, 15, 16], [17, 18], [19] * 9, [20, 21, 22]]


def _swa() -> SubPoolConfig:
    spec = MHASpec(1, 1, 2, dtype=torch.float32, sliding_window=6)
    return SubPoolConfig("swa", spec, page_size=4)


CHAINS = {
    "full": lambda: [full_config(4)],
    "full+swa": lambda: [full_config(4), _swa()],
    "full+swa+mamba": lambda: [full_config(4), _swa(), mamba_config()],
}


def _scheduler(chain: str, one_by_one: bool) -> Scheduler:
    configs = CHAINS[chain]()
    pages = {c.name: 8 if c.spec.kind == "mamba" else 40 for c in configs}
    pool = UnifiedPool(configs, pool_bytes_for(configs, pages))
    alloc = PoolAllocator(pool, max_requests=6, max_context=32, debug=True)
    sched = Scheduler(
        alloc, pool.subpools.values(), max_num_seqs=6, max_num_batched_tokens=128,
        prefix_caching=True,
    )  # fmt: skip
    if one_by_one:  # the engine's finish path before: one free (one table write) each
        sched.release = lambda done: [_end_one(sched, r) for r in done]
    return sched


def _end_one(sched: Scheduler, r: Request) -> None:
    sched.share(r)
    sched.alloc.free_request(r.slot)
    sched.running.remove(r)
    r.slot, r.status = None, Status.FINISHED


def _prefill(sched: Scheduler, max_tokens: int):
    for i, tail in enumerate(TAILS):
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        sched.add(Request(i, SYSTEM + tail, params, 0, frozenset({STOP}), 32))
    batch = sched.schedule()
    # a hybrid's prefill chunks end at whole pages first (its checkpoints): the
    # steps before the one that completes every prompt sample nothing
    while not all(r.num_cached + n == r.seq_len for r, n in zip(batch.requests, batch.num_new)):
        assert sched.complete(batch, [0] * len(batch.requests)) == []
        batch = sched.schedule()
    assert len(batch.requests) == len(TAILS)  # every prompt completes in this step
    return batch


def _finish_step(chain: str, path: str, one_by_one: bool) -> tuple[int, Scheduler]:
    """(table writes of the step that finishes all five requests, the scheduler)."""
    sched = _scheduler(chain, one_by_one)
    if path == "complete":  # each request's one token: finished by length
        batch = _prefill(sched, max_tokens=1)
        before = sched.alloc.parts.writer.writes
        finished = sched.complete(batch, [STOP + 1] * len(TAILS))
    else:  # placeholders now, the stop token when the step's values come in
        batch = _prefill(sched, max_tokens=4)
        assert sched.complete_ahead(batch) == []
        before = sched.alloc.parts.writer.writes
        finished = sched.resolve(batch, [STOP] * len(TAILS))
    assert len(finished) == len(TAILS) and not sched.running
    assert all(r.status is Status.FINISHED and r.slot is None for r in finished)
    return sched.alloc.parts.writer.writes - before, sched


@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("path", ["complete", "resolve"])
def test_five_finishing_requests_make_one_table_write(chain, path):
    ref_writes, ref = _finish_step(chain, path, one_by_one=True)
    writes, sched = _finish_step(chain, path, one_by_one=False)
    assert ref_writes - writes == len(TAILS) - 1, (ref_writes, writes)
    if chain == "full+swa":  # no state checkpoints: the frees are the step's only write
        assert writes == 1
    assert_same_state(allocator_state(ref.alloc), allocator_state(sched.alloc))
    hit = sched.alloc.prefix.match(np.array(SYSTEM + TAILS[3] + [0]))
    assert hit.num_tokens == 20  # the system prompt and request 3's own next two pages


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_a_step_that_preempts_several_requests_makes_one_table_write(chain):
    """Six one-page prompts in a pool of six pages a sub-pool (the state slots share
    its bytes): the decode step that follows their prefill preempts the newest two
    or three (each retry is short of a page) and decodes the rest. Deferred, the three frees go out with the decode step's
    write; the state afterwards equals that of frees written at once, and nothing is
    left staged (``check_integrity`` writes nothing more)."""
    runs = {}
    for defer in (False, True):
        configs = CHAINS[chain]()
        pages = {c.name: 8 if c.spec.kind == "mamba" else 6 for c in configs}
        pool = UnifiedPool(configs, pool_bytes_for(configs, pages))
        alloc = PoolAllocator(pool, max_requests=6, max_context=32)  # (debug would settle)
        if not defer:  # the reference: each preemption's free written at once
            free = alloc.free_request
            alloc.free_request = lambda slots, defer=False, free=free: free(slots)
        sched = Scheduler(alloc, pool.subpools.values(), max_num_seqs=6, max_num_batched_tokens=64)
        for i in range(6):
            params = SamplingParams(max_tokens=8, temperature=0)
            sched.add(Request(i, list(range(10 * i, 10 * i + 4)), params, 0, frozenset(), 32))
        batch = sched.schedule()
        sched.complete(batch, [1] * len(batch.requests))
        writer, before = alloc.parts.writer, alloc.parts.writer.writes
        batch = sched.schedule()
        assert sched.num_preemptions >= 2 and len(batch.requests) == 6 - sched.num_preemptions
        runs[defer] = (writer.writes - before, alloc, sched.num_preemptions)
        alloc.check_integrity()  # (host syncs; settles what is staged first)
        assert writer.writes - before == runs[defer][0], "entries were left staged"
    assert runs[False][2] == runs[True][2]
    assert runs[False][0] == runs[False][2] + 1 and runs[True][0] == 1, (runs[False], runs[True])
    assert_same_state(allocator_state(runs[False][1]), allocator_state(runs[True][1]))


def _abort_one(sched: Scheduler, r: Request) -> None:
    """The abort path before ``finish_many``: one request at a time (a running one
    shares, frees and leaves; a waiting one leaves the queue)."""
    if r.status is Status.RUNNING:
        _end_one(sched, r)
    else:
        sched.prefix.forget(r)
        sched.waiting.remove(r)
        r.slot, r.status = None, Status.FINISHED
    r.finish_reason = "abort"


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_aborting_many_requests_frees_them_in_one_call(chain):
    """Five requests decoding and two waiting: three running ones and a waiting one
    are aborted together (``finish_many``, what the engine loop does with the aborts
    one step drains). One ``free_request``, one table write; the allocator's state
    equals, byte for byte, that of a second scheduler aborting the same requests one
    at a time in the same order; the rest run and wait as before."""
    runs = []
    for one_by_one in (True, False):
        sched = _scheduler(chain, one_by_one=False)
        batch = _prefill(sched, max_tokens=8)
        sched.complete(batch, [STOP + 1] * len(TAILS))  # all five decode now
        for i in (5, 6):
            params = SamplingParams(max_tokens=8, temperature=0)
            sched.add(Request(i, SYSTEM + [30 + i] * 3, params, 0, frozenset({STOP}), 32))
        by_id = {r.request_id: r for r in [*sched.running, *sched.waiting]}
        doomed = [by_id[i] for i in (3, 6, 0, 4)]
        frees: list[int] = []

        def counted(slots, defer=False, frees=frees, free=sched.alloc.free_request):
            frees.append(1)
            free(slots, defer)

        sched.alloc.free_request = counted
        writes = sched.alloc.parts.writer.writes
        if one_by_one:
            for r in doomed:
                _abort_one(sched, r)
        else:
            sched.finish_many(doomed, "abort")
        writes = sched.alloc.parts.writer.writes - writes
        assert all(r.status is Status.FINISHED and r.slot is None for r in doomed)
        assert all(r.finish_reason == "abort" for r in doomed)
        queues = ([r.request_id for r in sched.running], [r.request_id for r in sched.waiting])
        assert queues == ([1, 2], [5])
        runs.append((len(frees), writes, allocator_state(sched.alloc)))
    (ref_frees, ref_writes, ref_state), (frees, writes, state) = runs
    assert (ref_frees, frees) == (3, 1)
    assert ref_writes - writes == 2, (ref_writes, writes)
    assert_same_state(ref_state, state)
