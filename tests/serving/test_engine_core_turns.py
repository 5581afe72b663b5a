"""The engine process's loop (``engine_core.serve_all``) in this process, fed over
inproc ZeroMQ sockets as the API process feeds it: one thread, every queued
request admitted together, one output message per step.

Oracles: ``LLM.generate`` on the same prompts (each completion's tokens), the
scheduler's own step count (``Stats.steps``) against the step histogram, a
naive bucket search against ``StepTimes``' buckets, and the messages counted
as they arrive (one ``acks`` for a drained burst, one ``out`` per step whose
completion count is the whole burst from the first step on).
"""

from __future__ import annotations

import threading
from functools import partial
from itertools import pairwise

import msgspec
import numpy as np
import pytest
import torch
import zmq
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import save_instruct_llama

from unikv.engine import LLM, SamplingParams
from unikv.engine.step_times import EDGES_S, PHASES, StepTimes, quantile
from unikv.engine.structured import compile_structured
from unikv.serving.engine_core import Core, encode_params, serve_all

pytestmark = pytest.mark.usefixtures("one_thread")
BURST, NEW = 6, 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    save_instruct_llama(path)
    return path


@pytest.fixture
def llm(model_dir):  # a served loop stays shut down: one LLM per test
    return LLM(model_dir, device="cpu", page_size=4, max_model_len=64, max_num_seqs=8,
               max_num_batched_tokens=256)  # fmt: skip


def _prompts() -> list[list[int]]:
    return [[5 + i, 17, 33 + 2 * i, 9, 40 + i] for i in range(BURST)]


class Channel:
    """The API process's side: a PUSH bound for inputs, a PULL bound for outputs."""

    def __init__(self, ctx, tag: str) -> None:
        self.addr_in, self.addr_out = f"inproc://in-{tag}", f"inproc://out-{tag}"
        self.push, self.pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self.push.bind(self.addr_in)
        self.pull.bind(self.addr_out)
        self.enc, self.dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()

    def send(self, msg) -> None:
        self.push.send(self.enc.encode(msg))

    def recv(self, timeout_ms: int = 30000):
        assert self.pull.poll(timeout_ms), "the engine loop sent nothing in time"
        return self.dec.decode(self.pull.recv())


def _serve(llm, ctx, chan: Channel):
    """serve_all over ``chan`` in a thread (its loop adopted by that thread)."""
    core = Core(llm.engine, llm.requests, llm.reset_prefix_cache,
                partial(compile_structured, llm), ctx, [chan.addr_out], None)  # fmt: skip
    pull = ctx.socket(zmq.PULL)
    pull.connect(chan.addr_in)
    box = []
    run = lambda: box.append(serve_all([core], [(pull, core, 0)]))
    thread = threading.Thread(target=run, daemon=True)
    return core, pull, thread, box


def _stop(ctx, chan: Channel, core, pull, thread) -> None:
    """Stop the loop and close every socket ``_serve`` and ``chan`` opened."""
    chan.send(("stop",))
    thread.join(30)
    pull.close()
    core.main_outs[0].close()
    chan.push.close()
    chan.pull.close()
    ctx.term()


def test_burst_one_acks_one_out_per_step_tokens_equal_generate(llm):
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
    ctx = zmq.Context()
    chan = Channel(ctx, "burst")
    core, pull, thread, box = _serve(llm, ctx, chan)
    # the whole burst is queued before the loop's first turn: one drain takes it
    for key, ids in enumerate(_prompts()):
        chan.send(("add", key, [(ids, encode_params(params))], None, 100 + key))
    chan.send(("add", BURST, [(_prompts()[0], encode_params(params))], None, 100 + BURST))
    logprobs = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    chan.send(("add", BURST + 1, [(_prompts()[1], encode_params(logprobs))], None, 200))
    chan.send(("abort", [BURST]))  # the same drain: the adds are handled before the abort
    thread.start()
    try:
        acks = chan.recv()
        assert acks == ["acks", [[k, None, None] for k in range(BURST + 2)]]
        got = {100 + k: [] for k in range(BURST + 1)} | {200: []}
        reasons, outs, lp_rows = {}, [], []
        while len(reasons) < BURST + 2:
            msg = chan.recv()
            assert msg[0] == "out", msg
            outs.append(msg)
            _, wires, tokens, rows = msg
            assert len(wires) == len(tokens)
            for w, t in zip(wires, tokens):
                got[w].append(t)
            for w, toks, lp, reason, *_ in rows:
                got[w].extend(toks)
                if w == 200:
                    lp_rows.append((toks, lp))
                if reason is not None:
                    reasons[w] = reason
        want_reasons = {100 + k: "length" for k in range(BURST)} | {100 + BURST: "abort"}
        assert reasons == want_reasons | {200: "length"}
        assert [got[100 + k] for k in range(BURST)] == want
        # logprobs: never a bare id row; a full row per token, its logprob row with it
        assert got[200] == want[1] and 200 not in [w for o in outs for w in o[1]]
        assert [len(t) for t, _ in lp_rows] == [1] * NEW and all(len(lp) == 1 for _, lp in lp_rows)

        # one message per step, each carrying the whole burst: the first step
        # prefilled every request (admitted together), so NEW steps gave NEW messages
        def burst_of(o):
            return sorted(w for w in o[1] + [r[0] for r in o[3] if r[1]] if w < 100 + BURST)

        burst = [o for o in outs if burst_of(o)]
        assert len(burst) == NEW
        for o in burst:
            assert burst_of(o) == list(range(100, 100 + BURST))
        for o in burst[:-1]:  # running token-only rows: ids and tokens only
            assert all(r[0] == 200 for r in o[3])
        assert core.times.snapshot()["phases"]["io"]["n"] >= 1
    finally:
        _stop(ctx, chan, core, pull, thread)
    assert box == [0] and not llm.engine.running
    assert not llm.scheduler.running and not llm.scheduler.waiting


def test_call_from_another_thread_wakes_the_idle_loop(llm):
    ctx = zmq.Context()
    chan = Channel(ctx, "wake")
    core, pull, thread, box = _serve(llm, ctx, chan)
    thread.start()
    try:
        assert chan.pull.poll(200) == 0  # idle: nothing is sent
        seen = []
        future = llm.engine.call(lambda: seen.append(threading.current_thread()) or 7)
        assert future.result(timeout=10) == 7
        assert seen == [thread]  # run by the loop's (adopted) thread, between steps
    finally:
        _stop(ctx, chan, core, pull, thread)
    assert box == [0]


def test_step_times_count_generate_steps(llm):
    llm.engine.times = StepTimes()
    try:
        params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        llm.generate(_prompts(), params)
        snap = llm.engine.times.snapshot()
    finally:
        llm.engine.times = None
    phases = snap["phases"]
    for phase in ("plan", "launch", "step"):
        assert phases[phase]["n"] == llm.stats.steps, phase
    assert phases["wait"]["n"] == phases["output"]["n"] == llm.stats.steps  # each one settled
    assert phases["step"]["sum_s"] >= phases["launch"]["sum_s"]


def test_step_times_buckets_against_a_naive_search():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.exponential(0.003, 500), EDGES_S, [2.0, 0.0]])
    times = StepTimes()
    for v in values:
        times.add("output", float(v))
    h = times.snapshot()["phases"]["output"]
    naive = [int(np.sum(values <= EDGES_S[0]))]
    naive += [int(np.sum((values > lo) & (values <= hi))) for lo, hi in pairwise(EDGES_S)]
    naive += [int(np.sum(values > EDGES_S[-1]))]
    assert h["counts"] == naive and h["n"] == len(values)
    assert h["max_s"] == 2.0 and h["sum_s"] == pytest.approx(values.sum())
    p50 = quantile(h, list(EDGES_S), 0.5)
    assert np.mean(values <= p50) >= 0.5  # the bucket edge covers the median
    below = max([e for e in EDGES_S if e < p50], default=0.0)
    assert np.mean(values <= below) < 0.5  # and the edge below does not
    assert quantile(h, list(EDGES_S), 1.0) == 2.0  # above every edge: the max
    assert set(times.snapshot()["phases"]) == set(PHASES)
    assert quantile(times.snapshot()["phases"]["plan"], list(EDGES_S), 0.5) is None


def test_idle_loop_sleeps_on_its_sockets(llm):
    """An idle engine process does not spin: over a fixed wall time its loop turns
    about once per ``POLL_MS`` (it sleeps in ``poll`` on the sockets) and its
    thread uses almost no CPU; a message still wakes it at once."""
    import time

    from unikv.serving.engine_core import POLL_MS

    ctx = zmq.Context()
    chan = Channel(ctx, "idle")
    core, pull, thread, box = _serve(llm, ctx, chan)
    turns = []  # (wall, the loop thread's CPU time) at each turn
    inner = llm.engine.turn

    def counted():
        turns.append((time.perf_counter(), time.thread_time()))
        return inner()

    llm.engine.turn = counted  # (an instance attribute: serve_all calls loop.turn())
    thread.start()
    try:
        time.sleep(0.3)  # started
        first, wall = len(turns), 1.0
        time.sleep(wall)
        window = turns[first:]
        assert len(window) <= wall * 1000 / POLL_MS + 3, f"{len(window)} turns in {wall} s idle"
        assert len(window) >= 2, "the idle loop still turns (it checks its parent)"
        busy = window[-1][1] - window[0][1]
        assert busy < 0.2 * (window[-1][0] - window[0][0]), f"{busy:.3f} s CPU while idle"
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        sent = time.perf_counter()
        chan.send(("add", 0, [(_prompts()[0], encode_params(params))], None, 1))
        assert chan.recv()[0] == "acks"
        assert time.perf_counter() - sent < POLL_MS / 1000 + 2.0  # woken (a loaded host: slack)
    finally:
        _stop(ctx, chan, core, pull, thread)
    assert box == [0]


def test_full_collections_wait_for_an_idle_turn(llm):
    """While the loop serves, the collector's full pass (the longest pause, a scan
    of the whole heap) is held back to ``FULL_GC_CAP``; once due, it runs at the
    next idle turn, in the loop's thread, before it sleeps. Oracles: CPython's own
    ``gc`` counters and callbacks (``gc.collect(1)`` ten times makes a full pass due)."""
    import gc
    import time

    from unikv.serving.engine_core import FULL_GC_CAP, FULL_GC_DUE

    before = gc.get_threshold()
    ctx = zmq.Context()
    chan = Channel(ctx, "gc")
    core, pull, thread, box = _serve(llm, ctx, chan)
    busy_thresholds, full = [], []
    inner = llm.engine.turn

    def counted():
        if llm.engine.busy:
            busy_thresholds.append(gc.get_threshold())
        return inner()

    def on_gc(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(threading.current_thread())

    llm.engine.turn = counted
    thread.start()
    gc.callbacks.append(on_gc)
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        for key in range(2):
            chan.send(("add", key, [(_prompts()[key], encode_params(params))], None, key))
        ends = 0
        while ends < 2:
            msg = chan.recv()
            ends += msg[0] == "out" and sum(r[3] is not None for r in msg[3])
        assert busy_thresholds and {t[2] for t in busy_thresholds} == {FULL_GC_CAP}
        full.clear()
        for _ in range(FULL_GC_DUE):
            gc.collect(1)  # each pass of generation 1 counts toward a full one
        deadline = time.monotonic() + 5
        while thread not in full and time.monotonic() < deadline:
            time.sleep(0.02)
        assert thread in full, "a due full collection ran at an idle turn of the loop"
    finally:
        gc.callbacks.remove(on_gc)
        _stop(ctx, chan, core, pull, thread)
    assert box == [0]
    assert gc.get_threshold() == before  # restored when the loop ends


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_blocking_readback_sleeps_while_the_device_runs(model_dir):
    """The engine process's step readback (``runner.blocking_readback``, set by
    ``engine_core``) waits on its CUDA event without spinning a core: with the
    device held busy ~0.25 s after each step's launch (``torch.cuda._sleep``), the
    host thread's CPU time stays a small part of the wall time; the tokens equal
    the spinning default's."""
    import time

    from gpu_fixtures import gpu_llm

    from unikv.serving.engine_core import BLOCKING_WAIT

    assert BLOCKING_WAIT
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [o.output_ids for o in gpu_llm(model_dir, torch.float32).generate(_prompts(), params)]
    llm = gpu_llm(model_dir, torch.float32)
    llm.runner.blocking_readback = True
    llm.generate(_prompts(), params)  # warm (kernels compiled)
    hold = lambda *_: torch.cuda._sleep(int(0.25 * 1.5e9))  # ~0.25 s of device time a step
    cpu, wall = time.thread_time(), time.perf_counter()
    got = [o.output_ids for o in llm.generate(_prompts(), params, on_step=hold)]
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    assert got == want
    assert wall > 0.5 and cpu < 0.3 * wall, (cpu, wall)
