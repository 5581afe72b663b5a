"""Continuous batching over the unified pool: chunked prefill, decode batching,
admission by the allocator's capacity oracle, preemption by recompute or by
swap to host slots (``io/swap.py``).

One step (``schedule``):

1. Decodes: every running request with one pending token gets one token
   (``decode_step``: allocation, out-of-window frees, block tables and write
   ids in one call, written into the step planner's buffers ``tables``; when
   no prefill joins, the batch is ``BatchKind.DECODE`` and the planner uses
   them as they are). If the chain cannot hold them, the newest running
   request is preempted (its pages freed, its tokens kept for recompute)
   until it can.
2. Prefill chunks, within ``max_num_batched_tokens`` less the decode rows (and,
   while requests decode, within ``max_prefill_tokens_decoding`` when set: an
   arriving prompt's prefill does not make a decode step many times longer,
   the inter-token latency tail): first running requests
   still prefilling, then waiting requests (FIFO; with prefix caching those whose
   prompt hit the cache when added go first: ``PrefixCaching.pick``) that the
   capacity oracle says fit (``can_admit`` on the pages their whole prefill needs, after
   compaction, plus one recurrent-state slot for hybrid models, allocated
   zeroed at admission and freed with the request's pages).
3. If nothing could be scheduled while requests are running, the newest is
   preempted and the step retried (no livelock: the pool was checked at
   start-up to hold one worst-case request alone).

Prefix caching (``prefix_caching``; ``prefix_policy.py``, chosen once): a waiting
request opens with its longest cached prefix and prefills from there; its pages
are shared once its prompt is in and again when it finishes or is preempted;
hybrids take state checkpoints where their prefill chunks end and, rolling, at each
page a decode completes.

Swap (``swap``, a ``SwapSpace``): a preempted request's pages (a window's live
ones, its state slot) are copied to host slots when the cost rule says so and
the slots are free, else it is recomputed; readmission: ``swap_in.py``.

Decodes without a host rebuild: the decoding requests' slots and lengths stay in
numpy arrays (``_decodes``) while the running list is unchanged and each step
was a DECODE batch (which advanced every one by one token).

``complete`` applies the sampled tokens, frees the pages of finished requests
and the sliding-window pages that left the window.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from unikv.engine.prefix_policy import prefix_policy
from unikv.engine.request import Batch, BatchKind, DecodeSet, Pending, Request, Status
from unikv.engine.speculative.headroom import VerifyRows
from unikv.engine.swap_in import swap_in
from unikv.pool import worst_case_pages

if TYPE_CHECKING:
    from unikv.allocator import PoolAllocator
    from unikv.engine.plan import StepTables

__all__ = ["Batch", "BatchKind", "Scheduler"]  # Batch, BatchKind: request.py


class Scheduler:
    """Decides each step's batch; owns the waiting queue and the running list.

    Args:
        alloc: the ``PoolAllocator`` (request slots, pages, capacity oracle).
        subpools: the pool's sub-pools (spec and page size, for page demand).
        max_num_seqs: running requests at most (<= the allocator's max_requests).
        max_num_batched_tokens: tokens per step at most (the prefill chunk size).
        max_prefill_tokens_decoding: None, or prefill tokens per step at most while
            some request decodes (a step of prefills alone takes the whole budget).
        tables: the step planner's block-table and write-id buffers, which
            ``decode_step`` writes (``StepPlanner.tables``); None (no runner, e.g.
            a capacity simulation): decode_step makes its own.
        prefix_caching: share full pages of prompts across requests (the pool
            must be one the allocator's prefix cache supports).
        swap: None (preemption recomputes), or the ``io.swap.SwapSpace`` that
            preempted requests may swap into.
        speculator: None, or a ``speculative.engine.Speculator``: pure decode steps
            may verify drafts (``_verify``; applied by ``complete_verify``).
        checkpoint_rule: the decode-checkpoint cost rule of a hybrid's prefix cache
            (``engine/checkpoint_rule.py``); None: its CPU defaults.
    """

    def __init__(
        self,
        alloc: PoolAllocator,
        subpools,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_tokens_decoding: int | None = None,
        tables: StepTables | None = None,
        prefix_caching: bool = False,
        swap=None,
        speculator=None,
        checkpoint_rule=None,
    ):
        self.alloc, self.tables = alloc, tables
        self.swap = swap
        self.spec = speculator  # speculative decoding (``speculative.engine.Speculator``)
        # the batch-size rule as a host int, decided once: a step of more decoding
        # requests is the plain engine's (no call into the speculator: -1 without one)
        self.spec_limit = speculator.config.disable_by_batch_size if speculator else -1
        self.subpools = list(subpools)
        self.has_window = any(s.spec.sliding_window is not None for s in self.subpools)
        self.has_state = any(s.spec.kind == "mamba" for s in self.subpools)
        # Mamba slots per request: its live one, and k per-draft-position ones when
        # speculating (``allocator/mamba.py``), admitted and counted together
        self.state_slots = 1 + alloc.view.draft_k
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # prefill tokens of a step with decode rows (decided once: no cap = the budget)
        self.decoding_prefill_cap = max_prefill_tokens_decoding or max_num_batched_tokens
        self.num_steps = self.num_prefill_steps = 0  # steps planned; those with prefill rows
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self.num_preemptions = 0
        self.num_appended = 0  # tokens the last complete()/complete_ahead() appended
        self.prefix = prefix_policy(
            alloc, prefix_caching, self.has_state, self.has_window, checkpoint_rule
        )
        self._decodes: DecodeSet | None = None  # the decoding set, while still valid
        self._step_tables = tables  # the buffers the last decode_step built (``_tables_for``)
        self._step_lazy = False  # whether a lazy draft leaves the last decode_step's rows out
        self.kept_ahead = False  # the last complete_verify kept the step planned ahead
        # verify rows held to the end of their page (``speculative/headroom.py``)
        self.verify_rows = (
            VerifyRows(alloc) if speculator is not None and not speculator.pipeline else None
        )
        self._epoch = 0  # requests finished so far (a batch with the same: none of its)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.prefix.expect(request)  # its checkpoint, if any, is evicted last (issue 41)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def may_speculate(self) -> bool:
        """Whether the next step may verify drafts: a speculator is set and the
        running requests are within its batch-size rule (``disable_by_batch_size``)
        and some request's drafts may be found whatever its pending token is, none
        prefilling and no prompt about to join (``Speculator.may_find``: n-gram
        lookups kept per request). The loop settles
        the step in flight first only then; else the step is the plain engine's,
        planned while the last one runs (past the rule: one check, no loop over
        requests). Should a preemption while scheduling bring that batch under
        the rule, it stays plain (its tokens are not settled:
        ``speculative.engine.settled``); the next step settles first."""
        if len(self.running) > self.spec_limit:
            return False
        if self.spec.draft is None and self.waiting and len(self.running) < self.max_num_seqs:
            return False  # a prompt joins the step: no n-gram drafts (``_pure_decode``)
        return self.spec.may_find(self.running)

    # -- planning ----------------------------------------------------------------

    def schedule(self) -> Batch:
        """The next step's batch (never empty while there is work)."""
        while True:
            batch = Batch()
            prefilling = self._schedule_decodes(batch)
            num_decodes = len(batch.requests)
            budget = self.max_num_batched_tokens - num_decodes
            if num_decodes:
                budget = min(budget, self.decoding_prefill_cap)
            self._schedule_prefills(batch, prefilling, budget)
            if num_decodes != len(batch.requests):  # prefill chunks: their checkpoint slots
                self.prefix.before_step(batch, num_decodes)
            if num_decodes and num_decodes == len(batch.requests) and batch.drafts is None:
                batch.kind, batch.tables = BatchKind.DECODE, self._step_tables
                batch.lazy = self._step_lazy
                batch.all_greedy = self._decodes.greedy()
            if batch.requests:
                batch.epoch = self._epoch
                self.num_steps += 1
                self.num_prefill_steps += num_decodes != len(batch.requests)
                return batch
            assert len(self.running) > 1, (
                "scheduler invariant: one request alone always fits the pool (checked at "
                f"start-up), yet nothing could be scheduled with {len(self.running)} running"
            )
            self.preempt(self.running[-1])

    def _current_decodes(self) -> DecodeSet:
        """The decoding set: kept from the last step when still valid, else rebuilt."""
        d = self._decodes
        if d is None or not d.advanced or self.running != d.running:  # identity compare
            d = self._decodes = DecodeSet.of(self.running)
        d.advanced = False
        return d

    def _schedule_decodes(self, batch: Batch) -> list[Request]:
        """One token for every decoding request (preempting the newest until the
        chain holds them); returns the running requests still prefilling."""
        while True:
            d = self._current_decodes()
            if not d.decoding:
                return d.prefilling
            if len(d.decoding) <= self.spec_limit:
                if self._verify(batch, d):
                    return d.prefilling
            elif self.spec is not None and self._pure_decode(d):  # the rule kept it plain
                self.spec.counters.skipped_by_batch_size += 1
            if self.verify_rows is not None and self.verify_rows.pending:  # (rows held ahead)
                self.verify_rows.trim(d.decoding)
            out, self._step_lazy = self._tables_for(len(d.decoding))
            self._step_tables = out
            step = self.alloc.decode_step(
                d.slots,
                d.lens,
                block_tables=out.block_tables if out is not None else None,
                write_ids=out.write_ids if out is not None else None,
            )
            if step is not None:
                batch.add_many(d.decoding, d.ones, step.virtual_ids)
                batch.step, batch.decodes = step, d
                return d.prefilling
            self._decodes = None
            self.preempt(self.running[-1])

    def _tables_for(self, num_decodes: int) -> tuple[StepTables | None, bool]:
        """(the buffers ``decode_step`` builds, whether a lazy draft leaves this
        step's rows out): the target's only where it does (past the batch-size rule:
        its sub-pools' tables are nobody's input then), else every token sub-pool's.
        Host ints, decided once a step (``Batch.lazy``: the runner reads it)."""
        out, draft = self.tables, self.spec.draft if self.spec is not None else None
        lazy = num_decodes > self.spec_limit and draft is not None and draft.lazy(num_decodes)
        if lazy and out is not None and out.target_only is not None:
            return out.target_only, True
        return out, lazy

    def _verify(self, batch: Batch, d: DecodeSet) -> bool:
        """Make ``batch`` a verify step when the step speculates (no prefill chunk
        to schedule, the speculator's rules): each decoding request feeds its pending
        token and its drafts (``1 + k_i`` rows, ``alloc_extend``). False (nothing
        changed) when it does not, or when the pool cannot hold the drafts now."""
        if not self._pure_decode(d) or not self.spec.lookup(d.decoding):
            return False  # no drafts: the plain engine's decode step
        rows = self.verify_rows
        if rows is not None:  # pages held ahead: an extend only where a page ends
            found = self.spec.drafts(d.decoding, lambda n: rows.allocate(d.slots, d.lens, n))
        else:
            found = self.spec.drafts(
                d.decoding, lambda n: self.alloc.alloc_extend(d.slots, d.lens, n)
            )
        if found is None:  # or no room for the drafts: a plain decode step (it may preempt)
            return False
        drafts, ids, batch.draft_tokens = found
        num_new = 1 + np.fromiter((len(x) for x in drafts), np.int64, len(drafts))
        for r, draft in zip(d.decoding, drafts):
            r.draft_ids = draft.tolist()
        batch.add_many(d.decoding, num_new.tolist(), ids)
        batch.drafts = drafts
        self._decodes = None  # lengths advance unevenly: rebuilt next step
        return True

    def _pure_decode(self, d: DecodeSet) -> bool:
        """Whether the step may only decode: no prefill chunk to schedule, no request
        waiting for a free seat."""
        return not d.prefilling and not (self.waiting and len(self.running) < self.max_num_seqs)

    def _schedule_prefills(self, batch: Batch, prefilling: list[Request], budget: int) -> None:
        for r in prefilling:
            if budget <= 0:
                return
            n = self.prefix.chunk(r, budget)
            ids = self.extend(r, n)
            if ids is None:
                return
            batch.add(r, n, ids)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            at = self.prefix.pick(self.waiting, self.max_num_seqs)  # hits first (issue 41)
            r = self.waiting[at]
            if self.swap is not None and r.request_id in self.swap.held:
                hit, (n, ids) = None, swap_in(self, r, budget)
            else:
                hit = self.prefix.open(r)
                if self.spec is not None:  # a lazy draft's rows the hit left stale
                    self.spec.opened(r)
                n = self.prefix.chunk(r, budget)
                ok = self.fits(r.num_pending, n, r) and self.admit_state(r)
                ids = self.extend(r, n) if ok else None
            if ids is None:
                if hit is not None:  # not admitted: its lookup is retried, counted then
                    self.alloc.prefix.uncount(hit)
                self.alloc.free_request(r.slot)
                r.slot, r.num_cached = None, 0
                return
            if r.num_preemptions == 0:  # the first admission's hit is the request's
                r.num_cached_tokens = r.num_cached
            del self.waiting[at]
            r.status = Status.RUNNING
            self.running.append(r)
            batch.add(r, n, ids)
            budget -= n

    def fits(self, num_tokens: int, chunk: int, r: Request | None = None) -> bool:
        """Capacity oracle: can a request needing ``num_tokens`` more tokens, written
        ``chunk`` at a time, get its pages now (after compaction if need be)? ``r``:
        the request, opened with a prefix hit: the window pages it holds already count
        toward its window's worst case (``prefix_policy.window_demand``)."""
        demand = {
            s.name: worst_case_pages(s.spec, s.page_size, num_tokens, chunk, self.state_slots)
            for s in self.subpools
        }
        if r is not None:
            demand = self.prefix.window_demand(r, demand, self.subpools, chunk)
        return bool(self.alloc.can_admit(demand)[1])

    def admit_state(self, r: Request) -> bool:
        """A zeroed recurrent-state slot for a newly admitted request (hybrid models;
        with its per-draft-position slots when speculating); False when the chain
        cannot make room for them."""
        if not self.has_state:
            return True
        return self.alloc.alloc_mamba(np.array([r.slot], dtype=np.int64)) is not None

    def extend(self, r: Request, n: int):
        return self.alloc.alloc_extend(
            np.array([r.slot], dtype=np.int64),
            np.array([r.num_cached], dtype=np.int64),
            np.array([n], dtype=np.int64),
        )

    def share(self, r: Request, preempted: bool = False) -> None:
        """Share ``r``'s full pages in the prefix cache as it leaves the running set
        (a lazy draft records or zeroes its missing rows first where the pages stay:
        ``Speculator.release``)."""
        if self.spec is not None:
            self.spec.release(r, self.prefix.enabled or preempted, preempted)
        self.prefix.share(r)

    def release(self, done: list[Request]) -> None:
        """End the running requests ``done`` (those finishing in one step): each
        shares its pages first (``share``), then one ``free_request`` frees every
        page and state slot of them all (one table write, not one each)."""
        if not done:
            return
        for r in done:
            self.share(r)
        if self.spec is not None:  # (a lazy head's rows they left, while still theirs)
            self.spec.left()
        self.alloc.free_request(np.fromiter((r.slot for r in done), np.int64, len(done)))
        gone, before = {id(r) for r in done}, len(self.running)
        self.running[:] = [r for r in self.running if id(r) not in gone]  # one pass, in place
        assert len(self.running) == before - len(done), "release: every request done runs"
        for r in done:
            r.slot, r.status = None, Status.FINISHED

    def preempt(self, r: Request) -> None:
        """Preemption: free every page, keep the tokens, requeue first; the pages
        go to host slots first when ``swap`` takes them, else it is recomputed. The
        free's table entries wait for the step's own write (``free_request(defer=
        True)``: every preemption of a step and its decode or extend in one write;
        a step scheduled after a preemption always writes)."""
        self.share(r, preempted=True)
        if self.swap is not None:
            record = self.swap.swap_out(r.request_id, r.slot, r.num_cached)
            if record is not None:
                record.state_at = self.prefix.points.pop(r.slot, None)
        self.alloc.free_request(r.slot, defer=True)
        self.running.remove(r)
        r.slot, r.num_cached, r.status = None, 0, Status.WAITING
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)

    def finish(self, r: Request, reason: str) -> None:
        """End a waiting or running request now (a stop string): ``finish_many``."""
        self.finish_many([r], reason)

    def finish_many(self, requests: list[Request], reason: str) -> None:
        """End the distinct waiting or running ``requests`` now (aborts, a stop string):
        the running ones share their pages, then one ``free_request`` frees every page
        and recurrent-state slot of them all (``release``; pages an in-flight step
        still uses are fenced by the allocator); the waiting ones leave the queue in
        one pass, their host swap slots dropped. Outputs stay; a placeholder left by
        the step in flight is resolved as usual."""
        running, waiting = [], []
        for r in requests:
            if r.status is Status.RUNNING:
                running.append(r)
            elif r.status is Status.WAITING:  # (held out of the queue too: online.py's probes)
                self.prefix.forget(r)  # its expected checkpoint, if any, is an ordinary one
                waiting.append(r)
        self.release(running)
        if waiting:
            gone = {id(r) for r in waiting}
            kept = [r for r in self.waiting if id(r) not in gone]
            if len(kept) != len(self.waiting):  # one pass, in place
                self.waiting.clear()
                self.waiting.extend(kept)
            if self.swap is not None:
                for r in waiting:
                    self.swap.drop(r.request_id)
        for r in requests:
            r.slot, r.status = None, Status.FINISHED
            if r.finish_reason is None or reason == "stop":
                r.finish_reason = reason
        self._epoch += len(requests)

    # -- after the forward ---------------------------------------------------------

    def complete_ahead(self, batch: Batch) -> list[Request]:
        """``complete`` for a step still running on the device: each request whose
        pending tokens are all in gets the placeholder ``Pending.of(i)`` for its
        sample (lane ``i`` of the step's tokens), so the next step can be planned
        now; ``resolve`` writes the values later. Requests that a stop token
        already finished are skipped. Returns the requests finished by length."""
        tokens = list(range(Pending.of(0), Pending.of(len(batch.requests)), -1))
        if batch.epoch == self._epoch:  # none finished since it was built
            return self.complete(batch, tokens)
        keep = [r.status is not Status.FINISHED for r in batch.requests]
        live = Batch(
            [r for r, k in zip(batch.requests, keep) if k],
            [n for n, k in zip(batch.num_new, keep) if k],
        )
        return self.complete(live, [t for t, k in zip(tokens, keep) if k])

    def resolve(self, batch: Batch, tokens: list[int]) -> list[Request]:
        """Write the sampled values into the placeholders ``complete_ahead`` left for
        ``batch``; a stop token finishes its request (pages freed, outputs cut
        there). Returns the requests finished now."""
        finished = []
        for i, r in enumerate(batch.requests):
            # only this step's placeholders exist now, each the last output
            if not r.output_ids or r.output_ids[-1] != Pending.of(i):
                continue  # no sample taken from this lane (mid-prefill or stopped)
            if r.resolve(len(r.output_ids) - 1, tokens[i]):
                finished.append(r)
                self._epoch += 1
                if r.status is Status.RUNNING:
                    continue  # released below, with the others: one free
                if r.status is Status.WAITING:  # preempted meanwhile
                    self.waiting.remove(r)
                    if self.swap is not None:
                        self.swap.drop(r.request_id)
                r.slot, r.status = None, Status.FINISHED
        self.release([r for r in finished if r.status is Status.RUNNING])
        return finished

    def complete_verify(
        self, batch: Batch, emitted: list[list[int]], ahead: Batch | None = None
    ) -> list[Request]:
        """Apply a verify step (``_verify``): request i takes ``emitted[i]`` (its
        accepted drafts and one token of the target's) until a stop rule ends it; the
        rows of its pending token and accepted drafts stay in the cache and the
        rejected rows are rolled back (``alloc.truncate``: pages emptied are freed, a
        window's bookkeeping restored) before out-of-window pages are freed. Returns
        the requests finished. A recurrent model's request continues from the state
        after its last kept row: its live slot's when it kept every row, else that of
        draft slot ``kept - 1``, which becomes its live slot (``MambaSlots.select``).
        ``ahead``: the verify step planned after this one (``speculative/ahead.py``),
        its rows moved on the device to where this step's acceptance puts them: the
        rows it writes stay and it is applied next (``kept_ahead``; its drafts are the
        candidates of each request's acceptance) unless every request finished here.
        A request that finished drops only its own row of it: its pages go back with
        the rest of its pages (fenced until the step ran), the others apply it
        (``live_lanes``)."""
        reqs, finished, appended = batch.requests, [], 0
        keep = np.empty(len(reqs), np.int64)
        kept = []
        for i, (r, tokens) in enumerate(zip(reqs, emitted)):
            assert r.status is Status.RUNNING and r.num_cached + 1 == r.seq_len, (
                "verify invariant: a verify step's requests are decoding when it completes"
            )
            start = r.num_cached
            for token in tokens:
                r.append(token)
                appended += 1
                if r.finish_reason is not None:
                    finished.append(r)
                    break
            r.num_cached = keep[i] = min(start + len(tokens), r.seq_len - 1)
            kept.append(int(keep[i] - start))
            r.draft_ids = []
        slots = np.fromiter((r.slot for r in reqs), np.int64, len(reqs))
        accepted = np.asarray([len(t) - 1 for t in emitted], np.int64)
        drafted = np.fromiter((len(x) for x in batch.drafts), np.int64, len(reqs))
        self.kept_ahead = ahead is not None and len(finished) < len(reqs)
        if ahead is not None:
            self.spec.counters.ahead_steps += 1
            self.spec.counters.ahead_dropped += not self.kept_ahead
        if self.kept_ahead:  # the step planned ahead is the true next one: its rows stay
            ended = np.fromiter((r.finish_reason is not None for r in reqs), bool, len(reqs))
            keep = keep + np.where(ended, 0, np.asarray(ahead.num_new, np.int64))  # (its row: cut)
            ahead.drafts = ahead.derive.chosen(accepted)
        rows, fed = np.asarray(kept, np.int64), np.asarray(batch.num_new, np.int64)
        cut = rows < fed  # requests that rejected a draft (at full acceptance: nothing to do)
        state_rows = rows[cut] - 1 if self.state_slots > 1 else None
        if cut.any() and self.verify_rows is not None:  # cut to the kept rows' page end
            self.verify_rows.trim_after(slots[cut], keep[cut], state_rows)
        elif cut.any() and self.state_slots > 1:  # and the state after the last kept row
            self.alloc.truncate(slots[cut], keep[cut], state_rows=rows[cut] - 1)
        elif cut.any():
            self.alloc.truncate(slots[cut], keep[cut])
        self.spec.record(int(drafted.sum()), accepted, len(reqs))
        self.num_appended = appended
        self.prefix.after_step(Batch(list(reqs), kept), verify=True)
        self._epoch += len(finished)
        self.release(finished)
        if self.has_window:
            live = [r for r in reqs if r.status is Status.RUNNING]
            if live:
                self.alloc.free_out_of_window(
                    np.fromiter((r.slot for r in live), np.int64, len(live)),
                    np.fromiter((r.num_cached for r in live), np.int64, len(live)),
                )
        return finished

    @staticmethod
    def live_lanes(batch: Batch, emitted: list[list[int]]) -> tuple[Batch, list[list[int]]]:
        """A verify step planned ahead, less the lanes whose request ended since it was
        launched (finished by the step before, aborted, a stop string): their rows left
        with their pages (``free_request``); the others' rows and tokens are whole."""
        live = [i for i, r in enumerate(batch.requests) if r.status is Status.RUNNING]
        sub = Batch([batch.requests[i] for i in live], [batch.num_new[i] for i in live])
        sub.drafts = [batch.drafts[i] for i in live]
        return sub, [emitted[i] for i in live]

    def drop_ahead(self, batch: Batch) -> None:
        """A verify step planned ahead whose requests did not all stay running (an
        abort or a stop string between steps): its results are dropped and the rows
        of the running ones trimmed back to their cached tokens (fenced until it ran)."""
        self.spec.counters.ahead_dropped += batch.derive is not None
        live = [r for r in batch.requests if r.status is Status.RUNNING]
        if live:
            slots = np.fromiter((r.slot for r in live), np.int64, len(live))
            lens = np.fromiter((r.num_cached for r in live), np.int64, len(live))
            self.alloc.truncate(slots, lens)
        for r in batch.requests:
            r.draft_ids = []

    def complete(self, batch: Batch, tokens: list[int]) -> list[Request]:
        """Apply one step: advance caches, append sampled tokens (for requests whose
        pending tokens are all in now), free finished requests and out-of-window
        pages. ``tokens[i]`` is request i's sample. Returns newly finished requests."""
        finished = []
        appended = 0
        for r, n, token in zip(batch.requests, batch.num_new, tokens):
            r.num_cached += n
            if r.num_cached == len(r.prompt_ids) + len(r.output_ids):
                r.append(token)
                appended += 1
                if r.finish_reason is not None:
                    finished.append(r)
        self.num_appended = appended  # sampled tokens this step took (for counters)
        self.prefix.after_step(batch)  # checkpoints, shared pages (before any free)
        if batch.kind is BatchKind.DECODE and self._decodes is not None:
            self._decodes.advance(len(batch.requests))
        self._epoch += len(finished)
        self.release(finished)
        if self.has_window and batch.kind is BatchKind.EXTEND:  # else decode_step did
            live = [r for r in batch.requests if r.status is Status.RUNNING]
            if live:
                self.alloc.free_out_of_window(
                    np.fromiter((r.slot for r in live), np.int64, len(live)),
                    np.fromiter((r.num_cached for r in live), np.int64, len(live)),
                )
        return finished
