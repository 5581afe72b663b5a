"""The API process's per-chunk path: what a streamed response's body chunks pass
through, and the response bytes that path must keep.

Oracles: an ASGI middleware placed inside the access gate, counting the messages
it forwards (a stream's body chunks go to the gate's own ``send``, not through the
wrappers inside it); and, for the bytes, a second description written here from
OpenAI's wire format (dicts built field by field from the scripted engine's tokens,
dumped as ``json.dumps`` for events and as starlette's ``JSONResponse`` for bodies),
which the official openai client also parses.
"""

from __future__ import annotations

import json
import threading
import time
from typing import ClassVar

import httpx
import pytest
from serving_fixtures import AppThread, ScriptedLLM

pytest.importorskip("fastapi")
RID = "fixed-request-id"
TOKENS = 3


class CountBodies:
    """An ASGI middleware counting the response messages it forwards."""

    seen: ClassVar[list[str]] = []

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        async def counted(message):
            if scope["type"] == "http":
                CountBodies.seen.append(message["type"])
            await send(message)

        await self.app(scope, receive, counted)


def _entry(group, index: int, k: int) -> tuple:
    """The logprob entry the scripted engine sends with token ``k`` (id ``k``)."""
    text = group.text(index, k)
    return (k, -0.5 - k, 1, [(k, -0.5 - k, text), (k + 1, -2.25, "w\u00e9")], text)


class Served:
    """The app on ScriptedLLM, an engine thread stepping it; ``logprobs``: every
    delta carries its entries (what the engine sends to a request that asked)."""

    def __init__(self, logprobs: bool, inner=None) -> None:
        from unikv.serving.app import create_app

        self.llm = ScriptedLLM()
        app = create_app(self.llm, served_model_names=["s"], max_waiting=None)
        if inner is not None:  # innermost: inside the Gate
            from starlette.middleware import Middleware

            app.user_middleware.append(Middleware(inner))
        self.http = AppThread(app)
        loop, self.stop = self.llm.engine, threading.Event()
        publish = None

        def engine():
            nonlocal publish
            while not self.stop.is_set():
                if publish is None and loop.publish is not None:
                    publish = loop.publish
                    loop.publish = with_logprobs if logprobs else publish
                if any(not g.done for g in loop.groups):
                    loop.step()
                time.sleep(0.001)

        def with_logprobs(pairs):
            for sink, delta in pairs:
                group = next(g for g in loop.groups if g.sink is sink)
                delta.logprobs = [_entry(group, delta.index, delta.token_ids[0])]
            publish(pairs)

        self.thread = threading.Thread(target=engine, daemon=True)
        self.thread.start()

    def post(self, path: str, body: dict) -> httpx.Response:
        headers = {"x-request-id": RID}
        return httpx.post(self.http.url + path, json=body, headers=headers, timeout=30)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.http.stop()


@pytest.fixture(params=[False, True], ids=["plain", "logprobs"])
def served(request):
    s = Served(request.param)
    s.logprobs = request.param
    yield s
    s.close()


def _texts(served) -> list[str]:
    group = served.llm.engine.groups[0]
    return [group.text(0, k) for k in range(TOKENS)]


def _completion_lp(served, ks, offset: int = 0) -> dict:
    group = served.llm.engine.groups[0]
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for k in ks:
        _, lp, _, top, text = _entry(group, 0, k)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        top_dict = {s: v for _, v, s in top}
        top_dict[text] = lp
        out["top_logprobs"].append(top_dict)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_lp(served, ks) -> dict:
    group = served.llm.engine.groups[0]
    content = []
    for k in ks:
        _, lp, _, top, text = _entry(group, 0, k)
        tops = [{"token": s, "logprob": v, "bytes": list(s.encode())} for _, v, s in top]
        content.append(
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": tops}
        )
    return {"content": content}


def _sse(chunks: list[dict]) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def _json(body: dict) -> bytes:  # starlette's JSONResponse rendering
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _usage(prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": TOKENS,
            "total_tokens": prompt_tokens + TOKENS,
            "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


def test_completions_stream_bytes(served):
    openai = pytest.importorskip("openai")
    body = {"model": "s", "prompt": [5, 6], "max_tokens": TOKENS, "stream": True}
    got = served.post("/v1/completions", body | ({"logprobs": 1} if served.logprobs else {}))
    assert got.status_code == 200 and got.headers["x-request-id"] == RID
    created = json.loads(got.content.split(b"\n", 1)[0][6:])["created"]
    chunks, offset = [], 0
    for k, text in enumerate(_texts(served)):
        lp = _completion_lp(served, [k], offset) if served.logprobs else None
        offset += len(text)
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": None}
        if k == TOKENS - 1:
            choice |= {"finish_reason": "length", "stop_reason": None}
        chunks.append({"id": f"cmpl-{RID}", "object": "text_completion", "created": created,
                       "model": "s", "choices": [choice]})  # fmt: skip
    assert got.content == _sse(chunks)
    # the openai client parses the stream (its Completion type, laxly: finish_reason null)
    client = openai.OpenAI(base_url=served.http.url + "/v1", api_key="x", max_retries=0)
    parsed = list(client.completions.create(model="s", prompt=[5, 6], max_tokens=TOKENS,
                  stream=True, logprobs=1 if served.logprobs else None))  # fmt: skip
    assert [c.choices[0].text for c in parsed] == _texts(served)
    if served.logprobs:
        assert [c.choices[0].logprobs.text_offset for c in parsed] == [
            ch["choices"][0]["logprobs"]["text_offset"] for ch in chunks
        ]


def test_chat_stream_bytes(served):
    openai = pytest.importorskip("openai")
    body = {"model": "s", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": TOKENS, "stream": True}  # fmt: skip
    got = served.post(
        "/v1/chat/completions", body | ({"logprobs": True} if served.logprobs else {})
    )
    assert got.status_code == 200
    created = json.loads(got.content.split(b"\n", 1)[0][6:])["created"]

    def chunk(delta, lp=None, reason=None):
        return {"id": f"chatcmpl-{RID}", "object": "chat.completion.chunk", "created": created,
                "model": "s", "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                           "finish_reason": reason}]}  # fmt: skip

    chunks = [chunk({"role": "assistant", "content": ""})]
    for k, text in enumerate(_texts(served)):
        chunks.append(chunk({"content": text}, _chat_lp(served, [k]) if served.logprobs else None))
    chunks.append(chunk({}, None, "length"))
    assert got.content == _sse(chunks)
    for line in got.content.split(b"\n\n")[:-2]:
        openai.types.chat.ChatCompletionChunk.model_validate_json(line[6:])


def test_completions_body_bytes(served):
    openai = pytest.importorskip("openai")
    body = {"model": "s", "prompt": [5, 6], "max_tokens": TOKENS}
    got = served.post("/v1/completions", body | ({"logprobs": 1} if served.logprobs else {}))
    assert got.status_code == 200
    lp = _completion_lp(served, range(TOKENS)) if served.logprobs else None
    want = {"id": f"cmpl-{RID}", "object": "text_completion", "created": got.json()["created"],
            "model": "s", "choices": [{"index": 0, "text": "".join(_texts(served)), "logprobs": lp,
                                       "finish_reason": "length", "stop_reason": None}],
            "usage": _usage(2)}  # fmt: skip
    assert got.content == _json(want)
    openai.types.Completion.model_validate_json(got.content)


def test_chat_body_bytes(served):
    openai = pytest.importorskip("openai")
    body = {"model": "s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS}
    got = served.post(
        "/v1/chat/completions", body | ({"logprobs": True} if served.logprobs else {})
    )
    assert got.status_code == 200
    lp = _chat_lp(served, range(TOKENS)) if served.logprobs else None
    message = {"role": "assistant", "content": "".join(_texts(served))}
    want = {"id": f"chatcmpl-{RID}", "object": "chat.completion",
            "created": got.json()["created"], "model": "s",
            "choices": [{"index": 0, "message": message, "logprobs": lp,
                         "finish_reason": "length", "stop_reason": None}],
            "usage": _usage(1)}  # fmt: skip
    assert got.content == _json(want)
    openai.types.chat.ChatCompletion.model_validate_json(got.content)


def test_stream_body_chunks_skip_the_wrappers_inside_the_gate():
    """A streamed response of N chunks: the middleware inside the gate forwards its
    start message only; a JSON response's body still passes through it."""
    CountBodies.seen = []
    s = Served(False, inner=CountBodies)
    try:
        body = {"model": "s", "prompt": [5, 6], "max_tokens": TOKENS, "stream": True}
        streamed = s.post("/v1/completions", body)
        seen_stream, CountBodies.seen = CountBodies.seen, []
        plain = s.post("/v1/completions", body | {"stream": False})
        seen_plain = CountBodies.seen
    finally:
        s.close()
    assert streamed.status_code == 200 and streamed.content.endswith(b"data: [DONE]\n\n")
    assert streamed.content.count(b"data: ") == TOKENS + 1
    assert seen_stream == ["http.response.start"]
    assert plain.status_code == 200
    assert seen_plain == ["http.response.start", "http.response.body"]
