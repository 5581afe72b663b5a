"""``unikv serve``'s access and operations (issue 40 item 3), against real
servers on 127.0.0.1 (uvicorn in a thread, and one ``unikv serve`` subprocess).

- Access (a scripted engine, no model): the API key (401 OpenAI-shaped on every
  route but /health and /metrics), X-Request-Id taken or made and echoed, CORS
  preflights, the Host allow-list, request logs, limits (body 413, a trickling
  body 408, headers 431, prompts per request, ``max_tokens`` against the context),
  admin routes mounted only when asked.
- A real tiny Llama: ``cache_salt`` (oracle: ``LLM.generate``'s text, and the
  hits of the same prompt without salts), /metrics under vLLM's names (idle: no
  page in use, the cached ones shown apart), every metric the Grafana dashboard
  queries exported, and tokenization off the event loop (``/health`` answers
  while a 1 MB prompt is tokenized).
- SIGTERM on a subprocess: a short stream finishes, a long one gets a final
  ``finish_reason: "abort"`` chunk and ``[DONE]`` after ``--shutdown-timeout``, a
  long JSON request its text so far; exit status 0; the key from
  ``UNIKV_API_KEY`` and the request log lines.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import threading
import time
from itertools import pairwise
from pathlib import Path

import httpx
import pytest
import torch
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import (
    AppThread,
    ScriptedLLM,
    ServerProcess,
    build_tokenizer,
    metric_values,
    save_instruct_llama,
)

from unikv.engine import LLM
from unikv.serving.app import create_app
from unikv.serving.ops import ServeOptions

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "sekret-key"
AUTH = {"authorization": f"Bearer {KEY}"}
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-unikv.json"


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] == status and error["message"], error
    return error


@pytest.fixture(scope="module")
def scripted():
    llm = ScriptedLLM()
    llm.max_model_len = 32
    options = ServeOptions(
        api_key=KEY, allowed_origins=["https://ok.example"],
        allowed_hosts=["127.0.0.1", "*.example"], log_requests=True, max_body_bytes=2048,
        max_header_bytes=4096, body_timeout_s=0.5, max_prompts=3,
    )  # fmt: skip
    app = AppThread(create_app(llm, served_model_names=["tiny"], options=options))
    try:
        yield app
    finally:
        app.stop()


def test_api_key_guards_every_route_but_health_and_metrics(scripted):
    url = scripted.url
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("POST", "/reset_prefix_cache")):  # fmt: skip
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            r = httpx.request(method, url + path, json={"model": "tiny"}, headers=headers)
            assert _error(r, 401)["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(url + "/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    # admin routes are not mounted unless asked
    _error(httpx.post(url + "/reset_prefix_cache", json={}, headers=AUTH, timeout=10), 404)


def test_request_id_cors_hosts_and_logs(scripted, caplog):
    url = scripted.url
    with caplog.at_level(logging.INFO, logger="unikv.serving"):
        r = httpx.get(url + "/v1/models", headers=AUTH | {"x-request-id": "abc-123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
        made = httpx.get(url + "/v1/models").headers["x-request-id"]  # a 401 has one too
        assert re.fullmatch(r"[0-9a-f]{32}", made)
        bad = httpx.get(url + "/health", headers={"x-request-id": "x" * 500})
        assert re.fullmatch(r"[0-9a-f]{32}", bad.headers["x-request-id"])
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "unikv.serving"]
    assert any("abc-123" in m and "/v1/models" in m and "200" in m for m in logged), logged
    assert any(made in m and "401" in m for m in logged), logged
    # CORS: an allowed origin's preflight passes and even a refusal is readable
    pre = {"origin": "https://ok.example", "access-control-request-method": "POST",
           "access-control-request-headers": "authorization,content-type"}  # fmt: skip
    r = httpx.options(url + "/v1/completions", headers=pre)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://ok.example"
    r = httpx.options(url + "/v1/completions", headers=pre | {"origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(url + "/v1/models", headers={"origin": "https://ok.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://ok.example"
    # Host allow-list (DNS rebinding: a loopback server reached under another name)
    _error(httpx.get(url + "/health", headers={"host": "evil.com"}), 400)
    _error(httpx.get(url + "/v1/models", headers=AUTH | {"host": "evil.com:80"}), 400)
    assert httpx.get(url + "/health", headers={"host": "api.example"}).status_code == 200


def test_limits_body_headers_prompts_and_context(scripted):
    url = scripted.url + "/v1/completions"
    big = json.dumps({"model": "tiny", "prompt": "x" * 4000}).encode()
    _error(httpx.post(url, content=big, headers=AUTH), 413)

    def chunked():  # no content-length: counted as it streams in
        for _ in range(8):
            yield b" " * 512

    _error(httpx.post(url, content=chunked(), headers=AUTH), 413)
    _error(httpx.get(scripted.url + "/health", headers={"x-big": "y" * 8000}), 431)
    many = {"model": "tiny", "prompt": [[1, 2]] * 4, "max_tokens": 2}
    assert _error(httpx.post(url, json=many, headers=AUTH), 400)["param"] == "prompt"
    # the context is 32 tokens: 20 prompt tokens leave room for 12
    long = {"model": "tiny", "prompt": [5] * 20, "max_tokens": 13}
    error = _error(httpx.post(url, json=long, headers=AUTH), 400)
    assert error["param"] == "max_tokens" and "maximum context length is 32" in error["message"]
    assert "33 tokens" in error["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 40}  # fmt: skip
    error = _error(httpx.post(scripted.url + "/v1/chat/completions", json=chat, headers=AUTH), 400)
    assert error["param"] == "max_completion_tokens"


def test_a_trickling_body_is_cut_with_408(scripted):
    port = int(scripted.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
                "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")  # fmt: skip
        s.sendall(head.encode() + b'{"model": ')  # ... and the rest never comes
        start, reply = time.monotonic(), b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        took = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert 0.4 < took < 9, took


# -- a real model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("instruct"))
    hf = save_instruct_llama(path)
    llm = LLM(path, device="cpu", page_size=4, max_model_len=128, max_num_seqs=8,
              enable_prefix_caching=True)  # fmt: skip
    options = ServeOptions(api_key=KEY, enable_admin_routes=True)
    app = AppThread(create_app(llm, served_model_names=["tiny"], options=options))
    try:
        yield hf, app
    finally:
        app.stop()


def _complete(url: str, prompt: str, **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_cache_salt_separates_prefix_pages(real):
    hf, app = real
    prompt = "The quick brown fox jumps over the lazy dog. Hello, how are you today?"
    runs = [(salt, _complete(app.url, prompt, **({"cache_salt": salt} if salt else {})))
            for salt in ("alice", "bob", "alice", None, None)]  # fmt: skip
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for _, b in runs]
    # bob and the unsalted request share nothing with alice; a repeat of a salt hits
    assert cached[0] == cached[1] == cached[3] == 0
    assert cached[2] > 0 and cached[4] == cached[2]
    tok = build_tokenizer()  # transformers' greedy tokens: the oracle
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id)
    want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert [b["choices"][0]["text"] for _, b in runs] == [want] * 5
    bad = {"model": "tiny", "prompt": "x", "cache_salt": ""}
    r = httpx.post(app.url + "/v1/completions", json=bad, headers=AUTH, timeout=30)
    assert _error(r, 400)["param"] == "cache_salt"


def test_metrics_vllm_names_idle_pool_dashboard_and_admin_route(real):
    _, app = real
    _complete(app.url, "A stop string cuts the text where it begins.")
    text = httpx.get(app.url + "/metrics", timeout=30).text  # no key needed
    for line in text.splitlines():
        if line.startswith(("vllm:", "unikv:")):
            assert 'model_name="tiny"' in line, line
    assert metric_values(text, "vllm:num_requests_running")[""] == 0
    # idle: the cache keeps pages, none of them in use
    assert metric_values(text, "vllm:kv_cache_usage_perc")[""] == 0
    assert set(metric_values(text, "unikv:subpool_live_pages").values()) == {0.0}
    assert sum(metric_values(text, "unikv:subpool_cached_pages").values()) > 0
    assert metric_values(text, "vllm:request_success_total")['{finished_reason="length"}'] >= 1
    assert metric_values(text, "vllm:prefix_cache_queries_total")[""] > 0
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert metric_values(text, name + "_count")[""] >= 1
    # every series the Grafana dashboard queries is exported
    series = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in re.findall(r"\b(?:vllm|unikv):[a-z0-9_]+", e)}
    assert len(queried) >= 12 and queried <= series, queried - series
    # the admin route: never by a body-less (CORS-simple) POST; JSON and the key reset it
    url = app.url + "/reset_prefix_cache"
    _error(httpx.post(url, headers=AUTH, timeout=30), 415)
    plain = AUTH | {"content-type": "text/plain"}
    _error(httpx.post(url, content=b"{}", headers=plain, timeout=30), 415)
    _error(httpx.post(url, json={}, timeout=30), 401)
    r = httpx.post(url, json={}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json() == {"reset": True}
    text = httpx.get(app.url + "/metrics", timeout=30).text
    assert metric_values(text, "unikv:prefix_cache_pages")[""] == 0


def test_tokenization_does_not_block_health(real):
    """A 1 MB prompt takes the tokenizer seconds (then is refused as too long):
    /health answers meanwhile, each answer much faster than the big request."""
    _, app = real
    prompt = "The quick brown fox jumps over the lazy dog. " * (1_000_000 // 45)
    done: dict = {}

    def big() -> None:
        done["start"] = time.monotonic()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        done["r"] = httpx.post(app.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
        done["end"] = time.monotonic()

    thread = threading.Thread(target=big)
    thread.start()
    answered, slowest = [], 0.0
    with httpx.Client(timeout=60) as client:
        while thread.is_alive() and len(answered) < 200:
            t0 = time.monotonic()
            assert client.get(app.url + "/health").status_code == 200
            answered.append(time.monotonic())
            slowest = max(slowest, answered[-1] - t0)
            time.sleep(0.02)
    thread.join(120)
    assert _error(done["r"], 400)["param"] == "prompt"  # too long for the context
    took = done["end"] - done["start"]
    during = [t for t in answered if done["start"] < t < done["end"]]
    assert len(during) >= 3, (len(during), took)
    assert slowest < took / 2, (slowest, took)


def test_a_huge_prompt_does_not_stall_other_streams(real):
    """While a 1 MB prompt is tokenized, another client's stream keeps getting
    tokens (the tokenizer pool works on its own copy of the tokenizer, so the
    engine thread's detokenizer never waits for it)."""
    _, app = real
    prompt = "Hello, how are you today? I am fine, thank you. " * (1_000_000 // 49)
    big: dict = {}

    def send_big() -> None:
        big["start"] = time.monotonic()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        big["r"] = httpx.post(app.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
        big["end"] = time.monotonic()

    thread = threading.Thread(target=send_big)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 120, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    arrivals = []
    with httpx.stream("POST", app.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=120) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the stream runs
        thread.start()
        for line in lines:
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    thread.join(120)
    assert _error(big["r"], 400)["param"] == "prompt"
    took = big["end"] - big["start"]
    during = [t for t in arrivals if big["start"] < t < big["end"]]
    assert len(during) >= 3 or arrivals[-1] < big["start"] + took / 2, (len(during), took)
    gaps = [b - a for a, b in pairwise(arrivals) if big["start"] < b < big["end"]]
    assert max(gaps, default=0) < took / 2, (max(gaps), took)


# -- SIGTERM ----------------------------------------------------------------------------


def _events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_sigterm_drains_streams_then_ends_them_with_a_final_chunk(tmp_path, monkeypatch):
    path = str(tmp_path)
    save_instruct_llama(path, max_position_embeddings=4096)
    monkeypatch.setenv("UNIKV_API_KEY", KEY)
    proc = ServerProcess(path, "--max-model-len", "4096", "--served-model-name", "tiny",
                         "--shutdown-timeout", "2", "--enable-log-requests",
                         "--allowed-hosts", "127.0.0.1,localhost")  # fmt: skip
    try:
        url = proc.url + "/v1/completions"
        assert httpx.get(proc.url + "/v1/models", timeout=10).status_code == 401  # env key
        base = {"model": "tiny", "prompt": "Hello", "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        results: dict = {}

        def stream(name: str, max_tokens: int) -> None:
            body = dict(base, max_tokens=max_tokens)
            with httpx.stream("POST", url, json=body, headers=AUTH, timeout=60) as r:
                results[name] = _events(r.iter_lines())

        def plain() -> None:
            body = dict(base, stream=False, max_tokens=4000)
            results["plain"] = httpx.post(url, json=body, headers=AUTH, timeout=60)

        long = threading.Thread(target=stream, args=("long", 4000))
        long.start()
        whole = threading.Thread(target=plain)
        whole.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the long stream is running
            m = httpx.get(proc.url + "/metrics", timeout=10).text
            if metric_values(m, "vllm:num_requests_running")[""] == 2:
                break
            time.sleep(0.05)
        short = threading.Thread(target=stream, args=("short", 4))
        short.start()
        while time.monotonic() < deadline and "short" not in results:  # both are running
            m = httpx.get(proc.url + "/metrics", timeout=10).text
            if metric_values(m, "vllm:num_requests_running")[""] == 3:
                break
            time.sleep(0.02)
        sent = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:  # no longer accepting: the port is closed (or a 503 on a kept-alive connection)
            r = httpx.post(url, json=dict(base, stream=False, max_tokens=2), headers=AUTH,
                           timeout=5)  # fmt: skip
            assert r.status_code == 503, r.text
        except httpx.TransportError:
            pass
        for thread in (long, short, whole):
            thread.join(60)
        rc = proc.proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        out = proc.stop()
    assert rc == 0, out
    assert 1.8 < took < 15, took
    for name, reason in (("short", "length"), ("long", "abort")):
        events = results[name]
        assert events[-1] == "[DONE]", (name, events[-3:])
        finals = [e for e in events[:-1] if e["choices"][0]["finish_reason"] is not None]
        assert [e["choices"][0]["finish_reason"] for e in finals] == [reason], name
        assert finals[0] is events[-2]
    assert len(results["long"]) < 4000
    plain = results["plain"]  # a JSON body in flight: its text so far, finish_reason abort
    assert plain.status_code == 200, plain.text
    choice = plain.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["text"]
    assert 0 < plain.json()["usage"]["completion_tokens"] < 4000
    assert re.search(r"request \S+ POST /v1/completions -> 200", out), out
    assert "CancelledError" not in out and "Traceback" not in out, out


def test_cli_flags_map_to_serve_options(monkeypatch):
    from unikv.serving.cli import _options, _parser

    monkeypatch.setenv("UNIKV_API_KEY", "from-env")
    args = _parser().parse_args(["--model", "m", "--allowed-origins", '["https://a.b", "*"]',
                                 "--allowed-hosts", "localhost, *.corp", "--enable-admin-routes",
                                 "--enable-log-requests", "--max-body-bytes", "1000",
                                 "--shutdown-timeout", "7.5"])  # fmt: skip
    opts = _options(args)
    assert opts.api_key == "from-env" and opts.allowed_origins == ["https://a.b", "*"]
    assert opts.allowed_hosts == ["localhost", "*.corp"] and opts.max_body_bytes == 1000
    assert opts.enable_admin_routes and opts.log_requests and opts.shutdown_timeout_s == 7.5
    assert _options(_parser().parse_args(["--model", "m", "--api-key", "k"])).api_key == "k"
    monkeypatch.delenv("UNIKV_API_KEY")
    defaults = _options(_parser().parse_args(["--model", "m"]))
    assert defaults == ServeOptions()  # open, no CORS, no admin routes, sane limits
    for bad in (["--max-body-bytes", "0"], ["--allowed-origins", "[1]"], ["--body-timeout", "-1"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(["--model", "m", *bad])
    with pytest.raises(ValueError, match="shutdown_timeout_s"):
        _options(_parser().parse_args(["--model", "m", "--shutdown-timeout", "-1"]))
