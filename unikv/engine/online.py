"""The online engine loop: requests join the running batch at any step.

``EngineLoop`` owns the step loop over the LLM's scheduler and runner. Other
threads ``submit`` request groups (a prompt and its ``n`` completions) and
``abort`` them at any time; both land in an inbox that the loop drains at the
start of each step, so the scheduler and the allocator are only ever touched
by the thread that runs the steps: the loop's own thread after ``start()``, or
the caller of ``LLM.generate`` (``run_inline``).

One step keeps one step in flight (as ``LLM`` always did; with speculative decoding
on, a step that may speculate is planned after the last one settled, since drafts
read the tokens, and a verify step is applied at once: ``Scheduler.complete_verify``;
while the batch-size rule keeps speculation off, ``Scheduler.may_speculate``, the
steps run as without it, one in flight):

    drain inbox (new requests, aborts) -> schedule N -> launch N
    -> settle N-1 (its tokens reach the host; stop tokens cut; each tracked
       request's new tokens are detokenized, stop strings searched, deltas
       published to the streams) -> complete_ahead N (placeholders) -> next

The admission queue is bounded (``max_waiting`` requests not yet running); a
submission made while it is full raises ``QueueFull`` at once. ``submit_all``
admits the groups of one caller together: one HTTP request of 300 prompts is
queued whole when the queue has room, even past the bound. ``shutdown`` either
drains the work or aborts it, then joins the thread.

Failures stay with their request (the loop's own thread, ``isolate``): a step
whose launch raises (the forward, the sampler) settles the step before it, sends
every request of the failed step back to the waiting queue (recompute: pages
freed, tokens kept; none of the failed step's tokens are kept or shared) and
looks for the culprit by bisection. Everything else is held back while the
suspects are probed, half of them at a time, ALONE in the batch: a half whose
requests all get past the point where the step failed (the tokens that step fed
are now computed) is innocent; a half that fails again is split again; a single
request that fails is the culprit and only it ends, with ``finish_reason``
"error" and ``Delta.error`` set (its stream ends with the error). The held
requests then resume where they were (preempted ones are recomputed). A
per-request failure after the forward (detokenizing one request's tokens) ends
that request alone. Only what cannot be attributed is fatal: a failure to
schedule or to settle a step, a CUDA error (the context is lost), or more failed
launches in a row than a bisection of ``max_num_seqs`` requests needs. Then the
loop ends, every request gets the error, ``error`` is set and ``on_death`` is
called (``unikv serve`` exits non-zero so that a supervisor restarts it).
Inline ``LLM.generate`` (``isolate`` off) re-raises the step's exception after
``recover`` has ended its requests, so the ``LLM`` stays usable.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from time import perf_counter

import numpy as np
import torch

from unikv.engine.request import Status
from unikv.engine.speculative.ahead import verify_ahead
from unikv.engine.tracks import Delta, RequestGroup
from unikv.env import FAULT_ENV  # "die-after-steps:N": the loop dies at step N


class QueueFull(RuntimeError):
    """The admission queue is full: retry later (HTTP 503)."""


class EngineClosed(RuntimeError):
    """The loop was shut down, or failed (``EngineLoop.error`` says why)."""


class InjectedFault(RuntimeError):
    """The test-only fault of ``EngineLoop.die_after_steps`` (``unikv serve`` reads
    it from the environment variable ``FAULT_ENV`` once at start-up)."""


def _fatal(err: BaseException) -> bool:
    """An exception no request can be blamed for: not an Exception (interrupts,
    exits), or a CUDA error (the device context is unusable afterwards)."""
    if not isinstance(err, Exception):
        return True
    text = f"{type(err).__name__}: {err}"
    return "AcceleratorError" in text or "CUDA error" in text or "device-side assert" in text


def deliver_each(pairs: list[tuple[object, Delta]]) -> None:
    """The default ``publish``: call each sink with its delta (engine thread)."""
    for sink, delta in pairs:
        sink(delta)


class EngineLoop:
    """The step loop of one engine for requests arriving at any time.

    Args:
        core: the built engine (``build.Engine``: its scheduler, runner, allocator,
            device and tokenizer lock).
        max_waiting: requests submitted but not yet running at most (None: no
            bound); more raise QueueFull.
        owner: what ``on_step`` gets first (the ``LLM`` hands itself; default ``core``).
    publish: called once per step in the loop's thread with the step's
        (sink, Delta) pairs; default ``deliver_each``.
    on_step: None, or ``on_step(owner, batch, logits)`` after every step;
        on_schedule: None, or ``on_schedule(batch)`` once a step is scheduled;
        before_schedule: None, or ``before_schedule()`` before each schedule (a
        shared budget's ``tick``: it may resize the pool).
    """

    def __init__(self, core, *, max_waiting: int | None = None, owner=None) -> None:
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 1):
            raise ValueError(f"max_waiting must be None or an int >= 1, got {max_waiting!r}")
        self.core, self.scheduler, self.runner = core, core.scheduler, core.runner
        self.owner = core if owner is None else owner
        self.max_waiting = max_waiting
        self.publish: Callable[[list], None] = deliver_each
        self.on_step = self.on_schedule = None
        self.before_schedule: Callable[[], None] | None = None  # a shared budget's tick
        self.on_death: Callable[[BaseException], None] | None = None  # loop thread
        self.error: BaseException | None = None
        self.isolate = False  # on in the loop's own thread (see the module docstring)
        self.die_after_steps: int | None = None  # test-only fault injection (FAULT_ENV)
        self.num_failed_steps = 0  # launches that raised (each isolated)
        self.num_failed_requests = 0  # requests ended with finish_reason "error"
        self._failures_in_a_row = 0
        self._max_failures_in_a_row = 2 * math.ceil(math.log2(core.scheduler.max_num_seqs + 1)) + 4
        self._held: list = []  # requests kept out of the scheduler while suspects are probed
        self._suspects: deque[list] = deque()  # groups of requests still to probe
        self._probe: list = []  # the group being probed (alone in the scheduler)
        self._marks: dict[int, int] = {}  # request id -> tokens its probe must compute
        self._cv = threading.Condition()
        self._inbox: list[RequestGroup] = []
        self._aborts: list[RequestGroup] = []
        self._calls: list[tuple[Callable, Future]] = []
        self._live: set[RequestGroup] = set()  # watched groups not done (loop thread)
        self._num_watched = 0  # len(self._live)
        self._prev = None  # the step in flight
        self._ahead = None  # (batch, Launched) of a verify step planned ahead, in flight
        self._thread: threading.Thread | None = None
        self._stopping = self._drain = False
        self._steps = 0  # steps run by ``_serve`` or ``turn`` (die_after_steps counts them)
        # token-only tracks (``Track.wire`` set): their one-token rows go to
        # ``publish_ids(wires, tokens, pairs)`` as two lists, with the step's other
        # deltas, in one call per step (``unikv serve``'s engine process; None: ``publish``)
        self.publish_ids: Callable[[list, list, list], None] | None = None
        self.wake: Callable[[], None] | None = None  # another thread queued a call (``adopt``)
        self.times = None  # a ``StepTimes`` the steps report their phases to (None: untimed)

    # -- any thread ------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, group: RequestGroup, *, bounded: bool = True) -> RequestGroup:
        """Queue ``group`` (made by ``RequestMaker.make_group``); it joins the batch at the
        next step. Raises QueueFull past ``max_waiting``, EngineClosed after
        shutdown or a failure."""
        self.submit_all([group], bounded=bounded)
        return group

    def submit_all(self, groups: list[RequestGroup], *, bounded: bool = True) -> None:
        """Queue ``groups`` together, all or none: when the queue has room (fewer
        than ``max_waiting`` requests wait), every group is queued, even past the
        bound (one caller's request is never too large to be queued); else
        QueueFull. EngineClosed after shutdown or a failure."""
        with self._cv:
            self._admit(groups, bounded)
            self._cv.notify()

    def submit_each(self, batches: list[list[RequestGroup]]) -> list[Exception | None]:
        """``submit_all`` for several callers at once, under one lock (the engine
        process admits every request it drained in one go): each caller's groups
        are queued all or none, in order, by ``submit_all``'s rule; returns per
        caller None (queued) or the QueueFull / EngineClosed it got."""
        out: list[Exception | None] = []
        with self._cv:
            waiting = self.num_waiting
            for groups in batches:
                try:
                    self._admit(groups, True, waiting)
                    waiting += sum(len(g.requests) for g in groups)
                    out.append(None)
                except (QueueFull, EngineClosed) as err:
                    out.append(err)
            self._cv.notify()
        return out

    def _admit(self, groups: list[RequestGroup], bounded: bool, waiting=None) -> None:
        """Queue ``groups`` (under the lock) or raise, nothing queued; ``waiting``:
        ``num_waiting`` when the caller knows it."""
        if self._stopping or self.error is not None:
            raise EngineClosed(f"the engine loop is closed ({self.error or 'shut down'})")
        if bounded and self.max_waiting is not None:
            waiting = self.num_waiting if waiting is None else waiting
            if waiting >= self.max_waiting:
                raise QueueFull(
                    f"the admission queue is full ({waiting} requests waiting, "
                    f"max_waiting={self.max_waiting}); retry later"
                )
        self._inbox.extend(groups)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not running (approximate from other threads)."""
        inbox = sum(len(g.requests) for g in self._inbox)
        return inbox + len(self.scheduler.waiting) + len(self._held)

    @property
    def num_queued(self) -> int:
        """Groups submitted and not yet taken into the scheduler by a step."""
        return len(self._inbox)

    def abort(self, group: RequestGroup) -> None:
        """End every completion of ``group`` not yet done (finish_reason "abort");
        its pages and state slots are freed at the start of the next step."""
        with self._cv:
            self._aborts.append(group)
            self._cv.notify()

    def stop_completion(self, group: RequestGroup, index: int) -> None:
        """End completion ``index`` of ``group`` with finish_reason "stop" between two
        steps (a stop string found outside the engine: ``unikv serve``'s API
        process); its pages are freed, the group's other completions go on."""

        def end() -> None:
            track = group.tracks[index]
            if track.done:
                return
            pairs: list = []
            self._finish([track.request], "stop")
            track.done = True
            r = track.request
            self._collect(track, Delta(index, [], "", None, r.finish_reason, None), pairs)
            if pairs:
                self.publish(pairs)

        # tensor-parallel workers end the same completion at the same step boundary
        end.mirror = ("stop_completion", group.request_id, index)  # type: ignore[attr-defined]
        self.call(end)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` between two steps in the loop's thread (now when no thread
        runs, or when called from that thread); its result comes back through the
        Future. A call that changes the engine's state is a method of the LLM (bound,
        or a ``functools.partial`` of one): tensor-parallel workers repeat it by name
        (``tp_launch``); any other ``fn`` only reads."""
        future: Future = Future()
        if not self.running or threading.current_thread() is self._thread:
            future.set_result(self._invoke(fn))
            return future
        with self._cv:
            self._calls.append((fn, future))
            self._cv.notify()
        if self.wake is not None:  # an adopted loop's thread waits on its sockets, not here
            self.wake()
        return future

    def start(self) -> None:
        assert not self.running, "engine loop invariant: one loop thread at a time"
        self._thread = threading.Thread(target=self._serve, name="unikv-engine", daemon=True)
        self._thread.start()

    def adopt(self) -> None:
        """Make the calling thread this loop's thread, with no thread of its own: the
        caller runs ``turn`` between its other work (``unikv serve``'s engine process
        reads its sockets in the same thread, so nothing contends for the GIL). Calls
        from other threads queue and ``wake`` is called."""
        assert not self.running, "engine loop invariant: one loop thread at a time"
        self._thread = threading.current_thread()
        self._enter()

    @property
    def busy(self) -> bool:
        """Whether ``turn`` has something to do (calls, work, a step in flight)."""
        return bool(self._calls or self._prev or self._has_work())

    @property
    def stepping(self) -> bool:
        """Whether requests are scheduled (running or waiting), held, or a step is in
        flight: new arrivals would join steps that run anyway (``engine_core``'s
        admission window waits only while this is False)."""
        return bool(
            self._prev
            or self._ahead
            or self.scheduler.has_work()
            or self._held
            or self._suspects
            or self._probe
        )

    def turn(self) -> bool:
        """An adopted loop (``adopt``): the queued calls, then one step if there is
        work. False when the loop died (``error`` set, every stream ended with it,
        ``on_death`` called); an exception that is not an Exception is re-raised."""
        self._run_calls()
        if not (self._prev or self._has_work()):
            return True
        try:
            self._one_step()
        except BaseException as err:
            self._die(err)
            if not isinstance(err, Exception):
                raise
            return False
        return True

    def shutdown(self, *, drain: bool = False, timeout: float | None = 30.0) -> None:
        """Stop the loop: ``drain`` finishes the work first, else every live request
        is aborted (its stream gets finish_reason "abort"). Joins the thread (an
        adopted loop, called from its thread: the work is ended here)."""
        with self._cv:
            self._stopping, self._drain = True, drain
            self._cv.notify()
        if self._thread is threading.current_thread():  # adopted (``adopt``)
            while drain and self._has_work() and self.turn():
                pass
            self.stop_work()
            self._thread, self.isolate = None, False
        elif self._thread is not None:
            self._thread.join(timeout)

    # -- the loop's thread ---------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self._enter()
            while self._wait_for_work():
                self._one_step()
        except BaseException as err:
            self._die(err)
            raise
        finally:
            self.isolate = False

    def _enter(self) -> None:
        """The loop's thread starts: failures are isolated, the device is current."""
        self.isolate = True
        if self.core.device.type == "cuda":  # the caller's device: "cuda" has no index
            index = self.core.device.index
            torch.cuda.set_device(torch.cuda.current_device() if index is None else index)

    def _one_step(self) -> None:
        self._steps += 1
        if self.die_after_steps is not None and self._steps >= self.die_after_steps:
            raise InjectedFault(f"injected engine fault at step {self._steps} ({FAULT_ENV})")
        self.step()

    def _die(self, err: BaseException) -> None:
        """The loop ends with ``err``: every stream gets it, ``on_death`` is called."""
        self.error = err
        try:
            self._fail_all(f"{type(err).__name__}: {err}")
        finally:
            if self.on_death is not None:
                self.on_death(err)

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False when the loop should end."""
        with self._cv:
            while not (self._calls or self._stopping or self._prev or self._has_work()):
                self._cv.wait()
        self._run_calls()
        if self._stopping and not (self._drain and self._has_work()):
            self.stop_work()
            return False
        return True

    def stop_work(self) -> None:
        """The loop ends: live requests are aborted, the step in flight settled."""
        self._abort_all()
        self._settle_last()
        self._ahead = None  # its requests ended (aborted): nothing to apply

    def _has_work(self) -> bool:
        return bool(
            self._inbox
            or self._aborts
            or self.scheduler.has_work()
            or self._held
            or self._suspects
            or self._probe
        )

    def _run_calls(self) -> None:
        with self._cv:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            try:
                future.set_result(self._invoke(fn))
            except Exception as err:  # noqa: BLE001  (returned to the caller)
                future.set_exception(err)

    def _invoke(self, fn: Callable[[], object]):
        """Run one ``call`` between steps (the tensor-parallel leader also sends it
        to the workers, ``tp_launch``)."""
        return fn()

    def _drain_inbox(self) -> tuple[list[RequestGroup], list[RequestGroup]]:
        """Take the submitted groups and the aborted ones (the tensor-parallel
        leader also sends them to the workers, ``tp_launch``)."""
        with self._cv:
            groups, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        return groups, aborts

    def _take_inbox(self) -> None:
        groups, aborts = self._drain_inbox()
        for group in groups:
            group.watched = not all(t.passive for t in group.tracks)
            if group.watched:  # passive groups (inline generate) are read at the end
                self._live.add(group)
                self._num_watched += 1
            for r in group.requests:
                if self._quarantined:  # new work waits until the suspects are probed
                    self._held.append(r)
                else:
                    self.scheduler.add(r)
        if aborts:
            self._end(aborts, "abort")

    def step(self):
        """One step: drain the inbox, schedule and launch step N, settle step N-1.
        Returns (batch, launched, requests finished by length) or None when idle
        (the step in flight, if any, was settled)."""
        times = self.times
        start = perf_counter() if times is not None else 0.0
        self._take_inbox()
        if self._held or self._quarantined:
            self._probe_next()
        sched = self.scheduler
        if self._ahead is not None:  # a verify step planned ahead runs: it is this step
            batch, launched = self._ahead
            self._ahead = None
            finished = self._apply_verify(batch, launched)
            if self.on_step is not None:
                self.on_step(self.owner, batch, launched.logits)
            return batch, launched, finished
        if sched.may_speculate():  # drafts read the tokens: the last step settles first
            self._settle_last()  # (past the batch-size rule the step in flight stays: plain)
        if not sched.has_work():
            self._settle_last()
            return None
        if self.before_schedule is not None:  # may resize the pool (budget_broker.py)
            self.before_schedule()
        batch = sched.schedule()
        if self.on_schedule is not None:
            self.on_schedule(batch)
        if times is not None:
            planned = perf_counter()
            times.add("plan", planned - start)
        try:
            launched = self.runner.launch(batch, self._prev)
        except Exception as err:
            if not self.isolate or _fatal(err):
                raise
            self._failed_launch(batch, err)
            return batch, None, []
        if times is not None:
            times.add("launch", perf_counter() - planned)
        self._failures_in_a_row = 0
        if self._prev is not None:
            self._settle(self._prev)
        if launched.verify is not None:  # a verify step: applied once its tokens are in
            self._prev = None
            finished = self._apply_verify(batch, launched)
        else:
            finished = sched.complete_ahead(batch)
            self._prev = launched
        if self.on_step is not None:
            self.on_step(self.owner, batch, launched.logits)
        if times is not None:
            times.add("step", perf_counter() - start)
        return batch, launched, finished

    def _apply_verify(self, batch, launched) -> list:
        """Apply verify step ``batch`` (``launched``, in flight) once its tokens are in;
        the next verify step may be planned and launched first, while it runs
        (``speculative/ahead.py``): kept as ``_ahead`` unless a request of this one ended."""
        sched = self.scheduler
        if not all(r.status is Status.RUNNING for r in batch.requests):  # one ended since
            if not any(r.status is Status.RUNNING for r in batch.requests):
                sched.drop_ahead(batch)  # (a step planned ahead: an abort, a stop string)
                return []
            # the others apply it (their rows and tokens are whole); none is planned
            # after it while it ran beside an ended lane
            launched.batch, emitted = sched.live_lanes(batch, launched.read_emitted())
            finished = sched.complete_verify(launched.batch, emitted)
            self._publish(launched)
            return finished
        ahead = verify_ahead(sched, batch) if sched.spec.pipeline else None
        if ahead is not None:
            try:
                ahead_launched = self.runner.launch(ahead[0], launched)
                ahead_launched.batch = ahead[1]
            except Exception:  # noqa: BLE001  (its rows are trimmed below; the next step
                ahead = None  # plans the work as usual and fails, or not, on its own)
        finished = sched.complete_verify(batch, launched.read_emitted(), ahead and ahead[1])
        self._publish(launched)
        if ahead is not None and sched.kept_ahead:
            self._ahead = (ahead[1], ahead_launched)
        return finished

    def _settle_last(self) -> None:
        if self._prev is not None:
            prev, self._prev = self._prev, None
            self._settle(prev)

    def _settle(self, launched) -> None:
        """Step ``launched``'s tokens into its requests, then publish the deltas."""
        times = self.times
        if times is None:
            self.scheduler.resolve(launched.batch, launched.tokens())
            self._publish(launched)
            return
        start = perf_counter()
        tokens = launched.tokens()  # waits for the step
        ready = perf_counter()
        self.scheduler.resolve(launched.batch, tokens)
        self._publish(launched)
        times.add("wait", ready - start)
        times.add("output", perf_counter() - ready)

    def _publish(self, launched) -> None:
        """Publish the deltas of step ``launched``'s requests (its tokens are in)."""
        if not self._num_watched:  # plain generate: text is decoded at the end
            return
        reqs = launched.batch.requests
        if self.publish_ids is not None:  # ``unikv serve``: bare rows first, in one pass
            wires, tokens, rest = _bare_rows(reqs)
        else:
            wires, tokens, rest = (), (), range(len(reqs))
        pairs = []
        if rest:  # the lanes that need a full delta (text, logprobs, a finish, ...)
            step_logprobs, prompt_logprobs = launched.logprobs(), launched.prompt_logprobs()
            with self.core.tokenizer_lock:
                for lane in rest:
                    r = reqs[lane]
                    track = r.track
                    if track is None or track.passive or track.done:
                        continue
                    try:
                        delta = track.advance(
                            lane, step_logprobs, self.scheduler.finish, prompt_logprobs
                        )
                    except Exception as err:  # this request's text or logprobs: it alone fails
                        if not self.isolate:
                            raise
                        self._fail(r, err, pairs)
                        continue
                    if delta is not None:
                        self._collect(track, delta, pairs)
        if wires:
            self.publish_ids(wires, tokens, pairs)
        elif pairs:
            self.publish(pairs)

    def _collect(self, track, delta: Delta, pairs: list) -> None:
        group = track.group
        if group.sink is not None:
            pairs.append((group.sink, delta))
        if delta.finish_reason is not None:
            group.num_done += 1
            if group.done:
                if group.watched:
                    self._live.discard(group)
                    self._num_watched -= 1
                if group.on_done is not None:
                    group.on_done(group)

    def _end(self, groups: list[RequestGroup], reason: str) -> None:
        """Finish every completion of ``groups`` not done yet, now (in one
        ``_finish``: one free of all their pages)."""
        tracks = list({id(t): t for g in groups for t in g.tracks if not t.done}.values())
        self._finish([t.request for t in tracks], reason)
        pairs: list = []
        for track in tracks:
            track.done = True
            delta = Delta(track.index, [], "", None, track.request.finish_reason, None)
            self._collect(track, delta, pairs)
        if pairs:
            self.publish(pairs)

    def _finish(self, requests: list, reason: str) -> None:
        """End the distinct ``requests`` wherever each is: running or waiting in the
        scheduler, or held out of it by the failure isolation (a half-admitted one's
        slot freed first); the scheduler's ``finish_many`` frees the running ones'
        pages in one ``free_request``."""
        live = []
        for r in requests:
            if r.status is not Status.FINISHED:
                live.append(r)
            elif r.finish_reason is None:
                r.finish_reason = reason
        half = [r for r in live if r.status is Status.WAITING and r.slot is not None]
        if half:  # half-admitted (a failure): no scheduler verb frees a waiting slot
            self.core.alloc.free_request(np.fromiter((r.slot for r in half), np.int64, len(half)))
            for r in half:
                r.slot = None
        if live:
            self.scheduler.finish_many(live, reason)

    # -- failure isolation (the loop's thread; see the module docstring) -------------------

    @property
    def _quarantined(self) -> bool:
        return bool(self._probe or self._suspects)

    def _failed_launch(self, batch, err: Exception) -> None:
        """Step ``batch``'s launch raised: its requests go back to the waiting queue
        and the culprit is searched for among them (or, alone, it fails)."""
        self.num_failed_steps += 1
        self._failures_in_a_row += 1
        if self._failures_in_a_row > self._max_failures_in_a_row:
            raise RuntimeError(
                f"{self._failures_in_a_row} step launches failed in a row; the last: "
                f"{type(err).__name__}: {err}"
            ) from err
        self._settle_last()  # the step before it ran: its tokens are good
        sched = self.scheduler
        live = [(r, n) for r, n in zip(batch.requests, batch.num_new) if r.status is Status.RUNNING]
        for r, n in live:
            self._marks[r.request_id] = r.num_cached + n
        self._hold_everything()
        suspects = [r for r, _ in live]
        self._probe = []
        pairs: list = []
        if len(suspects) == 1:
            self._fail(suspects[0], err, pairs)
        elif suspects:
            half = (len(suspects) + 1) // 2
            self._suspects.appendleft(suspects[half:])
            self._suspects.appendleft(suspects[:half])
        self._held = [r for r in self._held if r not in suspects]
        if pairs:
            self.publish(pairs)
        assert not sched.running and not sched.waiting, "failure isolation: scheduler emptied"

    def _hold_everything(self) -> None:
        """Every request of the scheduler back out of it: running ones preempted
        (recompute, or swap when the rule says so), all of them onto ``_held``
        ahead of what was held already, in their queue order."""
        sched = self.scheduler
        for r in list(reversed(sched.running)):
            sched.preempt(r)  # the scheduler's own preemption (pages freed, tokens kept)
        self._held[:0] = list(sched.waiting)
        sched.waiting.clear()

    def _probe_next(self) -> None:
        """Between steps while suspects are probed: when the probe got past its
        marks, hold it again and start the next group; when none is left, put the
        held requests back into the scheduler (the queue resumes)."""
        sched = self.scheduler
        while True:
            probe = [r for r in self._probe if r.status is not Status.FINISHED]
            if probe and any(r.num_cached < self._marks.get(r.request_id, 0) for r in probe):
                return  # still probing
            for r in self._probe:
                self._marks.pop(r.request_id, None)
            self._probe = []
            if not self._suspects:  # innocent, all of them: everyone resumes
                sched.waiting.extend(r for r in self._held if r.status is not Status.FINISHED)
                self._held = []
                self._marks.clear()  # (suspects a budget-limited failed step left out)
                return
            self._hold_everything()  # a passed probe must not share the next one's batch
            self._probe = [r for r in self._suspects.popleft() if r.status is not Status.FINISHED]
            self._held = [r for r in self._held if r not in self._probe]
            sched.waiting.extend(self._probe)

    def _fail(self, r, err: Exception, pairs: list) -> None:
        """End request ``r`` with finish_reason "error"; its stream gets the error."""
        self.num_failed_requests += 1
        self._finish([r], "error")
        r.finish_reason = "error"
        self._marks.pop(r.request_id, None)
        track = r.track
        if track is None or track.done:
            return
        track.done = True
        message = f"{type(err).__name__}: {err}"
        self._collect(track, Delta(track.index, [], "", None, "error", error=message), pairs)

    def recover(self) -> None:
        """After an exception escaped ``step`` in the caller's thread (inline
        ``generate``): end every request the loop holds (finish_reason "abort"),
        free their pages and state slots, so that the LLM serves again."""
        prev, self._prev, self._ahead = self._prev, None, None
        if prev is not None:
            with contextlib.suppress(Exception):  # its requests end below either way
                self.scheduler.resolve(prev.batch, prev.tokens())
        sched = self.scheduler
        with self._cv:
            groups, self._inbox, self._aborts = self._inbox, [], []
        requests = list(sched.running) + list(sched.waiting) + self._held + self._probe
        requests += [r for g in self._suspects for r in g]
        requests += [r for g in groups for r in g.requests]
        for g in self._live:
            requests += g.requests
        self._held, self._probe, self._marks = [], [], {}
        self._suspects.clear()
        requests = list({id(r): r for r in requests}.values())
        self._finish(requests, "abort")
        for r in requests:
            if r.track is not None:
                r.track.done = True
        for g in list(self._live):
            if g.on_done is not None:
                g.on_done(g)
        self._live.clear()
        self._num_watched = 0

    def _abort_all(self) -> None:
        with self._cv:
            groups, self._inbox = list(self._live) + self._inbox, []
        self._end(groups, "abort")

    def _fail_all(self, message: str) -> None:
        """The loop died: every stream not ended gets the error (nothing is freed:
        the engine is not used again)."""
        with self._cv:
            groups = list(self._live) + self._inbox + self._aborts
            self._inbox, self._aborts = [], []
        pairs = []
        for group in groups:
            for track in group.tracks:
                if not track.done and group.sink is not None:
                    track.done = True
                    pairs.append(
                        (group.sink, Delta(track.index, [], "", None, "abort", error=message))
                    )
            if group.on_done is not None:
                group.on_done(group)
        if pairs:
            self.publish(pairs)


def _bare_rows(reqs: list) -> tuple[list[int], list[int], list[int]]:
    """One pass over a step's requests (``publish_ids``): (wires, tokens) of the
    running bare tracks (``Track.bare``: token-only, with a wire id) that gained
    one token, each marked sent, and the lanes of every other request that may
    have a delta (a bare track with nothing new, a prompt chunk, is neither)."""
    wires, tokens, rest = [], [], []
    for lane, r in enumerate(reqs):
        t = r.track
        if t is not None and t.bare and not t.done and r.finish_reason is None:
            out = r.output_ids
            new = len(out) - t.num_sent
            if new == 1:  # its one new token (a decode row)
                t.num_sent += 1
                wires.append(t.wire)
                tokens.append(out[-1])
                continue
            if not new:  # nothing new (a prompt chunk)
                continue
        rest.append(lane)
    return wires, tokens, rest
