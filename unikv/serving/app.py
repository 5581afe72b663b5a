"""The OpenAI-compatible HTTP app of ``unikv serve`` (FastAPI).

    POST /v1/completions, /v1/chat/completions  (``stream: true``: server-sent events)
    GET  /v1/models, /health, /metrics

A request becomes one request group per prompt on the engine loop (``n``
completions each); its deltas stream back through an asyncio queue. A client
that goes away (a closed stream, or a dropped connection while a non-streamed
request runs) aborts its completions: their pages and state slots are freed at
the next step. Errors are OpenAI-shaped JSON (``{"error": {"message", "type",
"param", "code"}}``), malformed bodies and unknown routes included:

- 400 ``invalid_request_error`` for a bad request: the body is parsed here (not
  UTF-8 JSON, or not an object, is a 400) and validated strictly
  (``protocol.py``); the message names the field, what it expects and what it got;
- 500 for a request the engine failed: the engine isolates the failure to the
  request that raised (``engine/online.py``) and goes on serving the others; a
  stream gets the error as its last event;
- 503 with ``Retry-After`` when the admission queue is full (a request is
  admitted whole when there is room, however many prompts it has), and when
  the engine loop is down. Memory pressure never fails a request: it waits.

If the engine loop dies (an exception nothing could be blamed on), ``/health``
answers 503 at once and ``on_engine_death`` is called (``unikv serve`` exits
non-zero within seconds, so that a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from unikv.engine.online import EngineClosed, QueueFull
from unikv.serving import responses as rsp
from unikv.serving import routes
from unikv.serving.async_engine import AsyncEngine, RequestFailed, Submission
from unikv.serving.metrics import RequestClock, ServingMetrics
from unikv.serving.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    validation_message,
)
from unikv.serving.sse import EventStream, EventWriter, event

INVALID = "invalid_request_error"  # OpenAI's error type of a 400
RETRY_AFTER_S = "1"  # a full queue's 503: when to retry


def _error(message: str, kind: str, param, code: int, headers=None) -> JSONResponse:
    return JSONResponse(
        rsp.error_body(message, kind, param, code), status_code=code, headers=headers
    )


async def _body(request: Request, model):
    """The request body as ``model`` (strict pydantic), or BadRequest."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        message, param = validation_message(err)
        raise BadRequest(message, param) from None


class Server:
    """The app's state: the engine, the served model names and the metrics."""

    def __init__(self, llm, names: list[str], max_waiting: int | None, on_death=None) -> None:
        self.llm, self.names = llm, names
        self.engine = AsyncEngine(llm, max_waiting=max_waiting, on_death=on_death)
        self.metrics = ServingMetrics(llm.engine, llm)

    def check_model(self, model: str) -> None:
        if model not in self.names:
            raise BadRequest(
                f"model {model!r} is not served here; this server serves {self.names}", "model"
            )

    def completion_item(self, prompt, params):
        try:
            ids = self.llm.prompts.token_ids(prompt)
        except Exception as err:  # a tokenizer's own errors included
            raise BadRequest(f"prompt: {err}", "prompt") from err
        return ids, prompt if isinstance(prompt, str) else None, params

    def chat_item(self, body: ChatCompletionRequest, params):
        try:
            text, ids = self.llm.prompts.chat(body.conversation(), **body.template_kwargs())
        except BadRequest:
            raise
        except Exception as err:  # the chat template's own errors too
            raise BadRequest(f"messages: {err}", "messages") from err
        return ids, text, body.use_parser(self.llm, text, params)

    async def respond(self, request: Request, body, items, chat: bool):
        """Run ``items`` on the engine; a JSON body or an event stream."""
        start = time.perf_counter()
        sub = self.engine.submit(items)
        clock = RequestClock(self.metrics, start)
        rid = rsp.new_id("chatcmpl" if chat else "cmpl")
        prompt_tokens = sum(len(ids) for ids, _, _ in items)
        self.metrics.prompt_tokens += prompt_tokens * body.n
        echoed = not chat and (body.echo or body.prompt_logprobs is not None)
        echo = rsp.Echo.of(body, items, self.llm) if echoed else None
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            writer = EventWriter(
                rid, body.model, int(time.time()), chat, body.return_tokens_as_token_ids,
                body.parser, echo,
            )  # fmt: skip
            events = self._events(sub, clock, writer, body.n, prompt_tokens if usage else None)
            return EventStream(events, on_close=lambda: self._aborted(sub))
        try:
            choices = await self._collect(request, sub, clock, body.n)
        except RequestFailed as err:
            self.metrics.finished("error")
            return _error(str(err), "InternalServerError", None, 500)
        if choices is None:
            return Response(status_code=499)  # the client went away
        as_ids = body.return_tokens_as_token_ids
        if chat:
            made = rsp.chat_body(rid, body.model, choices, prompt_tokens, as_ids, body.parser)
            return JSONResponse(made)
        return JSONResponse(
            rsp.completion_body(rid, body.model, choices, prompt_tokens, as_ids, echo)
        )

    async def _collect(self, request: Request, sub: Submission, clock, n: int):
        """Every delta into Choices, or None (and the request aborted) when the
        client disconnects first."""
        choices = rsp.Choices(n)

        async def gather():
            async for batch in sub.batches():
                now = time.perf_counter()
                for prompt, delta in batch:
                    self._observe(clock, prompt, delta, now)
                    choices.add(prompt, delta)

        work = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                self._aborted(sub)
        return choices if work.done() and not work.cancelled() and work.result() is None else None

    def _aborted(self, sub: Submission) -> None:
        num = sub.abort()
        if num:
            self.metrics.finished("abort", num)

    @staticmethod
    def _observe(clock: RequestClock, prompt: int, delta, now: float) -> None:
        clock.tokens((prompt, delta.index), len(delta.token_ids), now)
        if delta.finish_reason is not None:
            clock.finished(delta.finish_reason, now)

    async def _events(self, sub: Submission, clock, writer: EventWriter, n: int, usage_tokens):
        """The event stream: one bytes chunk per batch of deltas (each batch: what
        arrived since the client was last written to)."""
        try:
            while sub.left:
                await sub.wait()
                batch, now, parts = sub.take(), time.perf_counter(), []
                for prompt, delta in batch:
                    self._observe(clock, prompt, delta, now)
                    parts.append(writer.write(prompt * n + delta.index, delta))
                out = "".join(parts)
                if out:
                    yield out.encode()
            if sub.error is not None:  # the engine failed mid-stream
                error = rsp.error_body(sub.error, "InternalServerError", None, 500)
                yield event(error).encode()
            elif usage_tokens is not None:
                yield writer.usage_event(usage_tokens, n).encode()
        finally:
            self._aborted(sub)  # no-op when every completion finished
        yield b"data: [DONE]\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client's connection closes."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    llm, *, served_model_names: list[str], max_waiting: int | None = 256, on_engine_death=None
) -> FastAPI:
    """The FastAPI app serving ``llm`` (its engine loop starts with the app).
    ``max_waiting``: the admission bound (None: no bound); ``on_engine_death(err)``:
    called on the event loop if the engine loop dies."""
    server = Server(llm, list(served_model_names), max_waiting, on_engine_death)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        try:
            yield
        finally:
            server.engine.shutdown()

    app = FastAPI(title="unikv", lifespan=lifespan)
    app.state.server = server
    _error_handlers(app)
    routes.register(app, server)

    @app.get("/health")
    async def health():
        if server.engine.healthy:
            return Response(status_code=200)
        return _error("the engine loop is not running", "ServiceUnavailable", None, 503)

    @app.get("/v1/models")
    async def models():
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "unikv",
             "max_model_len": llm.max_model_len}
            for name in server.names
        ]  # fmt: skip
        return {"object": "list", "data": data}

    @app.get("/metrics")
    def metrics():  # sync: the snapshot waits for the engine thread (a worker thread)
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache():  # sync: waits for the engine thread (a worker thread)
        if not llm.reset_prefix_cache():
            return _error("prefix caching is off; start the server with "
                          "--enable-prefix-caching", INVALID, None, 400)  # fmt: skip
        return {"reset": True}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request, CompletionRequest)
        server.check_model(body.model)
        params = await run_in_threadpool(body.params, llm)  # compiles a grammar
        items = [server.completion_item(p, params) for p in body.prompts()]
        return await server.respond(request, body, items, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request, ChatCompletionRequest)
        server.check_model(body.model)
        params = await run_in_threadpool(body.sampling_params, *body.limits(), llm)
        items = [server.chat_item(body, params)]
        return await server.respond(request, body, items, chat=True)

    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [p for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = str(loc[0]) if loc and first.get("type") != "json_invalid" else None
        where = ".".join(map(str, loc)) if param else "body"
        return _error(f"{where}: {first.get('msg', 'invalid request')}", INVALID, param, 400)

    @app.exception_handler(BadRequest)
    async def bad(request: Request, err: BadRequest):
        return _error(str(err), INVALID, err.param, 400)

    @app.exception_handler(StarletteHTTPException)
    async def http(request: Request, err: StarletteHTTPException):
        kind = INVALID if err.status_code < 500 else "InternalServerError"
        return _error(str(err.detail), kind, None, err.status_code, getattr(err, "headers", None))

    @app.exception_handler(QueueFull)
    async def full(request: Request, err: QueueFull):
        return _error(str(err), "ServiceUnavailable", None, 503, {"Retry-After": RETRY_AFTER_S})

    @app.exception_handler(EngineClosed)
    async def closed(request: Request, err: EngineClosed):
        return _error(str(err), "ServiceUnavailable", None, 503)

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception):
        message = f"internal error: {type(err).__name__}: {err}"
        return _error(message, "InternalServerError", None, 500)
