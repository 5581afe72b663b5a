"""A verify step planned ahead: step N + 1 enqueued before step N's acceptance is
on the host (``speculative_config["pipeline"]``, ``Speculator.pipeline``; n-gram
drafts, attention-only targets).

While verify step N runs, the host plans N + 1 as if N accepts every draft of
every request: request b then holds ``L_b + n_b + 1`` tokens (L_b its cached ones,
n_b its drafts in N), its pending token is N's last emitted token for it (on the
device: ``Launched.tokens_dev``, a placeholder ``Pending.of(b)`` here), and its
drafts are the n-gram continuation of its history with N's drafts appended (the
lookup's first token stands for the unknown bonus; any tokens are valid drafts).
The rows are allocated after N's (``alloc_extend``) and the step is launched
behind N on the device. When N's tokens reach the host (``complete_verify`` with
``ahead``) and every request accepted all its drafts and none finished, N + 1 is
the true next step: its rows stay and it is applied when its own tokens are in;
else its rows are trimmed with N's rejected ones and its results are dropped (the
pages stay fenced until it has run: ``mark_in_flight``). Greedy outputs are the
same either way; a rejection costs the wasted step.

A step is planned ahead only where the bet is likely and cheap to lose: every
running request is in N, greedy (or forced acceptance), accepted all its drafts in
its last verify step, has no stop token among N's drafts and room for a draft
after N's tokens; no request waits; no draft model or head (their drafts depend on
the acceptance) and no recurrent state (N + 1 would write the per-draft-position
slots N's rollback selects from).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from unikv.engine.request import Batch, Pending
from unikv.engine.speculative.engine import _padded
from unikv.engine.speculative.ngram import propose_ngram

if TYPE_CHECKING:
    from unikv.engine.scheduler import Scheduler


class _Ahead:
    """Request b as step N + 1's planner reads it: its slot, the tokens it will hold
    (``num_cached``) and the ones it feeds (N's last token for it, then its drafts)."""

    def __init__(self, r, lane: int, start: int, drafts: np.ndarray) -> None:
        self.slot, self.num_cached, self.params = r.slot, start, r.params
        self.tokens = [Pending.of(lane)] + drafts.tolist()

    def token_slice(self, start: int, stop: int) -> list[int]:
        return self.tokens[start - self.num_cached : stop - self.num_cached]


def verify_ahead(sched: Scheduler, batch: Batch) -> tuple[Batch, Batch] | None:
    """(the batch the step planner reads, the batch ``complete_verify`` applies) of
    the verify step after ``batch`` (verify step N, in flight), or None (module
    docstring: when it is not planned ahead; nothing changed then)."""
    spec = sched.spec
    reqs, cfg = batch.requests, spec.config
    if (
        not spec.pipeline
        or spec.draft is not None
        or sched.has_state
        or sched.waiting
        or len(reqs) != len(sched.running)
        or not all(r.request_id in spec.accepted_all for r in reqs)
        or not (cfg.force_accept or all(r.params.temperature == 0 for r in reqs))
    ):
        return None
    spare, rooms, guesses = spec.max_tokens - len(reqs), [], []
    for r, d in zip(reqs, batch.drafts):
        room = min(spec.k, r.max_new_tokens - len(r.output_ids) - len(d) - 2, spare)
        if room <= 0 or not r.stop_ids.isdisjoint(d.tolist()):
            return None  # N may end it
        history = np.asarray(r.prompt_ids + r.output_ids + d.tolist(), np.int64)
        guess = propose_ngram(history, room + 1, cfg.prompt_lookup_min, cfg.prompt_lookup_max)[1:]
        guesses.append(_padded(guess, room, r) if cfg.force_accept else guess)
        rooms.append(room)
        spare -= len(guesses[-1])
    if spec.pad_drafts and all(room == spec.k for room in rooms):  # a verify graph's shape
        guesses = [_padded(g, spec.k, r) for g, r in zip(guesses, reqs)]
    if not any(len(g) for g in guesses):
        return None
    slots = np.fromiter((r.slot for r in reqs), np.int64, len(reqs))
    starts = np.fromiter((r.num_cached + len(d) + 1 for r, d in zip(reqs, batch.drafts)), np.int64)
    num_new = [1 + len(g) for g in guesses]
    ids = sched.alloc.alloc_extend(slots, starts, np.asarray(num_new, np.int64))
    if ids is None:
        return None
    rows = [_Ahead(r, b, int(s), g) for b, (r, s, g) in enumerate(zip(reqs, starts, guesses))]
    planned, applied = Batch(rows, list(num_new), [ids.data]), Batch(list(reqs), list(num_new))
    planned.drafts = applied.drafts = guesses
    return planned, applied
