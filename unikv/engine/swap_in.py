"""Readmission of a swapped-out request (``io/swap.py``): the scheduler's swap-in.

A preempted request whose pages went to host slots (``SwapSpace.swap_out``) is
readmitted like a recompute would be (the capacity oracle asked for every page
its sequence needs), then pages are reserved for its computed tokens a chunk at
a time, a window's pages freed behind each as its prefill left them
(``reserve_computed``), its recurrent-state slot allocated, and the host copy
written back (``SwapSpace.swap_in``); it resumes where it stopped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from unikv.engine.request import Request
    from unikv.engine.scheduler import Scheduler


def swap_in(sched: Scheduler, r: Request, budget: int):
    """Readmit swapped-out ``r``: ``(n, virtual ids of its next n tokens)``, its
    pages and state back from the host; ``(0, None)`` (its host copy kept; the
    caller frees the slot) when the pool has no room."""
    record = sched.swap.held[r.request_id]
    r.slot = sched.alloc.new_request()
    r.num_cached = record.num_cached
    sched.prefix.points.pop(r.slot, None)  # a former occupant's, if it stopped early
    if record.state_at:
        sched.prefix.points[r.slot] = list(record.state_at)
    n = sched.prefix.chunk(r, budget)
    ok = sched.fits(r.seq_len, max(n, sched.max_num_batched_tokens))
    ok = ok and reserve_computed(sched, r) and sched.admit_state(r)
    ids = sched.extend(r, n) if ok else None
    if ids is None:
        sched.prefix.points.pop(r.slot, None)
        return 0, None
    sched.swap.swap_in(r.request_id, r.slot)
    return n, ids


def reserve_computed(sched: Scheduler, r: Request) -> bool:
    """Pages for ``r``'s first ``num_cached`` tokens, a chunk at a time, a
    window's pages freed behind each (as its prefill left them); False when the
    chain cannot hold a chunk (the caller frees the slot)."""
    step = sched.max_num_batched_tokens if sched.has_window else r.num_cached
    slot = np.array([r.slot], dtype=np.int64)
    for start in range(0, r.num_cached, step):
        n = min(step, r.num_cached - start)
        if sched.alloc.alloc_extend(slot, np.array([start]), np.array([n])) is None:
            return False
        if sched.has_window:
            sched.alloc.free_out_of_window(slot, np.array([start + n]))
    return True
