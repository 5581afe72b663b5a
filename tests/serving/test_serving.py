"""``unikv serve`` in a subprocess on a loopback port, driven by the official
``openai`` client.

Oracles: the same checkpoint run in-process through ``LLM.generate`` /
``LLM.chat`` (greedy text, n seeded samples, stop strings), transformers'
logits (logprobs), the same request sent alone (32 concurrent clients), and the
server's own /metrics (no live pages after a client disconnects).
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest
import torch
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import ServerProcess, metric_values, save_instruct_llama

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
openai = pytest.importorskip("openai")
PROMPTS = [
    "Hello, how are you",
    "The quick brown fox",
    "unikv serves models over one",
    "A stop string",
]
MAX_LEN = 128


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("instruct"))
    hf = save_instruct_llama(path)
    llm = LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN)
    return path, hf, llm


@pytest.fixture(scope="module")
def server(ckpt):
    path = ckpt[0]
    # prefix caching off (its default is on for this attention-only model): the pool
    # checks read live pages, which the cache would keep; test_reset_prefix_cache_endpoint
    # runs a server with the default
    # the engine in its own process (the default), each step 10 ms at least: the
    # disconnect test's 100-token stream is still running when the client has read two
    # events (an engine process of its own finishes a tiny model's stream at once)
    proc = ServerProcess(path, "--max-model-len", str(MAX_LEN), "--served-model-name", "tiny",
                         "--no-enable-prefix-caching", "--enable-admin-routes",
                         env={"UNIKV_TEST_ENGINE_FAULT": "step-delay-ms:10"})  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_greedy_completion_equals_generate_and_streams_the_same_text(ckpt, client):
    _, _, llm = ckpt
    want = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0))
    for prompt, ref in zip(PROMPTS, want):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        choice = got.choices[0]
        assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
        assert got.usage.completion_tokens == len(ref.output_ids)
        assert got.usage.prompt_tokens == len(ref.prompt_ids)
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    both = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=16, temperature=0)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [
        r.text for r in want[:2]
    ]


def test_chat_plain_and_streamed_agree(ckpt, client):
    _, _, llm = ckpt
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0.0))[0]
    plain = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0
    )
    assert plain.choices[0].message.content == want.text
    assert plain.choices[0].message.role == "assistant"
    assert plain.usage.prompt_tokens == len(want.prompt_ids)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(want.output_ids)


def test_n_with_a_seed_is_reproducible(ckpt, client):
    _, _, llm = ckpt
    kw = {
        "model": "tiny",
        "prompt": PROMPTS[1],
        "max_tokens": 10,
        "temperature": 1.0,
        "n": 2,
        "seed": 11,
    }
    one = client.completions.create(**kw)
    two = client.completions.create(**kw)
    texts = [c.text for c in sorted(one.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(two.choices, key=lambda c: c.index)]
    assert len(texts) == 2 and texts[0] != texts[1]
    ref = llm.generate(PROMPTS[1], SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=11))
    assert texts == [c.text for c in ref[0].outputs]


def test_stop_strings_cut_at_the_right_place(ckpt, client):
    _, _, llm = ckpt
    full = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    )[0].text
    stop = full[5:8]
    want = full[: full.find(stop)]
    kw = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0, "stop": [stop]}
    got = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    stream = client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == want


def test_a_default_max_tokens_is_clamped_to_the_context_left(ckpt, client):
    """No max_tokens: completions' default 16 and chat's none become the room the
    prompt leaves (vLLM's), with the text of LLM.generate given that budget."""
    _, _, llm = ckpt
    vocab = llm.config.vocab_size
    ids = [3 + (7 * i) % (vocab - 3) for i in range(MAX_LEN - 5)]  # no special ids
    want = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    got = client.completions.create(model="tiny", prompt=ids, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert got.usage.completion_tokens == 5 and got.choices[0].finish_reason == "length"
    assert got.choices[0].text == want[0].outputs[0].text
    messages = [{"role": "user", "content": "The quick brown fox"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    room = MAX_LEN - chat.usage.prompt_tokens
    ref = llm.chat(messages, SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True))
    assert chat.usage.completion_tokens == room and chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.content == ref[0].outputs[0].text


def test_logprobs_match_the_models_logits(ckpt, client):
    _, hf, llm = ckpt
    ref = llm.generate(PROMPTS[2], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))[
        0
    ]
    got = client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    lp = got.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ref.output_ids]
    with torch.no_grad():
        rows = hf(torch.tensor([ref.prompt_ids + ref.output_ids])).logits[0].log_softmax(-1)
    for j, tok in enumerate(ref.output_ids):
        row = rows[len(ref.prompt_ids) - 1 + j]
        assert math.isclose(lp.token_logprobs[j], row[tok].item(), abs_tol=1e-4)
        top = row.topk(2)
        want = {f"token_id:{i}": v for i, v in zip(top.indices.tolist(), top.values.tolist())}
        assert lp.top_logprobs[j] == pytest.approx(want, abs=1e-4)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=1,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(c.top_logprobs[0].logprob == c.logprob for c in content)


def test_32_concurrent_clients_get_the_text_they_get_alone(ckpt, server):
    _, _, llm = ckpt
    prompts = [f"{PROMPTS[i % 4]} {'x' * (i % 7)}" for i in range(32)]
    alone = [
        llm.generate(p, SamplingParams(max_tokens=8, temperature=0.0))[0].text for p in prompts
    ]

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0
        )
        calls = [
            aclient.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
            for p in prompts
        ]
        results = await asyncio.wait_for(asyncio.gather(*calls), timeout=120)
        return [r.choices[0].text for r in results]

    assert asyncio.run(run()) == alone


def _pool_metrics(server) -> tuple[dict, float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return metric_values(text, "unikv:subpool_live_pages"), metric_values(
        text, "vllm:num_requests_running"
    )[""]


def test_a_client_that_disconnects_mid_stream_leaves_no_live_pages(server, client):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(4)]  # two events and their blank lines
        live, running = _pool_metrics(server)
        assert running == 1 and sum(live.values()) > 0  # it holds pages mid-stream
    assert first[0].startswith("data: ")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        live, running = _pool_metrics(server)
        if running == 0 and sum(live.values()) == 0:
            break
        time.sleep(0.1)
    assert running == 0 and set(live.values()) == {0.0} and live
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert metric_values(text, "vllm:request_success_total").get('{finished_reason="abort"}') == 1
    ok = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


BAD = [
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("completions", {"prompt": "hello " * 200}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [[1, 2], [999999]]}, "prompt"),
    ("completions", {"prompt": "hi", "stop_token_ids": ["x"]}, "stop_token_ids"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -2},
     "max_tokens"),
]  # fmt: skip


def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(server, client):
    for path, body, param in BAD:
        body = {"model": "tiny", **body}
        r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == 400, (body, error)
        assert error["message"]
    # an unknown model: OpenAI's 404 (not a 400), naming the served models
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    error = r.json()["error"]
    assert r.status_code == 404 and error["param"] == "model" and error["code"] == 404, error
    assert "'tiny'" in error["message"]
    for raw in ('{"model": "tiny", "prompt": "hi", "temperature": NaN}', "{not json"):
        r = httpx.post(
            f"{server.url}/v1/completions",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert "max_tokens" in str(err.value)
    assert server.alive()
    ok = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_a_full_admission_queue_answers_503(ckpt):
    """One request runs (max_num_seqs 1) and one waits (max_waiting 1): a third is
    refused with an OpenAI-style 503 at once, and served once there is room."""
    proc = ServerProcess(
        ckpt[0], "--max-model-len", "256", "--max-num-seqs", "1", "--max-waiting", "1"
    )
    try:
        body = {"model": ckpt[0], "prompt": "Hello", "max_tokens": 200, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        url = proc.url + "/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as first:
            lines = first.iter_lines()  # (kept: a dropped iterator closes the stream)
            assert next(lines).startswith("data: ")  # the first request runs
            with httpx.stream("POST", url, json=body, timeout=60) as second:
                refused = httpx.post(url, json=dict(body, stream=False), timeout=30)
                assert refused.status_code == 503, refused.text
                assert "admission queue is full" in refused.json()["error"]["message"]
                assert second.status_code == 200
        short = httpx.post(url, json=dict(body, stream=False, max_tokens=2), timeout=60)
        assert short.status_code == 200
    finally:
        proc.stop()


def test_reset_prefix_cache_endpoint(ckpt, server):
    """POST /reset_prefix_cache (vLLM's): with caching on, after a repeated prompt
    hit (``usage.prompt_tokens_details.cached_tokens`` is the hit /metrics counted),
    the cache holds no page afterwards (read off /metrics) and the next repeat hits
    nothing but gives the same text; without caching it is a 400 that says how to
    turn caching on. The server under test starts with the default: caching is on
    for this attention-only model without --enable-prefix-caching."""
    refused = httpx.post(server.url + "/reset_prefix_cache", json={}, timeout=30)
    assert refused.status_code == 400 and "--enable-prefix-caching" in refused.text
    proc = ServerProcess(ckpt[0], "--max-model-len", str(MAX_LEN), "--enable-admin-routes")
    try:
        body = {"model": ckpt[0], "prompt": PROMPTS[0] * 3, "max_tokens": 4, "temperature": 0}
        post = lambda: httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
        stats = lambda name: metric_values(httpx.get(proc.url + "/metrics", timeout=30).text, name)[
            ""
        ]
        first, second = post().json(), post().json()
        hits = stats("vllm:prefix_cache_hits_total")
        assert hits > 0 and stats("unikv:prefix_cache_pages") > 0
        cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in (first, second)]
        assert cached == [0, hits]  # OpenAI's usage field: the second request's hit
        reset = httpx.post(proc.url + "/reset_prefix_cache", json={}, timeout=30)
        assert reset.status_code == 200 and reset.json() == {"reset": True}
        assert stats("unikv:prefix_cache_pages") == 0
        third = post().json()
        texts = [b["choices"][0]["text"] for b in (first, second, third)]
        assert texts == [texts[0]] * 3
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert stats("vllm:prefix_cache_hits_total") == hits  # a miss after the reset
    finally:
        proc.stop()
