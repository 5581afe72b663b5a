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


def _per_process(url: str, model: str = "tiny") -> dict[str, float]:
    """{pid: requests taken} of ``model`` from one scrape (a fresh connection)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = metric_values(text, "unikv:api_server_requests_total", model)
    return {k.split('pid="')[1].split('"')[0]: v for k, v in values.items()}


def _streams_on_both(url: str, pids: set[str], max_tokens: int = 100) -> list:
    """Long streams, each on a connection of its own, opened until each API process
    serves one (which one: the per-process metric that grew; published as a
    request starts); each (client, stream, lines, prompt, pid, [first data line])."""
    streams, seen = [], set()
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    for i in range(16):  # 2^-15 that 16 connections all land on one process
        if seen == pids:
            break
        before = _per_process(url)
        client = httpx.Client(timeout=60, headers=AUTH)
        prompt = PROMPTS[i % len(PROMPTS)]
        cm = client.stream("POST", url + "/v1/completions", json=dict(body, prompt=prompt))
        lines = cm.__enter__().iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        after = _per_process(url)
        (pid,) = [p for p in after if after[p] > before.get(p, 0)]
        seen.add(pid)
        streams.append((client, cm, lines, prompt, pid, [first]))
    assert seen == pids, seen
    return streams


def test_two_api_processes_serve_add_up_and_drain(model):
    path, want, longer = model
    proc = ServerProcess(path, "--api-server-count", "2", "--max-model-len", str(MAX_LEN),
                         "--served-model-name", "tiny", "--api-key", KEY,
                         "--shutdown-timeout", "1", "--enable-admin-routes",
                         "--enable-log-requests",
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
        for _ in range(4):  # the admin route, from each process (its own channel)
            r = httpx.post(proc.url + "/reset_prefix_cache", json={}, headers=AUTH, timeout=30)
            assert r.status_code == 200 and r.json() == {"reset": True}, r.text

        # a client that goes away aborts its request, on either process
        gone = _streams_on_both(proc.url, pids)
        for client, cm, *_ in gone:
            cm.__exit__(None, None, None)
            client.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            text = httpx.get(proc.url + "/metrics", timeout=10).text
            done = metric_values(text, "vllm:request_success_total", "tiny")
            running = metric_values(text, "vllm:num_requests_running", "tiny")
            if running == {"": 0} and done.get('{finished_reason="abort"}') == len(gone):
                break
            time.sleep(0.1)
        assert running == {"": 0}, running
        assert done == {'{finished_reason="length"}': sent[0],
                        '{finished_reason="abort"}': len(gone)}, done  # fmt: skip

        # SIGTERM drains both: each process's streams end with a final chunk and [DONE]
        streams = _streams_on_both(proc.url, pids)
        proc.proc.send_signal(signal.SIGTERM)
        last = {}  # pid -> the finish reason of its last stream (opened just before SIGTERM)
        for client, cm, lines, prompt, pid, got in streams:
            got += [x for x in lines if x.startswith("data: ")]
            cm.__exit__(None, None, None)
            client.close()
            assert got[-1] == "data: [DONE]"
            chunks = [json.loads(x[6:]) for x in got[:-1]]
            reason = last[pid] = chunks[-1]["choices"][0]["finish_reason"]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            if reason == "length":  # (an early stream may have ended before the cut)
                assert text == longer[prompt]
            else:
                assert reason == "abort" and longer[prompt].startswith(text), (reason, text)
                assert text != longer[prompt]
        assert last == dict.fromkeys(pids, "abort"), last
        assert proc.proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child)
    finally:
        out = proc.stop()
    assert "exiting with status" not in out, out[-2000:]
    for k in (0, 1):  # --enable-log-requests: each process logs the requests it served
        assert f"unikv.serving [API process {k}]: request " in out, out[-2000:]


def test_two_models_then_engine_death_ends_every_api_process(model, tmp_path):
    """Two models behind two API processes (one engine process, a channel per model
    per API process): both models' texts from many connections; then the engine
    process killed: every API process exits with status 1 within seconds."""
    path_a, want_a = model[0], model[1]
    path_b = str(tmp_path / "b")
    save_instruct_llama(path_b, seed=2)
    llm = LLM(path_b, device="cpu", page_size=4, max_model_len=MAX_LEN)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want_b = {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, short))}
    del llm
    assert want_a != want_b, "two different checkpoints"
    proc = ServerProcess(path_a, "--model", path_b, "--served-model-name", "tiny",
                         "--served-model-name", "b", "--kv-cache", str(8 << 20),
                         "--api-server-count", "2", "--max-model-len", str(MAX_LEN))  # fmt: skip
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def complete(i: int) -> tuple[str, str, str]:
        name, prompt = ("tiny", "b")[i % 2], PROMPTS[(i // 2) % len(PROMPTS)]
        with httpx.Client(timeout=60) as c:  # a connection of its own
            r = c.post(proc.url + "/v1/completions", json=dict(body, model=name, prompt=prompt))
        return name, prompt, r.json()["choices"][0]["text"]

    try:
        (child,) = _api_children(proc.proc.pid)
        pids = {str(proc.proc.pid), str(child)}
        for rounds in range(1, 7):  # until both processes served model "tiny" (its metrics)
            with ThreadPoolExecutor(8) as pool:
                for name, prompt, text in pool.map(complete, range(16)):
                    assert text == (want_a if name == "tiny" else want_b)[prompt], (name, prompt)
            per = _per_process(proc.url)
            if set(per) == pids and all(per.values()):
                break
        assert set(per) == pids and all(per.values()), per
        # /metrics lists both models' figures: 8 requests of each per round
        for name in ("tiny", "b"):
            assert sum(_per_process(proc.url, name).values()) == 8 * rounds, name
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


def test_refusals_before_anything_starts(capsys):
    """Options ``--api-server-count`` cannot serve fail start-up with status 2 and a
    message naming the flag, before an engine process starts: a port another
    socket holds (bound here, without SO_REUSEPORT), ``--in-process-engine``, a
    count below 1. The port's own holder is left serving."""
    import socket
    import sys

    from unikv.serving.cli import serve_main

    interval = sys.getswitchinterval()  # (serve_main sets this process's)
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        base = ["--model", "/nonexistent", "--device", "cpu", "--api-server-count", "2"]
        assert serve_main([*base, "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err, err
        assert serve_main([*base, "--port", "0", "--in-process-engine"]) == 2
        err = capsys.readouterr().err
        assert "--api-server-count 2 needs the engine in its own process" in err, err
        with pytest.raises(SystemExit) as exc:
            serve_main(["--model", "/nonexistent", "--api-server-count", "0"])
        assert exc.value.code == 2
        assert "--api-server-count" in capsys.readouterr().err
        holder.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # still the holder's
    finally:
        holder.close()
        sys.setswitchinterval(interval)


def test_shared_figures_add_up_across_processes(tmp_path):
    """Two API processes' metrics over one shared file (in one process here): a
    scrape of either exports the sum of what each recorded (the counts fed here),
    each one's request count under its own ``api_server``; the other's figures
    show as of its last publish."""
    from prometheus_client import generate_latest

    from unikv.serving.metrics import RequestClock, ServingMetrics

    path = str(tmp_path / "metrics-0.bin")
    m = [ServingMetrics(None, None, "tiny") for _ in range(2)]
    for k, one in enumerate(m):
        one.share(path, k, 2)

    def record(one, tokens: int, reason: str) -> None:
        one.http_requests += 1
        one.prompt_tokens += 4
        clock = RequestClock(one, time.perf_counter())
        for _ in range(tokens):
            clock.tokens((0, 0), 1, time.perf_counter())
        clock.finished(reason, time.perf_counter(), (0, 0))

    def scrape(one) -> str:
        return generate_latest(one.registry).decode()

    record(m[0], 3, "length")
    record(m[1], 5, "stop")
    record(m[1], 2, "length")
    stale = scrape(m[0])  # m[1] has not published since its share
    assert metric_values(stale, "vllm:generation_tokens_total", "tiny") == {"": 3}
    m[1].publish()
    for one in m:
        text = scrape(one)
        assert metric_values(text, "vllm:generation_tokens_total", "tiny") == {"": 10}
        assert metric_values(text, "vllm:prompt_tokens_total", "tiny") == {"": 12}
        done = metric_values(text, "vllm:request_success_total", "tiny")
        assert done == {'{finished_reason="length"}': 2, '{finished_reason="stop"}': 1}
        assert metric_values(text, "vllm:e2e_request_latency_seconds_count", "tiny") == {"": 3}
        # 3 + 5 + 2 tokens: 2 + 4 + 1 gaps between tokens
        assert metric_values(text, "vllm:inter_token_latency_seconds_count", "tiny") == {"": 7}
        per = metric_values(text, "unikv:api_server_requests_total", "tiny")
        pid = os.getpid()
        assert per == {f'{{api_server="0",pid="{pid}"}}': 1, f'{{api_server="1",pid="{pid}"}}': 2}
