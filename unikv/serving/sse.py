"""Server-sent events of a streamed completion, a batch of deltas at a time.

The common delta (text, no logprobs, not the last) is written from a template
pre-encoded once per request and choice: the JSON of the chunk with a sentinel
in place of the text, split around it; only the text is encoded per delta
(``json``'s own C string encoder). Every other delta (logprobs, a finish, a
chat choice's first role chunk) is built as a dict by ``responses`` and dumped.
Both give the same bytes as ``json.dumps`` of ``responses``' chunk dicts (the
wire format is OpenAI's / vLLM's), which the tests check.

Every chunk of a request carries the same ``created`` (OpenAI: "each chunk has
the same timestamp").
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from json.encoder import encode_basestring_ascii

from starlette.responses import StreamingResponse

from unikv.engine.tracks import Delta
from unikv.serving import responses as rsp
from unikv.serving.ops import RAW_SEND

DONE = "data: [DONE]\n\n"  # a stream's last event
_DONE = DONE.encode()
_SENTINEL = "\x00unikv-text\x00"
_QUOTED = json.dumps(_SENTINEL)


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class EventWriter:
    """The SSE chunks of one streamed request (``chat``: chat.completion.chunk).

    ``write(index, delta)`` returns the event text (maybe "") of one delta of
    choice ``index``; it also counts the completion tokens (for ``usage``).
    """

    def __init__(
        self,
        rid: str,
        model: str,
        created: int,
        chat: bool,
        as_ids: bool,
        parser=None,
        echo=None,
    ) -> None:
        self.rid, self.model, self.created = rid, model, created
        self.chat, self.as_ids = chat, as_ids
        self.parser = parser  # chat: a parsers.OutputParser (reasoning, tool calls), or None
        self._states: dict = {}  # choice -> its parsers.StreamState
        self.echo = echo  # completions: a responses.Echo (the prompt goes first), or None
        self._echoed: set[int] = set()  # choices whose first chunk (the prompt) was sent
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.num_tokens = 0
        self.cached: dict[int, int] = {}  # choice -> prompt tokens from the prefix cache
        self._templates: dict[int, tuple[str, str]] = {}
        self._started: set[int] = set()  # chat choices whose role chunk was sent
        self._offsets: dict[int, int] = {}  # choice -> text_offset of its next logprob

    def _template(self, index: int) -> tuple[str, str]:
        if self.chat:
            chunk = self._chat(index, {"content": _SENTINEL})
        else:
            chunk = rsp.completion_chunk(self.rid, self.model, index, Delta(index, [], _SENTINEL))
            chunk["created"] = self.created
        head, tail = event(chunk).split(_QUOTED)
        self._templates[index] = head, tail
        return head, tail

    def _chat(self, index: int, delta: dict, reason=None, logprobs=None) -> dict:
        chunk = rsp.chat_chunk(self.rid, self.model, index, delta, reason, logprobs)
        chunk["created"] = self.created
        return chunk

    def write(self, index: int, delta: Delta) -> str:
        if self.echo is not None:
            return self.echo_event(index, delta)
        self.num_tokens += len(delta.token_ids)
        if delta.cached_tokens is not None:
            self.cached[index] = delta.cached_tokens
        simple = delta.finish_reason is None and delta.logprobs is None and self.parser is None
        if simple and (not self.chat or index in self._started):
            if not delta.text:
                return ""
            head, tail = self._templates.get(index) or self._template(index)
            return head + encode_basestring_ascii(delta.text) + tail
        return self.chat_events(index, delta) if self.chat else self.completion_event(index, delta)

    def completion_event(self, index: int, delta: Delta) -> str:
        if not (delta.text or delta.finish_reason is not None or delta.logprobs):
            return ""
        offset = self._offsets.get(index, 0)
        chunk = rsp.completion_chunk(self.rid, self.model, index, delta, self.as_ids, offset)
        chunk["created"] = self.created
        if delta.logprobs:
            self._offsets[index] = offset + sum(len(e[4] or "") for e in delta.logprobs)
        return event(chunk)

    def echo_event(self, index: int, delta: Delta) -> str:
        """A completions chunk of an echoing request: its first chunk starts with
        the prompt (its text, and its tokens' logprobs when logprobs are asked);
        max_tokens 0 leaves the sampled token out."""
        echo = self.echo
        if delta.cached_tokens is not None:
            self.cached[index] = delta.cached_tokens
        if echo.drop:
            delta = replace(delta, token_ids=[], text="", logprobs=[] if delta.logprobs else None)
        self.num_tokens += len(delta.token_ids)
        first = index not in self._echoed
        self._echoed.add(index)
        prompt = echo.texts[index // echo.n] if first and echo.echo else ""
        if not (prompt or delta.text or delta.finish_reason is not None or delta.logprobs):
            return ""
        offset = self._offsets.get(index, 0)
        plain = replace(delta, text=prompt + delta.text, logprobs=None)
        chunk = rsp.completion_chunk(self.rid, self.model, index, plain, self.as_ids)
        chunk["created"] = self.created
        if delta.logprobs is not None:
            if prompt:
                entries = delta.prompt_logprobs or [None]
                lp = rsp.echo_logprobs(
                    echo.first[index // echo.n], entries, delta.logprobs, self.as_ids, len(prompt)
                )
                offset = len(prompt)
            else:
                lp = rsp.completion_logprobs(delta.logprobs, self.as_ids, offset)
            self._offsets[index] = offset + sum(len(e[4] or "") for e in delta.logprobs)
            chunk["choices"][0]["logprobs"] = lp
        return event(chunk)

    def chat_events(self, index: int, delta: Delta) -> str:
        out = []
        if index not in self._started:
            self._started.add(index)
            out.append(event(self._chat(index, {"role": "assistant", "content": ""})))
        lp = rsp.chat_logprobs(delta.logprobs, self.as_ids) if delta.logprobs else None
        reason = delta.finish_reason
        if self.parser is None:
            if delta.text or lp:
                out.append(event(self._chat(index, {"content": delta.text}, None, lp)))
        else:
            state = self._states.get(index) or self._states.setdefault(index, self.parser.stream())
            parts = state.feed(delta.text) if delta.text else []
            if reason is not None:
                parts += state.finish()
                reason = "tool_calls" if state.called and reason == "stop" else reason
            if lp and not parts:
                parts = [{"content": ""}]
            for k, part in enumerate(parts):
                out.append(event(self._chat(index, part, None, lp if k == 0 else None)))
        if reason is not None:
            out.append(event(self._chat(index, {}, reason)))
        return "".join(out)

    def usage_event(self, prompt_tokens: int, n: int = 1) -> str:
        """The final chunk with ``usage`` (``n``: completions per prompt)."""
        last = {"id": self.rid, "object": self.obj, "created": self.created}
        last |= {"model": self.model, "choices": []}
        cached = rsp.cached_prompt_tokens(self.cached, n)
        last["usage"] = rsp.usage_body(prompt_tokens, self.num_tokens, cached)
        return event(last)


class EventStream(StreamingResponse):
    """A text/event-stream response of ``content`` (an async iterator of bytes)
    that calls ``on_close()`` as soon as the client goes away (a task watches the
    connection; the stream then ends at its next wake-up) and once it ends,
    however it ends. Each chunk is one ``send``: no task group, no per-chunk
    re-encoding (starlette's StreamingResponse adds both). A chunk that ends with
    ``[DONE]`` ends the response (``more_body`` False: one write, not two).

    The start message goes through the middleware chain (the request id header,
    the status the Gate logs); the body chunks go to the send the Gate was given
    (``ops.RAW_SEND`` in the scope; the chain's own ``send`` when absent): the
    wrappers between (the Gate's, starlette's exception middleware's and its
    route's) only watch the start message, and each costs a coroutine call per
    chunk, per streamed request and engine step. For the same reason the chunks
    are sent from a task of their own (``_pump``)."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close) -> None:
        super().__init__(content)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        watch = asyncio.ensure_future(_watch(receive, self.on_close))
        pump = None
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            await send(start | {"headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(scope.get(RAW_SEND, send)))
            await pump
        except OSError:  # ASGI 2.4 servers: the client went away
            pass
        finally:
            watch.cancel()
            self.on_close()
            if pump is not None and not pump.done():
                pump.cancel()
                await asyncio.wait({pump})
            await self.body_iterator.aclose()

    async def _pump(self, send) -> None:
        """The body chunks, in a task of their own: a wake-up (a chunk ready)
        resumes this task's two frames, not the middleware chain the request's
        task awaits through (a dozen frames, each resumed per chunk)."""
        ended = False
        async for chunk in self.body_iterator:
            ended = chunk.endswith(_DONE)
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _watch(receive, on_close) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    on_close()
