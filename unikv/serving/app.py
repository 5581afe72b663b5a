"""The OpenAI-compatible HTTP app of ``unikv serve`` (FastAPI).

    POST /v1/completions, /v1/chat/completions  (``stream: true``: server-sent events)
    GET  /v1/models, /health, /metrics
    POST /reset_prefix_cache, /admin/resize_kv_cache  (only with ``enable_admin_routes``)

Several models (a ``MultiLLM``, one KV budget, here or in the engine process:
``engine_client.ProcMulti``): one ``Server`` per model, each
request goes to the one its ``model`` names (404 naming the served models
otherwise); ``/v1/models`` lists them all.

Access, limits, request ids and logs: ``ops.py`` (``ServeOptions``). Prompts
are tokenized (and chat templates rendered) in a thread pool, off the event
loop, so a huge prompt does not stall other clients. A completion's
``max_tokens`` beyond the context left after its prompt is a 400 naming it
(vLLM's message), not a silent clamp; with none given, the default (16 for
completions, none for chat) ends at the context left, as vLLM's does (the
engine ends a request at ``max_model_len`` with finish_reason "length").
``cache_salt`` (vLLM's): requests of different salts share no prefix-cache page.

A completions request without a structured-output grammar whose prompts hold
at most ``INLINE_PROMPT`` characters or token ids in all is prepared on the
event loop itself (a thread hop costs more than tokenizing a few hundred
characters); it tokenizes with a tokenizer copy of its own (``loop_prompts``),
so a huge prompt being tokenized in the pool never holds a lock the loop waits
for.

Graceful shutdown (``begin_drain``, on SIGTERM): new requests get 503 and
``/health`` 503; in-flight requests run on for ``shutdown_timeout_s``, then each
one still running is ended: a stream gets a final chunk per unfinished choice
(``finish_reason: "abort"``) and ``[DONE]``, a JSON body its text so far.

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
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from unikv.engine.online import EngineClosed, QueueFull
from unikv.engine.tracks import Delta
from unikv.serving import kv_admin, routes
from unikv.serving import responses as rsp
from unikv.serving.async_engine import AsyncEngine, RequestFailed, Submission
from unikv.serving.metrics import Merged, RequestClock, ServingMetrics
from unikv.serving.ops import Gate, HTTPError, ServeOptions, read_body
from unikv.serving.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    validation_message,
)
from unikv.serving.sse import DONE, EventStream, EventWriter, event

INVALID = "invalid_request_error"  # OpenAI's error type of a 400
INLINE_PROMPT = 2048  # characters / token ids of all prompts prepared on the event loop
RETRY_AFTER_S = "1"  # a full queue's 503: when to retry


def _error(message: str, kind: str, param, code: int, headers=None) -> JSONResponse:
    return JSONResponse(
        rsp.error_body(message, kind, param, code), status_code=code, headers=headers
    )


async def _body(request: Request, model, options: ServeOptions):
    """The request body as ``model`` (strict pydantic), or BadRequest (HTTPError
    for a body too large or too slow)."""
    raw = await read_body(request, options)
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        message, param = validation_message(err)
        raise BadRequest(message, param) from None


class Server:
    """The app's state: the engine, the served model names and the metrics."""

    def __init__(self, llm, names: list[str], max_waiting: int | None, on_death=None,
                 options: ServeOptions | None = None) -> None:  # fmt: skip
        from unikv.serving.engine_client import ProcEngine

        self.names, self.options = names, options or ServeOptions()
        if isinstance(llm, ProcEngine):  # the engine in its own process
            llm.on_death = on_death
            self.engine, self.llm = llm, llm.front
            self.metrics = ServingMetrics(None, None, names[0], snapshot=llm.snapshot)
            self.prompts = _own_prompts(llm.front)
            self.loop_prompts = _own_prompts(llm.front)  # the event loop's (cheap requests)
        else:
            self.llm = llm
            self.engine = AsyncEngine(llm.engine, llm.requests, llm.reset_prefix_cache,
                                      max_waiting=max_waiting, on_death=on_death)  # fmt: skip
            self.metrics = ServingMetrics(llm.engine, llm.core, model_name=names[0])
            self.prompts = _own_prompts(llm)
            self.loop_prompts = _own_prompts(llm)
            if hasattr(llm, "pool"):  # an LLM (not a test's stand-in): the admin resize
                from functools import partial

                from unikv.engine.budget_broker import resize_kv

                self.engine.resize = partial(resize_kv, llm)
        self.tokenize_pool = ThreadPoolExecutor(2, thread_name_prefix="unikv-tokenize")
        self.draining = self.cut_done = False
        self.live: set[Submission] = set()  # submissions not finished (cut at drain's end)

    async def off_loop(self, fn, *args):
        """``fn(*args)`` in the tokenizer pool (a thread), awaited."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def begin_drain(self, timeout_s: float) -> None:
        """Event loop: refuse new requests, and end the running ones after ``timeout_s``."""
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().call_later(timeout_s, self.cut_all)

    def cut_all(self) -> None:
        """End every running submission now (each ends with finish_reason 'abort')."""
        self.cut_done = True  # a request still being tokenized is ended once submitted
        for sub in list(self.live):
            sub.cut = True
            self._aborted(sub)

    def check_limits(self, items, max_tokens: int | None, field: str) -> None:
        """``max_tokens`` (given by the client) must leave the prompt room in the context."""
        if max_tokens is None:
            return
        context = self.llm.max_model_len
        for ids, _, _ in items:
            if len(ids) + max_tokens > context:
                raise BadRequest(
                    f"This model's maximum context length is {context} tokens. However, you "
                    f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                    f"{max_tokens} in the completion). Please reduce the length of the prompt "
                    f"or {field}.",
                    field,
                )

    def check_model(self, model: str) -> None:
        """The tokenize routes' check (a 400, as before; completions answer 404)."""
        if model not in self.names:
            raise BadRequest(
                f"model {model!r} is not served here; this server serves {self.names}", "model"
            )

    def completion_item(self, prompt, params, prompts=None):
        """(token ids, text or None, params) of one prompt, tokenized by ``prompts``
        (a PromptMaker; default the tokenizer pool's)."""
        try:
            ids = (prompts or self.prompts).token_ids(prompt)
        except Exception as err:  # a tokenizer's own errors included
            raise BadRequest(f"prompt: {err}", "prompt") from err
        return ids, prompt if isinstance(prompt, str) else None, params

    def chat_item(self, body: ChatCompletionRequest, params):
        try:
            text, ids = self.prompts.chat(body.conversation(), **body.template_kwargs())
        except BadRequest:
            raise
        except Exception as err:  # the chat template's own errors too
            raise BadRequest(f"messages: {err}", "messages") from err
        return ids, text, body.use_parser(self.llm, text, params, self.options)

    async def respond(self, request: Request, body, items, chat: bool, start: float):
        """Run ``items`` on the engine; a JSON body or an event stream."""
        sub = await self.engine.asubmit(items, cache_salt=body.cache_salt)
        self.metrics.http_requests += 1
        self.metrics.publish()  # (several API processes: the others' scrapes see it now)
        self.live.add(sub)
        if self.cut_done:
            sub.cut = True
            self._aborted(sub)
        clock = RequestClock(self.metrics, start)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request.state.request_id}"
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
            events = self._events(
                sub, clock, writer, body.n, len(items), prompt_tokens if usage else None
            )
            return EventStream(events, on_close=lambda: self._aborted(sub))
        try:
            choices = await self._collect(request, sub, clock, body.n)
        except RequestFailed as err:
            self.metrics.finished("error")
            return _error(str(err), "InternalServerError", None, 500)
        finally:
            self.live.discard(sub)
            self.metrics.publish()
        if choices is None:
            return Response(status_code=499)  # the client went away
        if sub.cut:  # ended by a shutdown: the text so far
            for i in range(len(items) * body.n):
                choices.text.setdefault(i, [])
                choices.finish.setdefault(i, ("abort", None))
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
            clock.finished(delta.finish_reason, now, (prompt, delta.index))

    async def _events(
        self, sub: Submission, clock, writer: EventWriter, n: int, prompts: int, usage_tokens
    ):
        """The event stream: one bytes chunk per batch of deltas (each batch: what
        arrived since the client was last written to); a shutdown's cut ends each
        unfinished choice with finish_reason 'abort'. The last batch, the closing
        events and ``[DONE]`` go out as one chunk (``EventStream`` ends the
        response with it: one write)."""
        done: set[int] = set()
        tail: list[str] = []
        try:
            while sub.left:
                await sub.wait()
                batch, now, parts = sub.take(), time.perf_counter(), []
                for prompt, delta in batch:
                    self._observe(clock, prompt, delta, now)
                    index = prompt * n + delta.index
                    if delta.finish_reason is not None:
                        done.add(index)
                    parts.append(writer.write(index, delta))
                out = "".join(parts)
                if not sub.left:
                    tail.append(out)  # the last batch: with the stream's end
                elif out:
                    yield out.encode()
            if sub.cut:
                cut = [Delta(i % n, [], "", finish_reason="abort") for i in range(prompts * n)]
                tail += [writer.write(i, d) for i, d in enumerate(cut) if i not in done]
            if sub.error is not None:  # the engine failed mid-stream
                tail.append(event(rsp.error_body(sub.error, "InternalServerError", None, 500)))
            elif usage_tokens is not None:
                tail.append(writer.usage_event(usage_tokens, n))
        finally:
            self.live.discard(sub)
            self._aborted(sub)  # no-op when every completion finished
            self.metrics.publish()
        tail.append(DONE)
        yield "".join(tail).encode()


def not_served(model, names: list[str]) -> HTTPError:
    """The 404 of a request naming a model this server does not serve (OpenAI's)."""
    return HTTPError(
        404, f"model {model!r} is not served here; this server serves {names}",
        "NotFoundError", "model",
    )  # fmt: skip


def _servers(llm, names, max_waiting, on_death, options) -> dict:
    """{served name: Server}: one Server for every name of one LLM, or one per
    model of a ``MultiLLM`` (named by ``names`` in order, default its own names)."""
    from unikv.engine.multi import MultiLLM  # (lazy: the API process loads no model code)
    from unikv.serving.engine_client import ProcMulti

    if not isinstance(llm, (MultiLLM, ProcMulti)):
        server = Server(llm, names, max_waiting, on_death, options)
        return dict.fromkeys(names, server)
    names = names or llm.names
    if len(names) != len(llm.names):
        raise ValueError(
            f"served_model_names: {len(names)} names for {len(llm.names)} models; give one "
            "per model, in order"
        )
    return {
        name: Server(llm[key], [name], max_waiting, on_death, options)
        for name, key in zip(names, llm.names, strict=True)
    }


def cheap(body: CompletionRequest) -> bool:
    """Whether a completions request is prepared on the event loop: no
    structured-output constraint to compile, and its prompts' characters or token
    ids ``INLINE_PROMPT`` at most in all (a refused constraint: False, the pool
    reports it)."""
    try:
        if body.structured_spec() is not None:
            return False
    except BadRequest:
        return False
    prompt = body.prompt
    if isinstance(prompt, str) or not isinstance(prompt, list):
        return isinstance(prompt, str) and len(prompt) <= INLINE_PROMPT
    if prompt and isinstance(prompt[0], int):  # one prompt of token ids (validated)
        return len(prompt) <= INLINE_PROMPT
    size = 0
    for p in prompt:
        size += len(p) if isinstance(p, (str, list)) else 1
        if size > INLINE_PROMPT:
            return False
    return True


def _own_prompts(llm):
    """A PromptMaker over a copy of ``llm``'s tokenizer with a lock of its own, for
    the tokenizer pool: a huge prompt being tokenized does not hold the engine
    thread's ``tokenizer_lock`` (which its detokenizer takes every step), so other
    clients' streams go on. ``llm.prompts`` itself when there is no tokenizer."""
    import copy
    import threading

    from unikv.engine.prompts import PromptMaker

    if not isinstance(getattr(llm, "prompts", None), PromptMaker) or llm.tokenizer is None:
        return llm.prompts
    with llm.tokenizer_lock:
        tokenizer = copy.deepcopy(llm.tokenizer)
    return PromptMaker(tokenizer, threading.Lock(), llm.config, llm.max_model_len)


def _publish_every(servers: list, loop) -> None:
    """Every ``PUBLISH_S``: each server's figures into its shared row (the tokens
    of long requests reach the other processes' scrapes before they end)."""
    from unikv.serving.metrics import PUBLISH_S

    for s in servers:
        s.metrics.publish()
    loop.call_later(PUBLISH_S, _publish_every, servers, loop)


async def _disconnected(request: Request) -> None:
    """Returns when the client's connection closes."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    llm,
    *,
    served_model_names: list[str],
    max_waiting: int | None = 256,
    on_engine_death=None,
    options: ServeOptions | None = None,
) -> FastAPI:
    """The FastAPI app serving ``llm`` (its engine loop starts with the app).
    ``max_waiting``: the admission bound (None: no bound); ``on_engine_death(err)``:
    called on the event loop if the engine loop dies; ``options``: access and
    limits (``ops.ServeOptions``; default: open, no admin routes)."""
    by_name = _servers(llm, list(served_model_names), max_waiting, on_engine_death, options)
    names = list(by_name)
    servers = list(dict.fromkeys(by_name.values()))  # each once
    server = servers[0]  # tokenize routes, metrics and drain: the first model's
    opts = server.options
    # the idle watcher: a MultiLLM's shared budget, or one LLM's own (idle shrink)
    budget = getattr(llm, "budget", None) if len(servers) > 1 else None
    if budget is None and getattr(server.llm, "kv_budget", None) is not None:
        budget = server.llm.kv_budget[0]
    if opts.metrics_dir is not None:  # several API processes: their figures add up
        import os

        for i, s in enumerate(servers):
            path = os.path.join(opts.metrics_dir, f"metrics-{i}.bin")
            s.metrics.share(path, opts.api_server, opts.api_servers)

    def pick(model):
        if model is None:
            return server
        if model not in by_name:
            raise not_served(model, names)
        return by_name[model]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for s in servers:
            s.engine.start()
        if budget is not None:
            budget.start()
        if opts.metrics_dir is not None:
            _publish_every(servers, asyncio.get_running_loop())
        try:
            yield
        finally:
            if budget is not None:
                budget.stop()
            for s in servers:
                s.engine.shutdown()
                s.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="unikv", lifespan=lifespan)
    app.state.server = server
    _error_handlers(app)
    app.add_middleware(Gate, options=opts, state=server)
    if opts.allowed_origins:  # outermost: preflights answered, refusals readable
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=opts.allowed_origins,
            allow_credentials=opts.allow_credentials,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id"],
        )
    routes.register(app, server)

    @app.get("/health")
    async def health():
        if all(s.engine.healthy for s in servers) and not server.draining:
            return Response(status_code=200)
        return _error("the engine loop is not running", "ServiceUnavailable", None, 503)

    @app.get("/v1/models")
    async def models():
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "unikv",
             "max_model_len": s.llm.max_model_len}
            for name, s in by_name.items()
        ]  # fmt: skip
        return {"object": "list", "data": data}

    exported = Merged([s.metrics.registry for s in servers])  # every model's series

    @app.get("/metrics")
    def metrics():  # sync: the snapshot waits for the engine thread (a worker thread)
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(exported), media_type=CONTENT_TYPE_LATEST)

    if opts.enable_admin_routes:

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: Request):
            # a JSON content type: a cross-site page cannot send it without a preflight
            kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return _error("send Content-Type: application/json (an empty body or {})",
                              INVALID, None, 415)  # fmt: skip
            await read_body(request, opts)
            if not await asyncio.to_thread(server.engine.reset_prefix_cache):  # waits for it
                return _error("prefix caching is off; start the server with "
                              "--enable-prefix-caching", INVALID, None, 400)  # fmt: skip
            return {"reset": True}

        kv_admin.register(app, pick, names, opts)

    # the two generation routes are plain starlette routes: a FastAPI route would
    # solve its (empty) dependencies and wrap the handler again for every request
    async def completions(request: Request):
        start = time.perf_counter()
        body = await _body(request, CompletionRequest, opts)
        server = pick(body.model)
        inline = cheap(body)
        if inline:  # no grammar to compile, short prompts: a thread hop costs more
            params = body.params(server.llm)
        else:
            params = await server.off_loop(body.params, server.llm)  # compiles a grammar
        prompts = body.prompts()
        if len(prompts) > opts.max_prompts:
            raise BadRequest(f"prompt: {len(prompts)} prompts in one request; at most "
                             f"{opts.max_prompts} (--max-prompts-per-request)", "prompt")  # fmt: skip
        if inline:
            items = [server.completion_item(p, params, server.loop_prompts) for p in prompts]
        else:
            items = await server.off_loop(
                lambda: [server.completion_item(p, params) for p in prompts]
            )
        if "max_tokens" in body.model_fields_set:
            server.check_limits(items, body.max_tokens, "max_tokens")
        return await server.respond(request, body, items, chat=False, start=start)

    async def chat_completions(request: Request):
        start = time.perf_counter()
        body = await _body(request, ChatCompletionRequest, opts)
        server = pick(body.model)
        max_tokens, logprobs, prompt_logprobs = body.limits()

        def prepare():  # one thread hop: the params (a grammar compiled), then the template
            params = body.sampling_params(max_tokens, logprobs, prompt_logprobs, server.llm)
            return [server.chat_item(body, params)]

        items = await server.off_loop(prepare)
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        server.check_limits(items, max_tokens, field)
        return await server.respond(request, body, items, chat=True, start=start)

    from starlette.routing import Route

    # first in the route list: the router tries routes in order, for every request
    app.router.routes[:0] = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
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

    @app.exception_handler(HTTPError)
    async def refused(request: Request, err: HTTPError):
        return _error(str(err), err.kind, err.param, err.status, err.headers)

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
