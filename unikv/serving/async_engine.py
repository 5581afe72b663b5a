"""The engine loop seen from asyncio: submissions whose deltas arrive on a queue.

The loop's thread publishes each step's deltas with ONE
``call_soon_threadsafe`` (``_dispatch`` then fans them out to the submissions'
queues), so the event loop is woken once per step, not once per token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from unikv.engine.tracks import Delta


class Submission:
    """The request groups of one HTTP request (one per prompt) and the queue
    their deltas arrive on, tagged by prompt index."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.queue: asyncio.Queue = asyncio.Queue()
        self.groups: list = []
        self.left = 0  # completions not finished

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(prompt index, Delta) until every completion has finished; an engine
        failure raises RuntimeError."""
        while self.left:
            prompt, delta = await self.queue.get()
            if delta.error is not None:
                raise RuntimeError(f"the engine failed: {delta.error}")
            if delta.finish_reason is not None:
                self.left -= 1
            yield prompt, delta

    def abort(self) -> int:
        """Abort every completion not finished (a client that went away); returns
        how many were."""
        left, self.left = self.left, 0
        if left:
            for group in self.groups:
                if not group.done:
                    self.engine.loop.abort(group)
        return left


class AsyncEngine:
    """``llm``'s engine loop run in its own thread, fed from the event loop.

    Args:
        llm: the LLM (its loop is started here).
        max_waiting: the loop's admission bound (requests not yet running).
    """

    def __init__(self, llm, *, max_waiting: int | None = None) -> None:
        self.llm, self.loop = llm, llm.engine
        self.loop.max_waiting = max_waiting
        self.loop.publish = self._publish
        self._aloop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self.loop.start()

    def shutdown(self) -> None:
        self.loop.shutdown(drain=False)

    @property
    def healthy(self) -> bool:
        return self.loop.running and self.loop.error is None

    def submit(self, items) -> Submission:
        """Submit (token ids, text or None, SamplingParams) per prompt; raises
        QueueFull / EngineClosed (nothing of this request is queued then)."""
        sub = Submission(self)
        groups = [
            self.llm.make_group(ids, params, text=text, sink=(sub.queue, i))
            for i, (ids, text, params) in enumerate(items)
        ]
        try:
            for group in groups:
                self.loop.submit(group)
                sub.groups.append(group)
                sub.left += len(group.tracks)
        except Exception:
            sub.abort()
            raise
        return sub

    def _publish(self, pairs: list) -> None:
        """Engine thread: hand one step's (sink, delta) pairs to the event loop."""
        aloop = self._aloop
        if aloop is not None and not aloop.is_closed():
            aloop.call_soon_threadsafe(_dispatch, pairs)


def _dispatch(pairs: list) -> None:
    for (queue, prompt), delta in pairs:
        queue.put_nowait((prompt, delta))
