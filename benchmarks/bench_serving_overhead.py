"""The serving layer's own host cost: ``unikv serve``'s app with a zero-cost engine.

The real FastAPI app (``unikv.serving.app.create_app``) runs on uvicorn in a
thread of this process, as the CLI runs it (uvicorn's default loop and HTTP
protocol). Its engine is a stand-in (``FakeLLM``): a loop thread that emits
one token per live stream per step at a fixed step rate, with no model; the
text of each token was made beforehand by the real ``IncrementalDetokenizer``
over a word-level tokenizer (token i is the word ``wi``), and the deltas are
the engine's own ``Delta`` objects, published once per step through the app's
``publish`` hook, as ``EngineLoop`` does. A client in a subprocess opens
``--streams`` streamed ``/v1/completions`` at once (raw sockets, so it is cheap)
and timestamps the SSE events it receives.

Per offered rate (deltas/s = streams x steps/s; 0 = the engine steps flat out):
  - delivered deltas/s (client: all events over first to last event);
  - the serving thread's CPU time per delta (us; its thread CPU clock over the
    run, over the deltas delivered), and the capacity that implies;
  - client inter-token latency p50/p99;
  - the GIL time taken from the engine thread: every step the engine runs a
    pure-Python busy loop (``--busy-us`` alone, calibrated); its median wall
    time while streaming against its median with no stream, in the same run.

Usage: ``python benchmarks/bench_serving_overhead.py [--out PATH]``; ``--app
MODULE`` benchmarks another copy of the app (before/after). CPU only.

``--burst N`` (issue 40) traces a burst instead: the real app with a real engine
process (``ProcEngine``, a tiny random Llama, a word-level tokenizer with a chat
template); a client process opens N connections, then writes N non-streamed
``/v1/chat/completions`` at once. Timestamps (``perf_counter``, one clock for
every process) per request, from wrappers installed by this script (the
engine process runs a traced entry point, ``TRACED_ENGINE``): sent, handler
entered, body parsed and validated, template rendered and tokenized, add queued,
``adds`` message sent, read by the engine, admitted (``Core.add_all`` done).
Per round: ``spread_ms`` (first send to the last admission), the API process's
CPU per request (user + system, whole burst), ``adds`` messages, engine steps
before the last admission, and each stage's median; ``--burst-rounds`` rounds
after a 16-request warm-up, medians printed and saved under ``burst:<tag>``.
``--admission-window-ms`` sets the engine's admission window (default 0: off).
Rounds also list each drained ``adds`` (requests, read at ms after the first
send) and each engine step before the last admission (start, duration, queued):
on CPU a step of this tiny model takes tens to hundreds of milliseconds, so a
step started on the burst's first request holds the rest in the socket (on a GPU
the engine reads while the device runs).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import itertools

from unikv.engine.detokenize import make_detokenizer
from unikv.engine.tracks import Delta

VOCAB = 2000


def word_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def stream_texts(tokenizer, num_streams: int, num_tokens: int) -> tuple[list, float]:
    """Per stream: its token ids and their text deltas (the real incremental
    detokenizer); and that detokenizer's cost per token (us, engine-side)."""
    out, start = [], time.perf_counter()
    for s in range(num_streams):
        ids = [(s * 7 + 13 * k) % VOCAB for k in range(num_tokens)]
        detok = make_detokenizer(tokenizer, [1, 2, 3], True)
        out.append((ids, [detok.update([t]) for t in ids]))
    return out, (time.perf_counter() - start) / (num_streams * num_tokens) * 1e6


# -- the engine stand-in ------------------------------------------------------------------


class FakeGroup:
    def __init__(self, ids, texts, n: int, max_tokens: int, sink) -> None:
        self.sink, self.ids, self.texts, self.max_tokens = sink, ids, texts, max_tokens
        self.tracks = list(range(n))
        self.sent, self.num_done, self.aborted = 0, 0, False

    @property
    def done(self) -> bool:
        return self.num_done == len(self.tracks)


class FakeLoop:
    """EngineLoop's surface for the app: submit/abort/call/start/shutdown and a
    ``publish`` hook fed one list of (sink, Delta) per step."""

    def __init__(self, busy_iters: int) -> None:
        self.max_waiting, self.error, self.publish = None, None, None
        self._inbox: list = []
        self.live: list[FakeGroup] = []
        self.period = 0.0  # seconds per step; 0: flat out
        self.busy_iters = busy_iters
        self.busy: list[float] = []  # busy-loop wall seconds per step
        self.idle_busy: list[float] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, group, bounded: bool = True):
        with self._lock:
            self._inbox.append(group)
        return group

    def submit_all(self, groups, bounded: bool = True) -> None:
        with self._lock:
            self._inbox += groups

    def abort(self, group) -> None:
        group.aborted = True

    def call(self, fn):
        from concurrent.futures import Future

        f: Future = Future()
        f.set_result(fn())
        return f

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="fake-engine", daemon=True)
        self._thread.start()

    def shutdown(self, drain: bool = False) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join(10)

    def _serve(self) -> None:
        next_t = time.perf_counter()
        while not self._stop:
            with self._lock:
                self.live += self._inbox
                self._inbox = []
            t0 = time.perf_counter()
            busy_loop(self.busy_iters)
            (self.busy if self.live else self.idle_busy).append(time.perf_counter() - t0)
            if self.live:
                self._step()
            next_t = max(next_t + (self.period if self.live else 0.002), time.perf_counter())
            time.sleep(max(0.0, next_t - time.perf_counter()))

    def _step(self) -> None:
        pairs, keep = [], []
        for g in self.live:
            k = g.sent
            g.sent += 1
            last = g.sent >= g.max_tokens or g.aborted
            reason = ("abort" if g.aborted else "length") if last else None
            tok = g.ids[k % len(g.ids)]
            for i in g.tracks:
                pairs.append((g.sink, Delta(i, [tok], g.texts[k % len(g.texts)], None, reason)))
            if last:
                g.num_done = len(g.tracks)
            else:
                keep.append(g)
        self.live = keep
        self.publish(pairs)


def busy_loop(iters: int) -> int:
    x = 0
    for i in range(iters):
        x += i
    return x


class FakePrompts:
    def token_ids(self, prompt) -> list[int]:
        return list(prompt)


class FakeLLM:
    """What ``create_app`` reads of an LLM, with ``FakeLoop`` as its engine."""

    def __init__(self, texts: list, busy_iters: int) -> None:
        self.engine, self.prompts, self.texts = FakeLoop(busy_iters), FakePrompts(), texts
        self.max_model_len = 1 << 20
        self.tokenizer_lock = threading.Lock()
        self.requests, self.core = self, None  # (AsyncEngine's maker; no scheduler to read)
        self.reset_prefix_cache = lambda: False

    def make_group(self, ids, params, *, text=None, sink=None, cache_salt=None) -> FakeGroup:
        s_ids, s_texts = self.texts[ids[0] % len(self.texts)]
        return FakeGroup(s_ids, s_texts, params.n, params.max_tokens, sink)


# -- the client (a subprocess) ---------------------------------------------------------------


async def one_stream(port: int, s: int, tokens: int, times: list) -> None:
    body = json.dumps({"model": "bench", "prompt": [s], "max_tokens": tokens, "stream": True})
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((head + body).encode())
    tail = b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        now = time.perf_counter()
        seen = (tail + data).count(b"data: {")
        tail = data[-8:]
        if seen:
            times.append((now, seen))
        if b"data: [DONE]" in data:
            break
    writer.close()


def client_main(port: int, streams: int, tokens: int) -> None:
    async def run():
        times = [[] for _ in range(streams)]
        await asyncio.gather(*(one_stream(port, s, tokens, times[s]) for s in range(streams)))
        return times

    times = asyncio.run(run())
    events = sum(n for t in times for _, n in t)
    first = min(t[0][0] for t in times if t)
    last = max(t[-1][0] for t in times if t)
    itl = [(b[0] - a[0]) / b[1] for t in times for a, b in itertools.pairwise(t)]
    print(json.dumps({"events": events, "span_s": last - first, "itl": itl}))


# -- the server side --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_times(tid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of thread ``tid`` of this process (Linux)."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def calibrate(busy_us: float) -> int:
    iters = 1000
    while True:
        t0 = time.perf_counter()
        busy_loop(iters)
        dt = time.perf_counter() - t0
        if dt > 2e-3:
            return max(1, int(iters * busy_us * 1e-6 / dt))
        iters *= 2


def run_rate(server, llm, port, args, rate: float) -> dict:
    loop = llm.engine
    loop.period = args.streams / rate if rate else 0.0
    loop.busy, loop.idle_busy = [], []
    time.sleep(0.3)  # idle steps: the busy loop alone
    user0, sys0 = thread_times(server.native_id)
    wall0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--client", str(port), str(args.streams), str(args.tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    user, kernel = (b - a for a, b in zip((user0, sys0), thread_times(server.native_id)))
    cpu, wall = user + kernel, time.perf_counter() - wall0
    res = json.loads(out)
    events = res["events"]
    assert events == args.streams * args.tokens, f"lost deltas: {events}"
    busy_alone, busy_stream = np.median(loop.idle_busy), np.median(loop.busy)
    us = cpu / events * 1e6
    return {
        "offered_deltas_per_s": rate or None,
        "delivered_deltas_per_s": events / res["span_s"],
        "serving_cpu_us_per_delta": us,
        "serving_user_us_per_delta": user / events * 1e6,  # ~ GIL held
        "serving_sys_us_per_delta": kernel / events * 1e6,  # syscalls, GIL released
        "serving_cpu_capacity_deltas_per_s": 1e6 / us,
        "serving_thread_cpu_share": cpu / wall,
        "itl_p50_ms": float(np.percentile(res["itl"], 50)) * 1e3,
        "itl_p99_ms": float(np.percentile(res["itl"], 99)) * 1e3,
        "engine_busy_alone_us": busy_alone * 1e6,
        "engine_busy_streaming_us": busy_stream * 1e6,
        "engine_gil_slowdown": busy_stream / busy_alone,
    }


class ServerThread:
    def __init__(self, app, port: int) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        self.server.run()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# -- the burst trace: a burst of chat requests from the first send to the last admission ------

# the engine process, traced: each drained ``adds`` (its requests' keys, when read and when
# admitted) and each loop turn (start, end, steps planned so far); returned by a "burst_trace"
# call (bench-only: the engine's own code is unchanged)
TRACED_ENGINE = """
import sys, time
from unikv.engine.online import EngineLoop
from unikv.serving import engine_core as ec
REC = {"adds": [], "turns": []}
add_all, turn, call = ec.Core.add_all, EngineLoop.turn, ec.Core.call
def traced_add_all(self, adds, chan=0):
    t0 = time.perf_counter()
    add_all(self, adds, chan)
    REC["adds"].append((t0, time.perf_counter(), [a[1] for a in adds]))
def traced_turn(self):
    t0, steps = time.perf_counter(), self.core.scheduler.num_steps
    queued = self.num_queued
    ok = turn(self)
    if self.core.scheduler.num_steps > steps:
        REC["turns"].append((t0, time.perf_counter(), queued))
    return ok
def traced_call(self, cid, name, args=(), chan=0):
    if name != "burst_trace":
        return call(self, cid, name, args, chan)
    out = {k: list(v) for k, v in REC.items()}
    for v in REC.values():
        v.clear()
    self.send(("ret", cid, True, out), chan)
ec.Core.add_all, EngineLoop.turn, ec.Core.call = traced_add_all, traced_turn, traced_call
sys.exit(ec.main())
"""


def traced_spawn(setup: bytes):
    proc = subprocess.Popen([sys.executable, "-c", TRACED_ENGINE], stdin=subprocess.PIPE)
    proc.stdin.write(setup)
    proc.stdin.close()
    return proc


CHAT_TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}w3"
TAG0 = 128  # request i's message starts with the word w(TAG0 + i): its tag, seen on both sides


def tag_of_text(text: str) -> int:
    return int(text.split()[0][1:]) - TAG0


class ApiTrace:
    """The API process's stages per request (by tag): the handler entered, the body
    parsed and validated, the chat template rendered and tokenized (and its own time
    in the tokenizer pool), the add queued (by key) and the ``adds`` message sent."""

    def __init__(self) -> None:
        from unikv.serving import app as app_mod
        from unikv.serving import engine_client as ec

        self.req: dict[int, dict] = {}
        self.key: dict[int, int] = {}  # submission key -> tag
        self.flush: dict[int, float] = {}  # key -> sent
        body, chat_item = app_mod._body, app_mod.Server.chat_item
        queue_add, flush = ec.ProcEngine._queue_add, ec.ProcEngine._flush_adds_locked

        async def traced_body(request, model, options):
            t0 = time.perf_counter()
            out = await body(request, model, options)
            if model is app_mod.ChatCompletionRequest:
                tag = tag_of_text(out.messages[0].content)
                self.req[tag] = {"handler": t0, "parsed": time.perf_counter()}
            return out

        def traced_chat_item(server, body, params, *rest):
            t0 = time.perf_counter()
            out = chat_item(server, body, params, *rest)
            tag = tag_of_text(body.messages[0].content)
            self.req[tag].update(prepare_start=t0, prepared=time.perf_counter())
            return out

        def traced_queue_add(engine, add):
            tag = add[2][0][0][1] - TAG0  # the prompt's ids: w1, then the tag
            self.key[add[1]] = tag
            self.req[tag]["queued"] = time.perf_counter()
            return queue_add(engine, add)

        def traced_flush(engine):
            keys = [a[1] for a in engine._adds]
            flush(engine)
            now = time.perf_counter()
            for k in keys:
                self.flush[k] = now

        app_mod._body, app_mod.Server.chat_item = traced_body, traced_chat_item
        ec.ProcEngine._queue_add, ec.ProcEngine._flush_adds_locked = traced_queue_add, traced_flush
        ec._spawn = traced_spawn

    def reset(self) -> None:
        self.req.clear()
        self.key.clear()
        self.flush.clear()


async def one_chat(port: int, tag: int, new_tokens: int, start: float) -> tuple[float, float]:
    """One chat request on a connection opened beforehand, sent at ``start``: (sent, done)."""
    body = json.dumps({"model": "bench", "max_tokens": new_tokens, "temperature": 0,
                       "ignore_eos": True,
                       "messages": [{"role": "user", "content": f"w{TAG0 + tag} w5 w6 w7"}]})  # fmt: skip
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    sent = time.perf_counter()
    writer.write((head + body).encode())
    data = await reader.read()
    writer.close()
    assert b" 200 " in data.split(b"\r\n", 1)[0], data[:300]
    return sent, time.perf_counter()


def burst_client_main(port: int, n: int, new_tokens: int, start: float) -> None:
    """``n`` connections opened first, then every request written at ``start``: the
    burst's spread is the server's own, not the client's connection set-up."""

    async def run():
        return await asyncio.gather(*(one_chat(port, t, new_tokens, start) for t in range(n)))

    print(json.dumps(asyncio.run(run())))


def burst_dir(path: Path) -> Path:
    """A tiny Llama (random init) and a word-level tokenizer with a chat template."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from bench_e2e import model_config, save_model

    save_model("llama", path, "cpu", torch.float32, True)
    tok = word_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    assert model_config("llama", True)["vocab_size"] >= TAG0 + 128
    return path


def burst_once(llm, trace: ApiTrace, port: int, n: int, new_tokens: int) -> dict:
    trace.reset()
    llm.call("burst_trace")  # (the warm-up's records dropped)
    start = time.perf_counter() + 1.0  # the client's connections opened by then
    import resource

    ru0 = resource.getrusage(resource.RUSAGE_SELF)  # the API process (uvicorn's loop, the pool)
    cmd = [sys.executable, __file__, "--burst-client", str(port), str(n), str(new_tokens),
           repr(start)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    ru = resource.getrusage(resource.RUSAGE_SELF)
    api_user, api_sys = ru.ru_utime - ru0.ru_utime, ru.ru_stime - ru0.ru_stime
    api_cpu = api_user + api_sys
    sent_done = json.loads(out)
    eng = llm.call("burst_trace")
    admitted = {}
    for t0, t1, keys in eng["adds"]:
        for k in keys:
            admitted[trace.key[k]] = (t0, t1)
    rows = []
    for tag, (sent, done) in enumerate(sent_done):
        r = trace.req[tag]
        key = next(k for k, t in trace.key.items() if t == tag)
        rows.append({"sent": sent, **r, "flushed": trace.flush[key], "engine_read": admitted[tag][0],
                     "admitted": admitted[tag][1], "done": done})  # fmt: skip
    first = min(r["sent"] for r in rows)
    last_admit = max(r["admitted"] for r in rows)
    first_admit = min(r["admitted"] for r in rows)
    turns = [t for t in eng["turns"] if t[0] >= first - 0.1]
    stage = {
        "to_handler": ("sent", "handler"), "parse_validate": ("handler", "parsed"),
        "to_prepare": ("parsed", "prepare_start"), "template_tokenize": ("prepare_start", "prepared"),
        "to_queued": ("prepared", "queued"), "queued_to_sent": ("queued", "flushed"),
        "sent_to_engine_read": ("flushed", "engine_read"), "engine_add": ("engine_read", "admitted"),
    }  # fmt: skip
    per = {
        name: float(np.median([r[b] - r[a] for r in rows])) * 1e3 for name, (a, b) in stage.items()
    }
    own = {
        "parse_validate": float(np.mean([r["parsed"] - r["handler"] for r in rows])) * 1e3,
        "template_tokenize": float(np.mean([r["prepared"] - r["prepare_start"] for r in rows]))
        * 1e3,
        "engine_add_per_message": float(np.mean([t1 - t0 for t0, t1, _ in eng["adds"]])) * 1e3,
    }
    # each drained adds: (its requests, read at ms after the first send); each step before
    # the last admission: (start ms, duration ms, requests queued when it began)
    adds_read = [(len(keys), round((t0 - first) * 1e3, 1)) for t0, _, keys in eng["adds"]]
    steps_ms = [
        (round((a - first) * 1e3, 1), round((b - a) * 1e3, 1), q)
        for a, b, q in turns
        if a < last_admit
    ]
    switches = ru.ru_nvcsw + ru.ru_nivcsw - ru0.ru_nvcsw - ru0.ru_nivcsw
    return {
        "requests": n,
        "spread_ms": (last_admit - first) * 1e3,  # first send to the last admission
        "admission_spread_ms": (last_admit - first_admit) * 1e3,
        "handler_spread_ms": (max(r["handler"] for r in rows) - first) * 1e3,
        "last_done_ms": (max(r["done"] for r in rows) - first) * 1e3,
        "api_cpu_ms_per_request": api_cpu / n * 1e3,
        "api_sys_ms_per_request": api_sys / n * 1e3,
        "api_ctx_switches_per_request": switches / n,
        "adds_messages": len(eng["adds"]),
        "adds_read": adds_read,
        "steps_ms": steps_ms,
        "steps_before_last_admission": sum(1 for t in turns if t[0] < last_admit),
        "stage_median_ms": per,
        "own_ms_mean": own,
    }


def burst_main(args) -> None:
    import tempfile

    from unikv.serving.app import create_app
    from unikv.serving.engine_client import ProcEngine

    trace = ApiTrace()
    sys.setswitchinterval(0.0005)  # as ``unikv serve`` runs (--switch-interval-ms 0.5)
    with tempfile.TemporaryDirectory(prefix="unikv-burst-") as tmp:
        model = burst_dir(Path(tmp) / "tiny")
        llm = ProcEngine({"model": str(model), "device": "cpu", "page_size": 16,
                          "max_num_seqs": args.burst, "max_model_len": 64,
                          "max_num_batched_tokens": 2048, "kv_cache_bytes": 64 << 20,
                          "admission_window_ms": args.admission_window_ms})  # fmt: skip
        port = free_port()
        server = ServerThread(create_app(llm, served_model_names=["bench"], max_waiting=None), port)
        import gc

        gc.collect()  # as ``unikv serve`` does after start-up
        gc.freeze()
        try:
            burst_once(llm, trace, port, 16, args.burst_tokens)  # warm-up
            rows = [burst_once(llm, trace, port, args.burst, args.burst_tokens)
                    for _ in range(args.burst_rounds)]  # fmt: skip
        finally:
            server.stop()
    keys = ["spread_ms", "admission_spread_ms", "handler_spread_ms", "last_done_ms",
            "api_cpu_ms_per_request", "api_sys_ms_per_request", "api_ctx_switches_per_request",
            "adds_messages", "steps_before_last_admission"]  # fmt: skip
    summary = {k: float(np.median([r[k] for r in rows])) for k in keys}
    print(json.dumps({"tag": args.tag, "median": summary, "rounds": rows}, indent=1))
    path = Path(args.out)
    old = json.loads(path.read_text()) if path.exists() else {}
    old[f"burst:{args.tag}"] = {"median": summary, "rounds": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rates", default="8000,16000,32000,64000,0", help="deltas/s; 0: flat out")
    p.add_argument("--busy-us", type=float, default=200.0, help="engine busy loop per step")
    p.add_argument("--app", default="unikv.serving.app", help="module with create_app")
    p.add_argument("--app-path", default=None, help="a folder to import --app from")
    p.add_argument("--tag", default="after")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/serving_overhead_cpu.json"))
    p.add_argument(
        "--burst",
        type=int,
        default=0,
        help="the burst trace instead: N chat requests at once (real engine process)",
    )
    p.add_argument("--burst-tokens", type=int, default=4, help="max_tokens of each")
    p.add_argument("--burst-rounds", type=int, default=5)
    p.add_argument("--admission-window-ms", type=float, default=0.0,
                   help="the burst's engine: EngineConfig.admission_window_ms (0: off)")  # fmt: skip
    p.add_argument("--client", nargs=3, type=int, help=argparse.SUPPRESS)
    p.add_argument("--burst-client", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        return client_main(*args.client)
    if args.burst_client:
        port, n, tokens, start = args.burst_client
        return burst_client_main(int(port), int(n), int(tokens), float(start))
    if args.burst:
        return burst_main(args)
    if args.app_path:
        sys.path.insert(0, args.app_path)
    create_app = importlib.import_module(args.app).create_app
    texts, detok_us = stream_texts(word_tokenizer(), 64, args.tokens)
    llm = FakeLLM(texts, calibrate(args.busy_us))
    port = free_port()
    server = ServerThread(create_app(llm, served_model_names=["bench"], max_waiting=None), port)
    try:
        rows = [run_rate(server, llm, port, args, float(r)) for r in args.rates.split(",")]
    finally:
        server.stop()
    print(f"{args.app} ({args.tag}): {args.streams} streams x {args.tokens} tokens; CPU")
    print(
        "offered/s  delivered/s  cpu_us/delta  (user  sys)  capacity/s  itl_p50_ms  itl_p99_ms"
        "  busy_slowdown"
    )
    for r in rows:
        off = f"{r['offered_deltas_per_s']:.0f}" if r["offered_deltas_per_s"] else "flat-out"
        print(
            f"{off:>9}  {r['delivered_deltas_per_s']:>11.0f}  {r['serving_cpu_us_per_delta']:>12.1f}"
            f"  ({r['serving_user_us_per_delta']:>4.0f} {r['serving_sys_us_per_delta']:>4.0f})"
            f"  {r['serving_cpu_capacity_deltas_per_s']:>10.0f}  {r['itl_p50_ms']:>10.2f}"
            f"  {r['itl_p99_ms']:>10.2f}  {r['engine_gil_slowdown']:>12.2f}"
        )
    print(f"engine-side incremental detokenizer: {detok_us:.1f} us/token (not in the figures)")
    payload = {
        "tag": args.tag, "app": args.app, "machine": f"CPU ({platform.processor() or 'x86'}, "
        f"{os.cpu_count()} cores, this machine)", "python": platform.python_version(),
        "streams": args.streams, "tokens": args.tokens, "busy_us": args.busy_us,
        "detokenizer_us_per_token": detok_us, "rows": rows,
    }  # fmt: skip
    path = Path(args.out)
    old = json.loads(path.read_text()) if path.exists() else {}
    old[args.tag] = payload
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old, indent=1))
    print(f"saved {path} [{args.tag}]")


if __name__ == "__main__":
    main()
