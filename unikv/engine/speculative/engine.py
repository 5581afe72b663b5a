"""The scheduler's speculation hook: who speculates in a step, their drafts, the
verify batch's pages, and the rollback of what was rejected.

A step speculates when it is a pure decode step (no prefill chunk to schedule),
with at most ``disable_by_batch_size`` decoding requests, each of which samples
without a per-token rule the drafts would bypass (penalties, logprobs, structured
outputs, a min-tokens mask) and has its tokens on the host (``settled``), and some
request has a draft. Past the batch-size rule nothing of this runs on the host but
the count: the step is the plain engine's (its graphs, one step in flight:
``Scheduler.may_speculate``). Under the rule, n-gram lookups are kept per request
(``NgramIndex``) and asked before the step in flight is settled
(``Speculator.may_find``): where no pending token could give a draft, the step is
the plain engine's too, entering this package only through the lookup. A verify
step's request feeds ``1 + k_i`` rows (its pending token and its drafts), allocated with ``alloc_extend``
like a prefill chunk, held to the end of their last page (``headroom.VerifyRows``:
the next steps extend only where a page ends). After the step
(``Scheduler.complete_verify``) the accepted rows stay, the rest are trimmed by
``alloc.truncate`` (pages emptied are freed, a window's ``window_lo`` restored)
before any out-of-window free runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from unikv.engine.speculative.config import SpeculativeConfig
from unikv.engine.speculative.ngram import NgramIndex

if TYPE_CHECKING:
    from unikv.engine.request import Request


@dataclass
class SpecCounters:
    """Speculation counters since start-up (``llm.stats`` reports a call's deltas)."""

    verify_steps: int = 0  # steps that verified drafts
    verify_requests: int = 0  # (request, verify step) pairs
    draft_tokens: int = 0  # drafts scored
    accepted_tokens: int = 0  # drafts accepted
    emitted_tokens: int = 0  # tokens the verify steps emitted (accepted + bonus)
    draft_seconds: float = 0.0  # host time spent proposing
    skipped_by_batch_size: int = 0  # steps the batch-size rule kept from speculating
    ahead_steps: int = 0  # verify steps planned ahead of the step in flight (pipeline)
    ahead_dropped: int = 0  # of those, thrown away (their request finished or ended)
    head_hole_rows: int = 0  # a lazy head's rows left as holes, zeroed (``holes.py``)
    head_hole_hits: int = 0  # admissions whose prefix hit holds such rows

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def spec_eligible(r: Request) -> bool:
    """Whether ``r``'s next samples may come from verification: no rule that reads
    each sampled token before the next (penalties, logprobs, structured outputs,
    the min-tokens mask) applies; temperature, top-k, top-p and min-p are kept by
    rejection sampling."""
    p = r.params
    return (
        not p.has_penalties
        and p.logprobs is None
        and p.structured is None
        and len(r.output_ids) >= p.min_tokens
    )


def settled(r: Request) -> bool:
    """Whether ``r``'s tokens are all on the host: no placeholder of a step still in
    flight (``Pending``) ends its outputs. Drafts read them: a step that a loop plans
    while the last one runs (the batch-size rule's steps) stays plain, whatever the
    batch holds by then."""
    return not r.output_ids or r.output_ids[-1] >= 0


class Speculator:
    """Drafts for a step's decoding requests (``drafts``) and the counters."""

    def __init__(self, config: SpeculativeConfig, max_num_batched_tokens: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_tokens = max_num_batched_tokens
        self.counters = SpecCounters()
        self.draft = None  # method "draft_model": its ``draft.DraftModel`` (LLM sets it)
        self.pad_drafts = False  # verify graphs: every request k drafts where it has room
        # plan the next verify step before this one's tokens are in (``ahead.py``)
        self.pipeline = config.pipeline
        self.indexes: dict[int, NgramIndex] = {}  # n-gram lookups kept per running request
        self._found = None  # (requests, their n-gram drafts) of the last ``lookup``

    def within_rule(self, batch: int) -> bool:
        """The batch-size rule: a step of ``batch`` decoding requests may speculate
        (at most ``disable_by_batch_size``; vLLM's rule)."""
        return batch <= self.config.disable_by_batch_size

    def may_find(self, requests: list[Request]) -> bool:
        """Whether the next step may verify drafts, before the step in flight is
        settled (the loop settles it first only then; else the step is the plain
        engine's, planned while the last one runs): a draft model or forced drafts
        always may; n-gram drafts where every request decodes (none prefilling) and
        samples without a per-token rule, and some request's lookup can find a draft
        whatever its pending token is (``NgramIndex.may_match_next``)."""
        if self.draft is not None or self.config.force_accept:
            return True
        if not requests or not all(
            spec_eligible(r) and r.num_cached + 1 == r.seq_len for r in requests
        ):
            return False  # (a request still prefilling: the step is not a pure decode)
        start = time.perf_counter()
        try:
            for r in requests:
                index = self.index_of(r)
                if index is None or (index.found() if settled(r) else index.may_match_next()):
                    return True
            return False
        finally:
            self.counters.draft_seconds += time.perf_counter() - start

    def lookup(self, decoding: list[Request]) -> bool:
        """Whether this step verifies drafts: its requests may (``spec_eligible``,
        ``settled``) and (n-gram) some request's prompt lookup found a draft, kept for
        ``drafts``. False: the step is the plain engine's decode step."""
        self._found = None
        if not all(spec_eligible(r) and settled(r) for r in decoding):
            return False
        if self.draft is not None:
            return True  # its proposals come from a forward (``drafts``)
        start = time.perf_counter()
        rooms = self._rooms(decoding)
        out = [
            self._propose(r, int(room)) if room > 0 else _EMPTY for r, room in zip(decoding, rooms)
        ]
        self.counters.draft_seconds += time.perf_counter() - start
        if not any(len(d) for d in out):
            return False
        self._found = (decoding, rooms, out)
        return True

    def drafts(self, decoding: list[Request], allocate):
        """(per decoding request its draft tokens ((k_i,) int64, maybe empty), the
        verify rows' virtual ids from ``allocate(num_new)`` ((B,) int64 host array:
        ``1 + k_i``; None when the pool cannot hold them), None or the drafts on the
        device ((sum k_i,) int64, request-major: a draft model's; the host arrays are
        then placeholders ``-(1 + i)`` of index i there, read by the step planner)),
        or None when the step does not speculate. Drafts stop before the request's last allowed token (the bonus
        may be it) and fit the step's token budget. The n-gram lookups of ``lookup``
        on the same requests are reused."""
        if not self.within_rule(len(decoding)):
            self.counters.skipped_by_batch_size += 1
            return None
        found = self._found
        self._found = None
        if found is None or found[0] is not decoding:
            if not self.lookup(decoding):
                return None
            found, self._found = self._found, None
        start = time.perf_counter()
        try:
            return self._drafts(decoding, allocate, found)
        finally:
            self.counters.draft_seconds += time.perf_counter() - start

    def _rooms(self, decoding: list[Request]) -> np.ndarray:
        """Each request's draft room: k, less where its token limit or the step's
        budget is near (every request feeds its pending token)."""
        spare = self.max_tokens - len(decoding)
        rooms = np.zeros(len(decoding), np.int64)
        for i, r in enumerate(decoding):
            rooms[i] = max(min(self.k, r.max_new_tokens - len(r.output_ids) - 1, spare), 0)
            spare -= rooms[i]
        return rooms

    def _drafts(self, decoding: list[Request], allocate, found):
        _, rooms, out = found if found is not None else (None, self._rooms(decoding), None)
        if self.draft is not None:  # a draft model: its rows are allocated first
            limit = getattr(self.draft, "limit", None)  # MTP: requests with a first draft
            rooms = rooms if limit is None else limit(decoding, rooms)
            if not rooms.any():
                return None
            ids = allocate(1 + rooms)
            if ids is None:
                return None
            starts = np.cumsum(rooms) - rooms  # each request's first index in the flat drafts
            marks = [-(1 + np.arange(s, s + n, dtype=np.int64)) for s, n in zip(starts, rooms)]
            return marks, ids, self.draft.propose(decoding, rooms, ids.data)
        if self.pad_drafts and (rooms == self.k).all():  # a verify graph's shape: k each
            out = [_padded(d, self.k, r) for d, r in zip(out, decoding)]
        ids = allocate(1 + np.fromiter((len(d) for d in out), np.int64, len(out)))
        return None if ids is None else (out, ids, None)

    def index_of(self, r: Request) -> NgramIndex | None:
        """``r``'s n-gram index, caught up with its known tokens (None: none yet)."""
        index = self.indexes.get(r.request_id)
        num_prompt = len(r.prompt_ids)
        known = num_prompt + len(r.output_ids) - (not settled(r))
        if index is None or not _follows(index.tokens, r, known):  # (its outputs were cut)
            cfg = self.config
            index = self.indexes[r.request_id] = NgramIndex(
                cfg.prompt_lookup_min, cfg.prompt_lookup_max
            )
        seen = len(index.tokens)
        if seen < known:
            new = list(r.prompt_ids[seen:]) if seen < num_prompt else []
            new += r.output_ids[max(seen - num_prompt, 0) : known - num_prompt]
            index.extend(new)
        return index if index.tokens else None

    def _propose(self, r: Request, room: int) -> np.ndarray:
        index = self.index_of(r)
        draft = np.asarray(index.propose(room) if index is not None else [], np.int64)
        return _padded(draft, room, r) if self.config.force_accept else draft  # benchmarks: k

    def release(self, r: Request, write: bool, preempted: bool = False) -> None:
        """``r`` leaves the running set (finished, or ``preempted``); ``write``: its
        pages stay (shared with the prefix cache, swapped or kept for readmission), so
        a lazy draft records the rows it left out (a draft model), or zeroes them (a
        head; a preempted one writes its stashed rows first); else they are forgotten."""
        self.indexes.pop(r.request_id, None)
        if r.draft_lag is not None and self.draft is not None:
            self.draft.release(r, write, preempted)

    def left(self) -> None:
        """The requests a step ended have shared their pages, not yet freed: a lazy
        head zeroes the rows they left lagging (``HiddenDraft.left``)."""
        left = getattr(self.draft, "left", None)
        if left is not None:
            left()

    def opened(self, r: Request) -> None:
        """``r`` was admitted (a prefix hit maybe): a draft model lags from the first
        hit page whose draft rows a lazy request shared unwritten (``DraftModel.opened``)."""
        if self.draft is not None:
            self.draft.opened(r)

    def record(self, drafted: int, accepted: np.ndarray, requests: int) -> None:
        """A verify step's counts: drafts scored, accepted per request."""
        c = self.counters
        c.verify_steps += 1
        c.verify_requests += requests
        c.draft_tokens += drafted
        c.accepted_tokens += int(accepted.sum())
        c.emitted_tokens += int(accepted.sum()) + requests


_EMPTY = np.zeros(0, np.int64)


def _follows(tokens: list[int], r: Request, known: int) -> bool:
    """Whether ``r``'s first ``known`` tokens extend ``tokens`` (its last one checked:
    outputs are cut only at a stop token, then resumed by nothing but new tokens)."""
    seen = len(tokens)
    if seen > known:
        return False
    if not seen:
        return True
    at, num_prompt = seen - 1, len(r.prompt_ids)
    return tokens[-1] == (r.prompt_ids[at] if at < num_prompt else r.output_ids[at - num_prompt])


def _padded(draft: np.ndarray, k: int, r: Request) -> np.ndarray:
    """``draft`` filled up to ``k`` tokens by repeating its last (the request's last
    token when empty): any tokens are valid drafts, verification keeps the outputs."""
    if len(draft) >= k:
        return draft
    fill = draft[-1] if len(draft) else r.output_ids[-1]
    return np.concatenate([draft, np.full(k - len(draft), fill, np.int64)])
