"""A burst of short chat requests is prepared on the event loop (``app.cheap_chat``:
no thread hop to the tokenizer pool per request), and a long or tool-carrying one
still goes to the pool (issue 40).

Oracles: ``LLM.generate`` on prompt ids rendered by transformers' own
``apply_chat_template`` and tokenized by the tokenizer itself (not the server's
``PromptMaker``); the tokenizer pool spied on (its ``submit`` calls counted); the
same burst with one malformed request in it (it alone gets its 400).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import AppThread, save_instruct_llama

from unikv.engine import LLM, SamplingParams
from unikv.serving.app import INLINE_PROMPT, cheap_chat, create_app
from unikv.serving.protocol import ChatCompletionRequest

pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = ["The quick brown fox", "Hello, how are you", "unikv serves", "A stop string"]
BURST, NEW, MAX_LEN = 8, 6, 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    save_instruct_llama(path)
    return path


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"{WORDS[i % len(WORDS)]} {i}"}]


def _body(i: int, **extra) -> dict:
    return {"model": "tiny", "messages": _messages(i), "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip


class CountedPool:
    """The tokenizer pool, its ``submit`` calls counted."""

    def __init__(self, pool) -> None:
        self.pool, self.calls = pool, 0

    def submit(self, *args, **kwargs):
        self.calls += 1
        return self.pool.submit(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.pool, name)


async def _burst(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(
            *(client.post(url + "/v1/chat/completions", json=b) for b in bodies)
        )


def test_a_chat_burst_is_prepared_on_the_loop_and_equals_generate(model_dir):
    llm = LLM(model_dir, device="cpu", page_size=4, max_model_len=MAX_LEN, max_num_seqs=16)
    app = create_app(llm, served_model_names=["tiny"], max_waiting=None)
    server = app.state.server
    pool = server.tokenize_pool = CountedPool(server.tokenize_pool)
    bad = 3  # continue_final_message with add_generation_prompt: a 400 of its own
    bodies = [_body(i) for i in range(BURST)]
    bodies[bad] = _body(bad, continue_final_message=True)
    http = AppThread(app)
    try:
        got = asyncio.run(_burst(http.url, bodies))
    finally:
        http.stop()
    assert pool.calls == 0  # no request of the burst went through the pool
    assert got[bad].status_code == 400, got[bad].text
    assert got[bad].json()["error"]["param"] == "continue_final_message"
    tok = llm.tokenizer
    ids = [
        tok.encode(tok.apply_chat_template(_messages(i), tokenize=False,
                                           add_generation_prompt=True),
                   add_special_tokens=False)
        for i in range(BURST) if i != bad
    ]  # fmt: skip
    ref = LLM(model_dir, device="cpu", page_size=4, max_model_len=MAX_LEN)
    want = ref.generate(ids, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    good = [r for i, r in enumerate(got) if i != bad]
    assert all(r.status_code == 200 for r in good), [r.text for r in good]
    for r, w in zip(good, want):
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(w.prompt_ids)
        assert body["usage"]["completion_tokens"] == NEW
        assert body["choices"][0]["message"]["content"] == w.text


def test_long_or_tool_chats_go_to_the_pool(model_dir):
    def req(**kw) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"model": "tiny", **kw})

    short = [{"role": "user", "content": "hi"}]
    assert cheap_chat(req(messages=short))
    assert cheap_chat(req(messages=[{"role": "user", "content": "x" * INLINE_PROMPT}]))
    over = [{"role": "system", "content": "x" * (INLINE_PROMPT // 2)},
            {"role": "user", "content": "y" * (INLINE_PROMPT // 2 + 1)}]  # fmt: skip
    assert not cheap_chat(req(messages=over))  # the messages' characters in all
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert not cheap_chat(req(messages=short, tools=[tool]))
    assert not cheap_chat(req(messages=short, chat_template="{{ messages }}"))
    assert not cheap_chat(req(messages=short, response_format={"type": "json_object"}))
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert not cheap_chat(req(messages=parts))
    called = [{"role": "assistant", "content": None, "tool_calls": []}]
    assert not cheap_chat(req(messages=short + called))
    # the pool path runs such a request: the real app, its pool counted
    llm = LLM(model_dir, device="cpu", page_size=4, max_model_len=MAX_LEN, max_num_seqs=4)
    app = create_app(llm, served_model_names=["tiny"], max_waiting=None)
    server = app.state.server
    pool = server.tokenize_pool = CountedPool(server.tokenize_pool)
    http = AppThread(app)
    try:
        got = asyncio.run(_burst(http.url, [_body(0, chat_template_kwargs={"x": 1}), _body(1)]))
    finally:
        http.stop()
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    assert pool.calls == 1  # the one with template variables
    ref = LLM(model_dir, device="cpu", page_size=4, max_model_len=MAX_LEN)  # (served: shut)
    want = ref.chat(_messages(0), SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    assert got[0].json()["choices"][0]["message"]["content"] == want[0].outputs[0].text
