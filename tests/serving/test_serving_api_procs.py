"""``unikv serve --api-server-count 2``: two API processes share the port in
front of one engine process.

Oracles: ``LLM.generate`` in this process (every completion's text, streamed or
not, through the official ``openai`` client on many connections); the server's
process tree read from ``/proc`` (which API processes exist, their pids); the
client's own counts of what it sent and got (the metrics of any process must add
up to them); the processes' exit statuses and their own output.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import ServerProcess, metric_values, save_instruct_llama

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN = 128
PROMPTS = ["Hello, how are you", "The quick brown fox", "Pages move, requests keep", "unikv"]
KEY = "sk-api-procs"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint dir, {prompt: 8 greedy tokens' text}, {prompt: 100 tokens' text})."""
    path = str(tmp_path_factory.mktemp("api-procs"))
    save_instruct_llama(path)
    llm = LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN)
    short, long = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (8, 100))
    want = {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, short))}
    longer = {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, long))}
    return path, want, longer


def _api_children(pid: int) -> list[int]:
    """The pids of ``pid``'s children running ``unikv.serving.api_procs``."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    if b"unikv.serving.api_procs" in c.read():
                        out.append(int(child))
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # ended, not reaped yet
    except FileNotFoundError:
        return True


def _per_process(url: str) -> dict[str, float]:
    """{pid: requests taken} from one scrape (a fresh connection)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = metric_values(text, "unikv:api_server_requests_total", "tiny")
    return {k.split('pid="')[1].split('"')[0]: v for k, v in values.items()}


def test_two_api_processes_serve_add_up_and_drain(model):
    path, want, longer = model
    proc = ServerProcess(path, "--api-server-count", "2", "--max-model-len", str(MAX_LEN),
                         "--served-model-name", "tiny", "--api-key", KEY,
                         "--shutdown-timeout", "1",
                         env={"UNIKV_TEST_ENGINE_FAULT": "step-delay-ms:20"})  # fmt: skip
    try:
        (child,) = _api_children(proc.proc.pid)
        pids = {str(proc.proc.pid), str(child)}

        def client_run(i: int) -> tuple[int, int, int]:
            """One client of its own (its own connection): a plain and a streamed
            completion; (completions, prompt tokens, completion tokens) by usage."""
            prompt = PROMPTS[i % len(PROMPTS)]
            with openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0) as c:
                plain = c.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
                assert plain.choices[0].text == want[prompt]
                text, usage = "", None
                for chunk in c.completions.create(
                    model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                ):  # fmt: skip
                    text += "".join(ch.text for ch in chunk.choices)
                    usage = chunk.usage or usage
                assert text == want[prompt]
            tokens = plain.usage.completion_tokens + usage.completion_tokens
            return 2, plain.usage.prompt_tokens + usage.prompt_tokens, tokens

        sent = [0, 0, 0]
        for _ in range(6):  # new connections until both processes served (2^-8 per round)
            with ThreadPoolExecutor(8) as pool:
                for got in pool.map(client_run, range(8)):
                    sent = [a + b for a, b in zip(sent, got, strict=True)]
            per = _per_process(proc.url)
            if len(per) == 2 and all(per.values()):
                break
        assert set(per) == pids, (per, pids)
        assert all(v > 0 for v in per.values()), per

        # any process's scrape adds both up (several scrapes, several connections)
        for _ in range(6):
            text = httpx.get(proc.url + "/metrics", timeout=10).text
            done = metric_values(text, "vllm:request_success_total", "tiny")
            assert done == {'{finished_reason="length"}': sent[0]}, done
            assert metric_values(text, "vllm:prompt_tokens_total", "tiny") == {"": sent[1]}
            assert metric_values(text, "vllm:generation_tokens_total", "tiny") == {"": sent[2]}
            hist = metric_values(text, "vllm:e2e_request_latency_seconds_count", "tiny")
            assert hist == {"": sent[0]}
            per = metric_values(text, "unikv:api_server_requests_total", "tiny")
            assert sum(per.values()) == sent[0]  # (one completion per request here)
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
        assert httpx.get(proc.url + "/v1/models", timeout=10).status_code == 401  # the key

        # SIGTERM drains both: long streams on each process end with an 'abort' chunk
        streams, seen = [], set()
        body = {"model": "tiny", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        for i in range(12):
            if len(seen) == 2:
                break
            before = _per_process(proc.url)
            client = httpx.Client(timeout=60, headers=AUTH)
            prompt = PROMPTS[i % len(PROMPTS)]
            cm = client.stream("POST", proc.url + "/v1/completions", json=dict(body, prompt=prompt))
            r = cm.__enter__()
            lines = r.iter_lines()
            first = next(x for x in lines if x.startswith("data: "))
            after = _per_process(proc.url)
            seen |= {pid for pid in after if after[pid] > before.get(pid, 0)}
            streams.append((client, cm, lines, prompt, [first]))
        assert seen == pids, seen
        proc.proc.send_signal(signal.SIGTERM)
        for client, cm, lines, prompt, got in streams:
            got += [x for x in lines if x.startswith("data: ")]
            cm.__exit__(None, None, None)
            client.close()
            assert got[-1] == "data: [DONE]"
            chunks = [json.loads(x[6:]) for x in got[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
            text = "".join(c["choices"][0]["text"] for c in chunks)
            assert longer[prompt].startswith(text) and text != longer[prompt]
        assert proc.proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child)
    finally:
        out = proc.stop()
    assert "exiting with status" not in out, out[-2000:]


def test_engine_death_ends_every_api_process(model):
    path = model[0]
    proc = ServerProcess(path, "--api-server-count", "2", "--max-model-len", str(MAX_LEN))
    try:
        (child,) = _api_children(proc.proc.pid)
        os.kill(proc.engine_pid(), signal.SIGKILL)
        killed = time.monotonic()
        assert proc.proc.wait(timeout=15) == 1
        while not _gone(child) and time.monotonic() - killed < 15:
            time.sleep(0.1)
        assert _gone(child) and time.monotonic() - killed < 15
    finally:
        out = proc.stop()
    # each process said why it exited with status 1: the first, and API process 1
    assert out.count("the engine process exited with status") == 2, out[-2000:]
    assert out.count("exiting with status 1") == 2, out[-2000:]
