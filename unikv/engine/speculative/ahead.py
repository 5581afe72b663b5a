"""A verify step planned ahead: step N + 1 enqueued before step N's acceptance is
on the host (``speculative_config["pipeline"]``, ``Speculator.pipeline``; n-gram
drafts, attention-only targets), valid whatever N accepts.

While verify step N runs, the host plans N + 1 for the worst case, full
acceptance: request b holds ``L_b + n_b + 1`` tokens (L_b its cached ones, n_b its
drafts in N) and feeds ``1 + m_b`` rows, allocated after N's (``alloc_extend``).
For every acceptance ``a = 0 .. n_b`` of N it proposes the drafts that acceptance
would lead to: the n-gram continuation of its history with ``a`` of N's drafts
appended (the lookup's first token stands for the unknown bonus; any tokens are
valid drafts), filled up to ``m_b``. The step is launched behind N; on the device
its rows move down to where N's acceptance puts them, its first token is N's
bonus and its drafts the candidate of N's acceptance (``derive.py``). When N's
tokens reach the host (``complete_verify`` with ``ahead``), the rows N + 1 did not
reach are trimmed with N's rejected ones and N + 1 is applied when its own tokens
are in: no step is thrown away for a partial acceptance. Only a request that N
finished (a stop token) or that ends between steps drops N + 1 (trimmed; its pages
stay fenced until it has run: ``mark_in_flight``).

A step is planned ahead where every running request is in N, has no stop token
among N's drafts and room for a draft after N's tokens at full acceptance (sampled
requests too: rejection sampling's output steps move with the acceptance); no
request waits; no draft model or head (their drafts are computed from the accepted
tokens by a forward). A recurrent target's step N + 1 starts from the state slot
N's acceptance selects, chosen on the device (``derive.select_states``), unless
prefix caching is on: its state checkpoints, queued when N's counts arrive, would
read the live slot N + 1 is rewriting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from unikv.engine.request import Batch
from unikv.engine.speculative.derive import Derivation
from unikv.engine.speculative.ngram import NgramIndex

if TYPE_CHECKING:
    from unikv.engine.scheduler import Scheduler


class _Ahead:
    """Request b as step N + 1's planner and ``verify_step`` read it: its slot, the
    tokens it will hold at N's full acceptance (``num_cached``), the placeholders it
    feeds (N's bonus for it, then its drafts: ``Derivation.placeholders``), its
    sampling parameters and seed, and ``output_ids`` as long as its outputs at N's
    full acceptance (only their count is read: the acceptance's output steps, moved
    on the device by ``Derivation.delta``)."""

    def __init__(self, r, start: int, pending: int, drafts: np.ndarray, outputs: int) -> None:
        self.slot, self.num_cached, self.params, self.seed = r.slot, start, r.params, r.seed
        self.tokens = [pending] + drafts.tolist()
        self.output_ids = range(outputs)

    def token_slice(self, start: int, stop: int) -> list[int]:
        return self.tokens[start - self.num_cached : stop - self.num_cached]


def _candidates(index: NgramIndex, drafts: np.ndarray, room: int) -> np.ndarray:
    """(n + 1, room) int64: row a, the drafts after N accepts ``a`` of ``drafts``
    (n-gram lookup past the unknown bonus, filled by repeating its last token), from
    the request's index (``NgramIndex.propose_ends``: no scan of its history)."""
    extra = drafts.tolist()
    history = index.tokens  # the request's tokens (prompt, outputs), drafts excluded
    out = np.empty((len(extra) + 1, room), np.int64)
    for a, found in enumerate(index.propose_ends(extra, room + 1)):
        guess = found[1:]
        out[a, : len(guess)] = guess
        last = extra[a - 1] if a else history[-1]  # the last token before the bonus
        out[a, len(guess) :] = guess[-1] if guess else (found[0] if found else last)
    return out


def verify_ahead(sched: Scheduler, batch: Batch) -> tuple[Batch, Batch] | None:
    """(the batch the step planner reads, the batch ``complete_verify`` applies) of
    the verify step after ``batch`` (verify step N, in flight), or None (module
    docstring: when it is not planned ahead; nothing changed then)."""
    spec = sched.spec
    reqs = batch.requests
    if (
        not spec.pipeline
        or spec.draft is not None
        or (sched.has_state and sched.prefix.enabled)  # (its checkpoints read N's state)
        or sched.waiting
        or len(reqs) != len(sched.running)
    ):
        return None
    spare, rooms = spec.max_tokens - len(reqs), []
    for r, d in zip(reqs, batch.drafts):
        room = min(spec.k, r.max_new_tokens - len(r.output_ids) - len(d) - 2, spare)
        if room <= 0 or not r.stop_ids.isdisjoint(d.tolist()):
            return None  # N may end it
        rooms.append(int(room))
        spare -= room
    candidates = [
        _candidates(spec.index_of(r), d, room) for r, d, room in zip(reqs, batch.drafts, rooms)
    ]
    counts = np.fromiter((len(d) for d in batch.drafts), np.int64, len(reqs))
    slots = np.fromiter((r.slot for r in reqs), np.int64, len(reqs))
    starts = np.fromiter((r.num_cached for r in reqs), np.int64, len(reqs)) + counts + 1
    num_new = [1 + c.shape[1] for c in candidates]
    ids = sched.alloc.alloc_extend(slots, starts, np.asarray(num_new, np.int64))
    if ids is None:
        return None
    derive = Derivation(counts, candidates)
    rows, marks = [], []
    for b, (r, s) in enumerate(zip(reqs, starts.tolist())):
        pending, drafts = derive.placeholders(b)
        rows.append(_Ahead(r, s, pending, drafts, len(r.output_ids) + len(batch.drafts[b]) + 1))
        marks.append(drafts)
    planned = Batch(rows, list(num_new), [ids.data], derive=derive)
    applied = Batch(list(reqs), list(num_new), [ids.data], derive=derive)
    planned.drafts = marks  # placeholders into the derived sources (``verify_step``)
    applied.drafts = [c[-1] for c in candidates]  # ``complete_verify`` of N sets the true
    return planned, applied
