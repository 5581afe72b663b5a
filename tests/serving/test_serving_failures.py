"""``unikv serve``'s failures stay with their request.

- A forward that raises for one request (a marker token id in its prompt): that
  request alone gets a 500 (non-streamed) or an error event (streamed); the
  concurrent others get the text of an un-poisoned ``LLM.generate``.
- The engine loop dying (the test-only ``UNIKV_TEST_ENGINE_FAULT`` hook):
  ``/health`` answers 503 and the process exits non-zero within seconds.
- Admission: a 300-prompt request on an idle server with ``--max-waiting 2`` is
  queued whole; a full queue answers 503 with ``Retry-After``; ``--max-waiting 0``
  means no bound and a negative value is refused at start-up.

Servers bind 127.0.0.1 only and are stopped by the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import AppThread, ScriptedLLM, ServerProcess, save_instruct_llama

from unikv.engine import LLM, SamplingParams
from unikv.serving.app import create_app

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN = 64
PROMPTS = ["Hello, how are you", "The quick brown fox", "A stop string", "unikv serves"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("instruct"))
    save_instruct_llama(path)
    return path


def _llm(path: str) -> LLM:
    return LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN, max_num_seqs=8)


class Poison:
    """The forward raises when the marker id is fed (the poisoned prompt's prefill)."""

    def __init__(self, model, marker: int) -> None:
        self.model, self.marker = model, marker

    def __call__(self, input_ids, *args, **kwargs):
        if bool((input_ids == self.marker).any()):
            raise RuntimeError("poisoned input")
        return self.model(input_ids, *args, **kwargs)


def _events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_failing_request_gets_an_error_and_the_others_their_text(ckpt):
    llm = _llm(ckpt)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    marker = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = llm.tokenizer.encode("Hello") + [marker]
    llm.runner.model = Poison(llm.runner.model, marker)
    app = AppThread(create_app(llm, served_model_names=["tiny"]))
    url = app.url + "/v1/completions"
    base = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def good(prompt):
        return httpx.post(url, json=dict(base, prompt=prompt), timeout=60)

    def bad_plain():
        return httpx.post(url, json=dict(base, prompt=ids), timeout=60)

    def bad_stream():
        with httpx.stream("POST", url, json=dict(base, prompt=ids, stream=True), timeout=60) as r:
            return r.status_code, _events(r)

    try:
        with ThreadPoolExecutor(6) as pool:
            goods = [pool.submit(good, p) for p in PROMPTS]
            plain, stream = pool.submit(bad_plain), pool.submit(bad_stream)
            texts = [f.result().json()["choices"][0]["text"] for f in goods]
            plain, (code, events) = plain.result(), stream.result()
        assert texts == want
        assert plain.status_code == 500, plain.text
        error = plain.json()["error"]
        assert "poisoned input" in error["message"] and error["code"] == 500
        assert code == 200 and events[-1] == "[DONE]"
        assert "poisoned input" in events[-2]["error"]["message"]
        assert httpx.get(app.url + "/health", timeout=10).status_code == 200
        assert good(PROMPTS[1]).json()["choices"][0]["text"] == want[1]
        assert llm.engine.num_failed_requests == 2
    finally:
        app.stop()


def test_engine_death_gives_503_and_a_non_zero_exit(ckpt):
    """The loop dies at its 2nd step: the request in flight gets an error, /health
    answers 503 (or the server is already gone) and the process exits with
    status 1 within seconds, so that a supervisor restarts it."""
    os.environ["UNIKV_TEST_ENGINE_FAULT"] = "die-after-steps:2"
    try:
        proc = ServerProcess(ckpt, "--max-model-len", str(MAX_LEN))
    finally:
        del os.environ["UNIKV_TEST_ENGINE_FAULT"]
    try:
        body = {"model": ckpt, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code in (500, 503) and "injected engine fault" in r.text, r.text
        try:
            health = httpx.get(proc.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            health = None  # already exiting
        assert health in (503, None)
        rc = proc.proc.wait(timeout=15)
        assert rc == 1, proc.stop()
    finally:
        out = proc.stop()
    assert "the engine loop died" in out


def test_a_request_larger_than_the_queue_is_queued_and_a_full_queue_says_retry_after(ckpt):
    # each engine step 10 ms at least: the first 200-token stream still runs while the
    # next three are sent (an engine process of its own would finish it at once)
    proc = ServerProcess(ckpt, "--max-model-len", "256", "--max-num-seqs", "1",
                         "--max-waiting", "2",
                         env={"UNIKV_TEST_ENGINE_FAULT": "step-delay-ms:10"})  # fmt: skip
    try:
        url = proc.url + "/v1/completions"
        many = {"model": ckpt, "prompt": [f"hi {i}" for i in range(300)], "max_tokens": 1}
        r = httpx.post(url, json=many, timeout=120)
        assert r.status_code == 200, r.text
        assert sorted(c["index"] for c in r.json()["choices"]) == list(range(300))
        long = {"model": ckpt, "prompt": "Hello", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", url, json=long, timeout=60) as first:
            lines = first.iter_lines()  # (kept: a dropped iterator closes the stream)
            assert next(lines).startswith("data: ")  # it runs (max_num_seqs 1)
            with (
                httpx.stream("POST", url, json=long, timeout=60) as second,
                httpx.stream("POST", url, json=long, timeout=60) as third,
            ):  # two wait: the queue is full
                refused = httpx.post(url, json=dict(long, stream=False), timeout=30)
                assert refused.status_code == 503, refused.text
                assert refused.headers.get("retry-after") == "1"
                error = refused.json()["error"]
                assert error["code"] == 503 and "retry later" in error["message"]
                assert second.status_code == third.status_code == 200
    finally:
        proc.stop()


def test_max_waiting_zero_is_no_bound_and_a_negative_one_is_refused(ckpt):
    bad = subprocess.run(
        [sys.executable, "-m", "unikv.cli", "serve", "--model", ckpt, "--max-waiting", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "--max-waiting" in bad.stderr and ">= 0" in bad.stderr
    scripted = ScriptedLLM()
    create_app(scripted, served_model_names=["x"], max_waiting=0)
    assert scripted.engine.max_waiting is None  # create_app's 0: no bound too
    with pytest.raises(ValueError, match="max_waiting"):
        create_app(ScriptedLLM(), served_model_names=["x"], max_waiting=-1)
    # the engine in a thread of the server (--in-process-engine): the CLI's other mode
    proc = ServerProcess(ckpt, "--max-model-len", str(MAX_LEN), "--max-waiting", "0",
                         "--in-process-engine")  # fmt: skip
    try:
        body = {"model": ckpt, "prompt": ["a", "b", "c"], "max_tokens": 2, "temperature": 0}
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        with pytest.raises(AssertionError, match="no engine process"):
            proc.engine_pid()
    finally:
        out = proc.stop()
    assert "engine in this process" in out


def test_memory_pressure_makes_requests_wait_never_fail(ckpt):
    """A pool about one request's worth of pages, twelve concurrent requests:
    each gets 200 and the text of an unconstrained ``LLM.generate`` (the
    scheduler preempts and requeues; nobody gets a 500 or a 503)."""
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(12)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in _llm(ckpt).generate(prompts, params)]
    llm = LLM(ckpt, device="cpu", page_size=4, max_model_len=MAX_LEN, max_num_seqs=8,
              kv_cache_bytes=40960, enable_prefix_caching=False)  # fmt: skip
    app = AppThread(create_app(llm, served_model_names=["tiny"], max_waiting=None))
    body = {"model": "tiny", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda p: httpx.post(app.url + "/v1/completions",
                                    json=dict(body, prompt=p), timeout=120), prompts))  # fmt: skip
        assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers]
        assert [r.json()["choices"][0]["text"] for r in answers] == want
        assert llm.scheduler.num_preemptions > 0  # the pool was short
    finally:
        app.stop()
