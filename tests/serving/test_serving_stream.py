"""The batched streaming path of ``unikv serve``: per-step deltas fanned out to
submissions, coalesced into one write per wake-up, SSE chunks from templates.

Oracles: the (sink, Delta) pairs the scripted engine published (order and
completeness, per completion), ``json.dumps`` of ``responses``' chunk dicts
(the pre-encoded templates must give the same bytes), and the official openai
client's parsing of the stream.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from serving_fixtures import AppThread, ScriptedLLM

from unikv.engine.tracks import Delta
from unikv.serving import responses as rsp
from unikv.serving.async_engine import AsyncEngine
from unikv.serving.sse import EventWriter

pytest.importorskip("fastapi")
TEXTS = ["plain", ' "quoted" \\ back', "line\nbreak\ttab", "é ü 中文 🙂", "\x01\x1f", ""]


@pytest.mark.parametrize("chat", [False, True])
def test_template_events_equal_json_dumps_of_the_chunk_dicts(chat):
    writer = EventWriter("cmpl-x", "m\u00e9", 1234, chat, False)
    for index in (0, 3):
        if chat:  # the first delta of a chat choice also sends the role chunk
            writer.write(index, Delta(index, [1], "first"))
        for text in TEXTS:
            got = writer.write(index, Delta(index, [7], text))
            if chat:
                chunk = rsp.chat_chunk("cmpl-x", "m\u00e9", index, {"content": text})
            else:
                chunk = rsp.completion_chunk("cmpl-x", "m\u00e9", index, Delta(index, [7], text))
            chunk["created"] = 1234
            assert got == (f"data: {json.dumps(chunk)}\n\n" if text else "")
            if text:
                parsed = json.loads(got[len("data: ") :])["choices"][0]
                assert (parsed["delta"]["content"] if chat else parsed["text"]) == text


def test_one_steps_deltas_reach_their_submissions_in_order_and_coalesce():
    """Two submissions (one of two prompts with n=2); steps published from another
    thread while the handler does not run arrive as ONE batch, in step order."""
    llm = ScriptedLLM()
    params = type("P", (), {"n": 2, "max_tokens": 5})()
    one = type("P", (), {"n": 1, "max_tokens": 3})()

    async def run():
        engine = AsyncEngine(llm.engine, llm.requests, llm.reset_prefix_cache)
        engine.start()
        a = engine.submit([([1], None, params), ([2], None, params)])
        b = engine.submit([([3], None, one)])
        published = []
        thread = threading.Thread(target=lambda: [published.extend(llm.engine.step())
                                                  for _ in range(5)])  # fmt: skip
        thread.start()
        thread.join()
        await asyncio.sleep(0.05)  # every step's call_soon_threadsafe has run
        got = {id(a): [], id(b): []}
        for sub in (a, b):
            batches = [batch async for batch in sub.batches()]
            assert len(batches) == 1  # five steps, one wake-up
            got[id(sub)] = [(p, d.index, d.token_ids[0], d.text) for p, d in batches[0]]
        for sub in (a, b):
            want = [(p, d.index, d.token_ids[0], d.text) for (s, p), d in published if s is sub]
            assert got[id(sub)] == want and want
        assert a.left == b.left == 0 and not a.items

    asyncio.run(run())


def _events(lines) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
        if line == "data: [DONE]":
            break
    return out


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_client_gone_mid_batch_is_aborted_and_the_others_lose_nothing():
    from unikv.serving.app import create_app

    llm = ScriptedLLM()
    app = create_app(llm, served_model_names=["s"], max_waiting=None)
    server = AppThread(app)
    loop = llm.engine
    try:
        body = {"model": "s", "prompt": [5], "max_tokens": 8, "n": 2, "stream": True}
        url = server.url + "/v1/completions"
        with httpx.stream("POST", url, json=dict(body, prompt=[9]), timeout=30) as kept:
            with httpx.stream("POST", url, json=body, timeout=30) as gone:
                _wait(lambda: len(loop.groups) == 2, "both requests submitted")
                loop.step()
                loop.step()  # two steps in one batch for both clients, most likely
                lines = gone.iter_lines()
                first = _events(next(lines) for _ in range(8))  # 4 events, 4 blanks
            # the gone client's connection is closed; more steps for both
            for _ in range(3):
                loop.step()
            doomed = next(g for g in loop.groups if g.ids == [5])
            _wait(lambda: doomed.aborted, "the disconnected request is aborted")
            while not all(g.done for g in loop.groups):
                loop.step()
            events = _events(kept.iter_lines())
    finally:
        server.stop()
    want = [doomed.text(i, k) for k in range(2) for i in (0, 1)]
    assert [e["choices"][0]["text"] for e in first] == want  # a prefix, in order
    keeper = next(g for g in loop.groups if g.ids == [9])
    for i in (0, 1):
        texts = [e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i]
        assert texts == [keeper.text(i, k) for k in range(8)]
    reasons = [e["choices"][0]["finish_reason"] for e in events]
    assert reasons.count("length") == 2 and reasons.count(None) == len(events) - 2


def test_streamed_chunks_parse_with_the_openai_client_and_count_usage():
    openai = pytest.importorskip("openai")
    from unikv.serving.app import create_app

    llm = ScriptedLLM()
    server = AppThread(create_app(llm, served_model_names=["s"], max_waiting=None))
    loop = llm.engine
    stop = threading.Event()

    def engine():
        while not stop.is_set():
            if any(not g.done for g in loop.groups):
                loop.step()
            time.sleep(0.001)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model="s", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                stream=True, stream_options={"include_usage": True},
            )
        )  # fmt: skip
    finally:
        stop.set()
        thread.join(5)
        server.stop()
    group = loop.groups[0]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(group.text(0, k) for k in range(4))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4 and len({c.created for c in chunks}) == 1


@pytest.mark.parametrize("ends_with_done", [True, False])
def test_the_chunk_with_done_ends_the_response_in_one_message(ends_with_done):
    """ASGI: a response ends with exactly one ``http.response.body`` whose
    ``more_body`` is False. The chunk ending with ``[DONE]`` is that message (its
    bytes and the end in one write); a stream without it gets an empty last one.
    Oracle: the ASGI message list the spec asks for, the bytes the content gave."""
    from unikv.serving.sse import DONE, EventStream

    parts = [b"data: 1\n\n", b"data: 2\n\n" + (DONE.encode() if ends_with_done else b"")]

    async def content():
        for part in parts:
            yield part

    async def run():
        sent, closed = [], []
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await EventStream(content(), on_close=lambda: closed.append(1))(
            {"type": "http"}, receive, send
        )
        return sent, closed

    sent, closed = asyncio.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = sent[1:]
    assert all(m["type"] == "http.response.body" for m in bodies)
    assert [m["more_body"] for m in bodies].count(False) == 1 and not bodies[-1]["more_body"]
    assert b"".join(m["body"] for m in bodies) == b"".join(parts)
    assert len(bodies) == (2 if ends_with_done else 3)
    assert closed  # on_close ran once the stream ended
