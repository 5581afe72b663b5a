"""Fuzzing every field of ``/v1/completions`` and ``/v1/chat/completions``.

Each example starts from a valid body and sets one field (a top-level one, or
one of the first message's) to a value drawn from every JSON type: null, bools,
ints up to far beyond int64, floats with NaN and the infinities (sent as the
``NaN`` / ``Infinity`` literals Python writes), unicode strings (lone
surrogates included), lists and objects of those. Whole bodies are fuzzed too:
arbitrary bytes (not UTF-8, not JSON) and JSON that is not an object.

Oracle: the server answers 200 or a 4xx, never a 5xx; a 4xx is OpenAI-shaped
(``error.message``, ``type``, ``param``, ``code``) and a 400 names the fuzzed
field; a 200 stream ends with ``[DONE]`` and no error event. Afterwards the
server is healthy and a greedy request's text equals ``LLM.generate``'s,
computed before the server started.
"""

from __future__ import annotations

import json

import httpx
import pytest
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_fixtures import AppThread, save_instruct_llama

from unikv.engine import LLM, SamplingParams
from unikv.serving.app import create_app
from unikv.serving.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN = 48
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
MESSAGE_FIELDS = ["role", "content", "name"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, LLM, the greedy text of the health probe) of an in-process server."""
    path = str(tmp_path_factory.mktemp("instruct"))
    save_instruct_llama(path)
    llm = LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN, max_num_seqs=8)
    want = llm.generate("Hello", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    app = AppThread(create_app(llm, served_model_names=["tiny"]))
    try:
        yield app.url, llm, want[0].outputs[0].text
    finally:
        app.stop()


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 20, 21, 64, 65, 2**31, 2**63 - 1, 2**63, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 1.0, 2.0, -0.0, 1e-300, 1e300, 3.5]),
    st.text(max_size=12),  # any code point, lone surrogates included
    st.sampled_from(["", "10", "2", "yes", "true", "null", "tiny", "\x00", "é😀"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _post(url: str, route: str, raw: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}/v1/{route}", content=raw, headers=headers, timeout=120)


def _check(response: httpx.Response, body, field: str | None) -> None:
    code = response.status_code
    assert code == 200 or 400 <= code < 500, (code, body, response.text[:300])
    if code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == code and error["message"], error
        if code == 400:
            assert error["type"] == "invalid_request_error", error
            if field is not None and error["param"] is not None:
                assert error["param"] in (field, "messages", "prompt", "model"), (field, error)
        return
    if '"stream": true' in body:
        lines = [x for x in response.text.splitlines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"error"' not in response.text, response.text


def _fields(model) -> list[str]:
    return sorted(model.model_fields) + ["stream_options.include_usage", "unknown_field"]


@SETTINGS
@given(data=st.data())
def test_completions_fields(served, data):
    url = served[0]
    field = data.draw(st.sampled_from(_fields(CompletionRequest)), label="field")
    body = dict(COMPLETION)
    value = data.draw(values, label="value")
    if field.startswith("stream_options."):
        body["stream_options"] = {"include_usage": value}
    else:
        body[field] = value
    raw = json.dumps(body)  # NaN / Infinity literals included
    top = field.split(".")[0]
    _check(_post(url, "completions", raw.encode("utf-8", "surrogatepass")), raw, top)


@SETTINGS
@given(data=st.data())
def test_chat_completions_fields(served, data):
    url = served[0]
    fields = _fields(ChatCompletionRequest) + [f"messages.0.{f}" for f in MESSAGE_FIELDS]
    field = data.draw(st.sampled_from(fields), label="field")
    body = json.loads(json.dumps(CHAT))
    value = data.draw(values, label="value")
    if field.startswith("messages.0."):
        body["messages"][0][field.rsplit(".", 1)[1]] = value
    elif field.startswith("stream_options."):
        body["stream_options"] = {"include_usage": value}
    else:
        body[field] = value
    raw = json.dumps(body)
    top = field.split(".")[0]
    _check(_post(url, "chat/completions", raw.encode("utf-8", "surrogatepass")), raw, top)


@SETTINGS
@given(raw=st.one_of(st.binary(max_size=40), values.map(lambda v: json.dumps(v).encode())))
def test_whole_bodies(served, raw):
    url = served[0]
    for route in ("completions", "chat/completions"):
        r = _post(url, route, raw)
        assert 400 <= r.status_code < 500, (raw, r.status_code, r.text[:200])
        assert r.json()["error"]["type"] == "invalid_request_error"


REFUSED = [
    ("completions", {"seed": 123456789012345678901234567890}, "seed"),
    ("completions", {"seed": -(2**63) - 1}, "seed"),
    ("completions", {"max_tokens": "10"}, "max_tokens"),
    ("completions", {"n": "2"}, "n"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"prompt": [True, False]}, "prompt"),
    ("completions", {"temperature": float("nan")}, "temperature"),
    ("completions", {"top_p": float("inf")}, "top_p"),
    ("completions", {"max_tokens": 2**40}, "max_tokens"),
    ("completions", {"max_tokens": -1}, "max_tokens"),
    ("completions", {"n": 65}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"stop_token_ids": [10**6]}, "stop_token_ids"),
    ("chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat/completions", {"logprobs": 1}, "logprobs"),
    ("chat/completions", {"messages": [{"role": 1, "content": "x"}]}, "messages"),
]


def test_each_bad_value_is_a_400_naming_the_field_what_it_expects_and_what_it_got(served):
    url, _, want = served
    for route, change, field in REFUSED:
        body = dict(COMPLETION if route == "completions" else CHAT, **change)
        r = _post(url, route, json.dumps(body).encode())
        assert r.status_code == 400, (change, r.text)
        error = r.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error", error
        assert error["message"].startswith(field) and "got" in error["message"], error
    for raw in (b"\xff\xfe{}", b'{"model": "tiny", ', b"[]"):
        r = _post(url, "completions", raw)
        assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "seed": 2**63 - 1}  # fmt: skip
    r = _post(url, "completions", json.dumps(body).encode())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_the_server_is_healthy_and_right_after_the_fuzzing(served):
    url, llm, want = served
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = _post(url, "completions", json.dumps(body).encode())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert llm.engine.running and llm.engine.error is None
