"""``unikv serve`` with the engine in its own process (the default): a failure
inside the engine stays with its request; the engine process killed mid-stream
gives the in-flight requests OpenAI-shaped errors, ``/health`` 503 and the
server a non-zero exit within seconds.

Oracles: ``LLM.generate`` in this process (the other requests' text), the
poisoned forward's own message in the failed request's error, the server
process's exit status.
"""

from __future__ import annotations

import asyncio
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


def test_the_engine_process_ends_when_the_server_process_dies(tmp_path):
    """The server process dies (os._exit) once its engine process has read its
    setup and is loading the model (its ZeroMQ threads are up): the engine, whose
    'ready' nobody takes, ends by itself instead of hanging on as an orphan
    holding the device."""
    import subprocess
    import sys

    path = str(tmp_path)
    save_instruct_llama(path)
    parent = (
        "import sys, os\n"
        "from unikv.serving.engine_client import ProcEngine\n"
        f"e = ProcEngine({{'model': {path!r}, 'device': 'cpu', 'page_size': 4, "
        "'max_model_len': 64}, wait=False)\n"
        "print(e.pid, flush=True)\n"
        "import time\n"
        "end = time.monotonic() + 60\n"
        "while time.monotonic() < end and not any(\n"
        "        open(f'/proc/{e.pid}/task/{t}/comm').read().startswith('ZMQbg')\n"
        "        for t in os.listdir(f'/proc/{e.pid}/task')):\n"
        "    time.sleep(0.05)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 90  # its start-up, then one send timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                return  # ended; a zombie until init reaps it
        time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the orphaned engine process did not end")


def test_switch_interval_reaches_the_engine_process(tmp_path):
    """``--switch-interval-ms``: the engine process runs with the interval the API process
    set (read back from the child's own ``sys.getswitchinterval`` in its ready message);
    a value that is not a positive number of milliseconds is refused, naming the flag."""
    from unikv.serving.cli import serve_main, switch_interval_s
    from unikv.serving.engine_client import ProcEngine

    path = str(tmp_path)
    save_instruct_llama(path)
    config = {"model": path, "device": "cpu", "page_size": 4, "max_model_len": MAX_LEN}
    engine = ProcEngine(config, switch_interval=0.00123).wait_ready()
    try:
        assert engine.info["switch_interval"] == pytest.approx(0.00123)
        assert engine.info["pid"] != os.getpid()
    finally:
        engine.close()
    assert switch_interval_s(0.5) == 0.0005
    for bad in (0.0, -1.0, float("nan"), 5000.0):
        with pytest.raises(ValueError, match="--switch-interval-ms must be in"):
            switch_interval_s(bad)
    assert serve_main(["--model", path, "--switch-interval-ms", "0"]) == 2


def test_steps_drained_together_carry_generates_tokens_and_text(tmp_path):
    """The event loop reads the engine process's step messages itself: when it is
    busy, several steps queue and one wake-up drains them all (one dispatch); each
    completion still gets exactly ``LLM.generate``'s tokens and text, in order.
    Oracle: ``LLM.generate`` in this process with the same options."""
    from unikv.serving.engine_client import ProcEngine

    path = str(tmp_path)
    save_instruct_llama(path)
    llm = LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = llm.generate(PROMPTS, params)
    llm.close()
    prompts = [o.prompt_token_ids for o in want]
    config = {"model": path, "device": "cpu", "page_size": 4, "max_model_len": MAX_LEN}
    engine = ProcEngine(config)

    async def run():
        engine.start()
        subs = [await engine.asubmit([(ids, None, params)]) for ids in prompts]
        time.sleep(1.0)  # noqa: ASYNC251  (the loop busy on purpose: the steps queue meanwhile)
        got = []
        for sub in subs:
            ids, text = [], []
            async for batch in sub.batches():
                for _, delta in batch:
                    ids += delta.token_ids
                    text.append(delta.text)
            got.append((ids, "".join(text)))
        return got

    try:
        got = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [g[0] for g in got] == [o.outputs[0].token_ids for o in want]
    assert [g[1] for g in got] == [o.outputs[0].text for o in want]
