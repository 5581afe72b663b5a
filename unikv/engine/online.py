"""The online engine loop: requests join the running batch at any step.

``EngineLoop`` owns the step loop over the LLM's scheduler and runner. Other
threads ``submit`` request groups (a prompt and its ``n`` completions) and
``abort`` them at any time; both land in an inbox that the loop drains at the
start of each step, so the scheduler and the allocator are only ever touched
by the thread that runs the steps: the loop's own thread after ``start()``, or
the caller of ``LLM.generate`` (``run_inline``).

One step keeps one step in flight (as ``LLM`` always did):

    drain inbox (new requests, aborts) -> schedule N -> launch N
    -> settle N-1 (its tokens reach the host; stop tokens cut; each tracked
       request's new tokens are detokenized, stop strings searched, deltas
       published to the streams) -> complete_ahead N (placeholders) -> next

The admission queue is bounded (``max_waiting`` requests not yet running); a
submission beyond it raises ``QueueFull`` at once. ``shutdown`` either drains
the work or aborts it, then joins the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from unikv.engine.request import Status
from unikv.engine.tracks import Delta, RequestGroup


class QueueFull(RuntimeError):
    """The admission queue is full: retry later (HTTP 503)."""


class EngineClosed(RuntimeError):
    """The loop was shut down, or failed (``EngineLoop.error`` says why)."""


def deliver_each(pairs: list[tuple[object, Delta]]) -> None:
    """The default ``publish``: call each sink with its delta (engine thread)."""
    for sink, delta in pairs:
        sink(delta)


class EngineLoop:
    """The step loop of ``llm`` (an ``LLM``) for requests arriving at any time.

    Args:
        llm: the engine (its scheduler, runner and tokenizer).
        max_waiting: requests submitted but not yet running at most (None: no
            bound); more raise QueueFull.
    publish: called once per step in the loop's thread with the step's
        (sink, Delta) pairs; default ``deliver_each``.
    on_step: None, or ``on_step(llm, batch, logits)`` after every step;
        on_schedule: None, or ``on_schedule(batch)`` once a step is scheduled.
    """

    def __init__(self, llm, *, max_waiting: int | None = None) -> None:
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 1):
            raise ValueError(f"max_waiting must be None or an int >= 1, got {max_waiting!r}")
        self.llm, self.scheduler, self.runner = llm, llm.scheduler, llm.runner
        self.max_waiting = max_waiting
        self.publish: Callable[[list], None] = deliver_each
        self.on_step = self.on_schedule = None
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._inbox: list[RequestGroup] = []
        self._aborts: list[RequestGroup] = []
        self._calls: list[tuple[Callable, Future]] = []
        self._live: set[RequestGroup] = set()  # watched groups not done (loop thread)
        self._num_watched = 0  # len(self._live)
        self._prev = None  # the step in flight
        self._thread: threading.Thread | None = None
        self._stopping = self._drain = False

    # -- any thread ------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, group: RequestGroup, *, bounded: bool = True) -> RequestGroup:
        """Queue ``group`` (made by ``LLM.make_group``); it joins the batch at the
        next step. Raises QueueFull past ``max_waiting``, EngineClosed after
        shutdown or a failure."""
        with self._cv:
            if self._stopping or self.error is not None:
                raise EngineClosed(f"the engine loop is closed ({self.error or 'shut down'})")
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            if bounded and self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFull(
                    f"the admission queue is full ({waiting} requests waiting, max_waiting="
                    f"{self.max_waiting}); retry later or raise max_waiting"
                )
            self._inbox.append(group)
            self._cv.notify()
        return group

    def abort(self, group: RequestGroup) -> None:
        """End every completion of ``group`` not yet done (finish_reason "abort");
        its pages and state slots are freed at the start of the next step."""
        with self._cv:
            self._aborts.append(group)
            self._cv.notify()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` between two steps in the loop's thread (now when no thread
        runs, or when called from that thread); its result comes back through the
        Future."""
        future: Future = Future()
        if not self.running or threading.current_thread() is self._thread:
            future.set_result(fn())
            return future
        with self._cv:
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    def start(self) -> None:
        assert not self.running, "engine loop invariant: one loop thread at a time"
        self._thread = threading.Thread(target=self._serve, name="unikv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, *, drain: bool = False, timeout: float | None = 30.0) -> None:
        """Stop the loop: ``drain`` finishes the work first, else every live request
        is aborted (its stream gets finish_reason "abort"). Joins the thread."""
        with self._cv:
            self._stopping, self._drain = True, drain
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop's thread ---------------------------------------------------------------

    def _serve(self) -> None:
        try:
            if self.llm.device.type == "cuda":  # the caller's device: "cuda" has no index
                index = self.llm.device.index
                torch.cuda.set_device(torch.cuda.current_device() if index is None else index)
            while self._wait_for_work():
                self.step()
        except BaseException as err:
            self.error = err
            self._fail_all(f"{type(err).__name__}: {err}")
            raise

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False when the loop should end."""
        with self._cv:
            while not (self._calls or self._stopping or self._prev or self._has_work()):
                self._cv.wait()
        self._run_calls()
        if self._stopping and not (self._drain and self._has_work()):
            self._abort_all()
            self._settle_last()
            return False
        return True

    def _has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self.scheduler.has_work())

    def _run_calls(self) -> None:
        with self._cv:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as err:  # noqa: BLE001  (returned to the caller)
                future.set_exception(err)

    def _take_inbox(self) -> None:
        with self._cv:
            groups, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for group in groups:
            group.watched = not all(t.passive for t in group.tracks)
            if group.watched:  # passive groups (inline generate) are read at the end
                self._live.add(group)
                self._num_watched += 1
            for r in group.requests:
                self.scheduler.add(r)
        for group in aborts:
            self._end(group, "abort")

    def step(self):
        """One step: drain the inbox, schedule and launch step N, settle step N-1.
        Returns (batch, launched, requests finished by length) or None when idle
        (the step in flight, if any, was settled)."""
        self._take_inbox()
        sched = self.scheduler
        if not sched.has_work():
            self._settle_last()
            return None
        batch = sched.schedule()
        if self.on_schedule is not None:
            self.on_schedule(batch)
        launched = self.runner.launch(batch, self._prev)
        if self._prev is not None:
            self._settle(self._prev)
        finished = sched.complete_ahead(batch)
        self._prev = launched
        if self.on_step is not None:
            self.on_step(self.llm, batch, launched.logits)
        return batch, launched, finished

    def _settle_last(self) -> None:
        if self._prev is not None:
            prev, self._prev = self._prev, None
            self._settle(prev)

    def _settle(self, launched) -> None:
        """Step ``launched``'s tokens into its requests, then publish the deltas."""
        batch = launched.batch
        self.scheduler.resolve(batch, launched.tokens())
        if not self._num_watched:  # plain generate: text is decoded at the end
            return
        step_logprobs = launched.logprobs()
        pairs = []
        with self.llm.tokenizer_lock:
            for lane, r in enumerate(batch.requests):
                track = r.track
                if track is None or track.passive or track.done:
                    continue
                delta = track.advance(lane, step_logprobs, self.scheduler.finish)
                if delta is not None:
                    self._collect(track, delta, pairs)
        if pairs:
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

    def _end(self, group: RequestGroup, reason: str) -> None:
        """Finish every completion of ``group`` not done yet, now."""
        pairs = []
        for track in group.tracks:
            if track.done:
                continue
            r = track.request
            if r.status is not Status.FINISHED:
                self.scheduler.finish(r, reason)
            elif r.finish_reason is None:
                r.finish_reason = reason
            track.done = True
            delta = Delta(track.index, [], "", None, r.finish_reason, None)
            self._collect(track, delta, pairs)
        if pairs:
            self.publish(pairs)

    def _abort_all(self) -> None:
        with self._cv:
            groups, self._inbox = list(self._live) + self._inbox, []
        for group in groups:
            self._end(group, "abort")

    def _fail_all(self, message: str) -> None:
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
