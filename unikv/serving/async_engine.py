"""The engine loop seen from asyncio: submissions whose deltas arrive in batches.

The loop's thread publishes each step's deltas with ONE
``call_soon_threadsafe`` (``_dispatch`` then appends them to their
submissions), so the event loop is woken once per step, not once per token.
A submission keeps a plain list and at most one waiting future: its handler
wakes once per step at most, and takes every delta that arrived since it last
ran (several steps' worth when it fell behind) as one batch, in arrival order:

    engine thread          event loop                          handler task
    step k: pairs  --call_soon_threadsafe-->  _dispatch: sub.push(...) -> wake
    step k+1: pairs  ------------------------>  _dispatch: sub.push(...)
                                                            batch = [k..., k+1...]
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from unikv.engine.step_times import StepTimes
from unikv.engine.tracks import Delta


class RequestFailed(RuntimeError):
    """The engine failed one of this submission's completions (the step that
    raised was isolated to it; the engine goes on): HTTP 500 for this request."""


class Submission:
    """The request groups of one HTTP request (one per prompt) and the deltas
    that arrived for them, tagged by prompt index. Event-loop thread only."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.items: list[tuple[int, Delta]] = []  # arrived, not yet taken
        self._waiter: asyncio.Future | None = None
        self.groups: list = []
        self.left = 0  # completions not finished
        self.error: str | None = None  # set when the engine failed
        self.cut = False  # ended by the server's shutdown (``Server.cut_all``)

    def push(self, prompt: int, delta: Delta) -> None:
        """A delta of prompt ``prompt``'s group arrived (``_dispatch``)."""
        self.items.append((prompt, delta))
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until a delta arrives (now if some did), or the submission ends."""
        if not self.items and self.left:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def take(self) -> list[tuple[int, Delta]]:
        """Every (prompt index, Delta) arrived since the last take, in arrival
        order (maybe none). An engine failure ends the submission: ``error`` says
        why, the deltas before it are returned."""
        batch, self.items = self.items, []
        for k, (_, delta) in enumerate(batch):
            if delta.error is not None:
                self.error = f"the engine failed on this request: {delta.error}"
                self.abort()  # its other completions stop too
                return batch[:k]
            if delta.finish_reason is not None:
                self.left -= 1
        return batch

    async def batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        """``take``'s batches until every completion has finished; an engine
        failure raises RequestFailed (after the deltas that came before it)."""
        while self.left:
            await self.wait()
            batch = self.take()
            if batch:
                yield batch
        if self.error is not None:
            raise RequestFailed(self.error)

    def abort(self) -> int:
        """Abort every completion not finished (a client that went away); returns
        how many were. Deltas still in flight for it are dropped; a task in
        ``wait`` wakes up."""
        left, self.left = self.left, 0
        self.items = []
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if left:
            self.engine.abort_submission(self)
        return left


class AsyncEngine:
    """An engine loop run in its own thread, fed from the event loop.

    Args:
        loop: the engine loop (``online.EngineLoop``; started here).
        requests: makes the loop's request groups (``RequestMaker``: ``make_group``).
        reset_prefix_cache: drops the cached prefixes between two steps (``LLM``'s).
        max_waiting: the loop's admission bound (requests not yet running);
            None or 0: no bound.
    """

    def __init__(
        self, loop, requests, reset_prefix_cache, *, max_waiting: int | None = None, on_death=None
    ) -> None:
        if max_waiting is not None and (
            isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0
        ):
            raise ValueError(
                f"max_waiting must be None or an int >= 0 (0 = no bound), got {max_waiting!r}"
            )
        self.loop, self.requests, self._reset_prefix = loop, requests, reset_prefix_cache
        self.loop.max_waiting = max_waiting or None  # 0: no bound, as --max-waiting 0
        self.loop.publish = self._publish
        self.loop.on_death = self._died
        self.loop.times = StepTimes()  # host time per step by phase (/metrics)
        self.on_death = on_death  # called on the event loop when the engine loop dies
        self.resize = None  # the admin route's resize (the app sets it)
        self._aloop: asyncio.AbstractEventLoop | None = None

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the app runs on (set by ``start``; None before)."""
        return self._aloop

    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self.loop.start()

    def shutdown(self) -> None:
        self.loop.shutdown(drain=False)

    @property
    def healthy(self) -> bool:
        return self.loop.running and self.loop.error is None

    def submit(self, items, cache_salt: str | None = None) -> Submission:
        """Submit (token ids, text or None, SamplingParams) per prompt, all together
        (``EngineLoop.submit_all``); raises BadRequest (parameters the model
        refuses), QueueFull or EngineClosed, and nothing of this request is queued.
        ``cache_salt``: the prefix cache shares pages only within one salt."""
        from unikv.serving.protocol import BadRequest

        sub = Submission(self)
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        try:
            groups = [
                self.requests.make_group(ids, params, text=text, sink=(sub, i), **salt)
                for i, (ids, text, params) in enumerate(items)
            ]
        except ValueError as err:
            field = str(err).split(" ", 1)[0]
            raise BadRequest(str(err), field if field == "stop_token_ids" else None) from err
        self.loop.submit_all(groups)
        sub.groups = groups
        sub.left = sum(len(g.tracks) for g in groups)
        return sub

    async def asubmit(self, items, cache_salt: str | None = None) -> Submission:
        """``submit`` as the app calls it (``ProcEngine.asubmit`` waits for the
        engine process's answer)."""
        return self.submit(items, cache_salt)

    def abort_submission(self, sub: Submission) -> None:
        for group in sub.groups:
            if not group.done:
                self.loop.abort(group)

    def reset_prefix_cache(self) -> bool:
        return self._reset_prefix()

    def resize_kv_cache(self, total_bytes: int) -> int:
        """The pool to ``total_bytes`` (within a shared budget if any: ``resize``, set
        by the app, is ``budget_broker.resize_kv`` of the LLM); its new size, or
        ValueError with nothing changed."""
        if self.resize is None:
            raise ValueError("this engine cannot resize its pool")
        return self.resize(total_bytes)

    def _died(self, err: BaseException) -> None:
        """Engine thread: the loop died; tell the event loop (``on_death``)."""
        aloop = self._aloop
        if self.on_death is not None and aloop is not None and not aloop.is_closed():
            try:
                aloop.call_soon_threadsafe(self.on_death, err)
            except RuntimeError:  # the event loop closed meanwhile
                pass

    def _publish(self, pairs: list) -> None:
        """Engine thread: hand one step's (sink, delta) pairs to the event loop."""
        aloop = self._aloop
        if aloop is not None and not aloop.is_closed():
            try:
                aloop.call_soon_threadsafe(_dispatch, pairs)
            except RuntimeError:  # the event loop closed meanwhile (shutdown)
                pass


def _dispatch(pairs: list) -> None:
    """Event loop: append each delta to its submission (a finished submission
    that was aborted drops it)."""
    for (sub, prompt), delta in pairs:
        if sub.left:
            sub.push(prompt, delta)
