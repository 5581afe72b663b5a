"""``unikv serve`` with the engine in its own process (the default): a failure
inside the engine stays with its request; the engine process killed mid-stream
gives the in-flight requests OpenAI-shaped errors, ``/health`` 503 and the
server a non-zero exit within seconds.

Oracles: ``LLM.generate`` in this process (the other requests' text), the
poisoned forward's own message in the failed request's error, the server
process's exit status.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import ServerProcess, save_instruct_llama

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN = 128
PROMPTS = ["Hello, how are you", "The quick brown fox", "A stop string", "unikv serves"]
MARKER = 1  # <|im_start|> (serving_fixtures.SPECIALS): the poisoned forward raises on it


def _events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_failure_isolation_then_engine_kill(tmp_path):
    path = str(tmp_path)
    save_instruct_llama(path)
    llm = LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN)
    assert llm.tokenizer.convert_tokens_to_ids("<|im_start|>") == MARKER
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    poisoned = llm.tokenizer.encode("Hello") + [MARKER]
    fault = f"poison-token:{MARKER},step-delay-ms:10"
    proc = ServerProcess(path, "--max-model-len", str(MAX_LEN), "--served-model-name", "tiny",
                         env={"UNIKV_TEST_ENGINE_FAULT": fault})  # fmt: skip
    url = proc.url + "/v1/completions"
    base = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def good(prompt):
        return httpx.post(url, json=dict(base, prompt=prompt), timeout=60)

    def bad_stream():
        with httpx.stream("POST", url, json=dict(base, prompt=poisoned, stream=True),
                          timeout=60) as r:  # fmt: skip
            return r.status_code, _events(r)

    try:
        # 1. one poisoned request among good ones: it alone fails, with the forward's error
        with ThreadPoolExecutor(6) as pool:
            goods = [pool.submit(good, p) for p in PROMPTS]
            plain = pool.submit(lambda: httpx.post(url, json=dict(base, prompt=poisoned),
                                                   timeout=60))  # fmt: skip
            stream = pool.submit(bad_stream)
            texts = [f.result().json()["choices"][0]["text"] for f in goods]
            plain, (code, events) = plain.result(), stream.result()
        assert texts == want
        assert plain.status_code == 500, plain.text
        error = plain.json()["error"]
        assert "poisoned input" in error["message"] and error["code"] == 500
        assert code == 200 and events[-1] == "[DONE]"
        assert "poisoned input" in events[-2]["error"]["message"]
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
        assert good(PROMPTS[1]).json()["choices"][0]["text"] == want[1]

        # 2. the engine process killed mid-stream: the stream ends with an error event and
        # [DONE], a request in flight gets an error body, /health 503, the server exits 1
        long = dict(base, prompt=PROMPTS[0], max_tokens=100)
        with ThreadPoolExecutor(1) as pool:
            with httpx.stream("POST", url, json=dict(long, stream=True), timeout=60) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # it runs
                waiting = pool.submit(lambda: httpx.post(url, json=long, timeout=60))
                time.sleep(0.3)
                os.kill(proc.engine_pid(), signal.SIGKILL)
                killed = time.monotonic()
                rest = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]"
                        for x in lines if x.startswith("data: ")]  # fmt: skip
            answer = waiting.result()
        assert rest[-1] == "[DONE]" and "engine process" in rest[-2]["error"]["message"]
        assert answer.status_code in (500, 503), answer.text
        assert "engine process" in answer.json()["error"]["message"]
        try:
            health = httpx.get(proc.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            health = None  # already exiting
        assert health in (503, None)
        assert proc.proc.wait(timeout=15) == 1
        assert time.monotonic() - killed < 15
    finally:
        out = proc.stop()
    assert "exited with status -9" in out, out[-2000:]


def test_stop_completion_ends_one_completion_and_frees_its_pages(tmp_path):
    """``EngineLoop.stop_completion`` (the engine process's answer to a stop string
    the API process found): that completion ends with "stop" and a prefix of its
    tokens, its sibling runs on to the tokens ``LLM.generate`` gives it, and no
    page stays live."""
    from unikv.serving.metrics import engine_snapshot

    path = str(tmp_path)
    save_instruct_llama(path)
    llm = LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN, enable_prefix_caching=False)
    params = SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    want = llm.generate(PROMPTS[0], params)[0].outputs
    got: list = []
    (group,) = llm.make_groups(PROMPTS[0], params, sink=got.append)
    loop = llm.engine
    loop.submit_all([group])
    for _ in range(4):
        loop.step()
    loop.stop_completion(group, 0)
    while loop.step() is not None:
        pass
    ids = {i: [t for d in got if d.index == i for t in d.token_ids] for i in (0, 1)}
    reasons = {d.index: d.finish_reason for d in got if d.finish_reason is not None}
    assert reasons == {0: "stop", 1: "length"}
    assert 0 < len(ids[0]) < 20 and ids[0] == want[0].token_ids[: len(ids[0])]
    assert ids[1] == want[1].token_ids
    snap = engine_snapshot(llm)
    assert snap["running"] == 0 and snap["waiting"] == 0
    assert all(s["live_pages"] == 0 for s in snap["subpools"].values())
