"""The engine process of ``unikv serve`` (vLLM's engine core): the scheduler and
the forward of one ``LLM``, fed over ZeroMQ by the API server process.

The API process (``engine_client.ProcEngine``) binds two ZeroMQ sockets and
starts ``python -m unikv.serving.engine_core``, writing its setup (the engine's
``EngineConfig``, pickled, the socket addresses, the admission bound) to the
child's stdin as msgpack. The child connects:

    API process                                   engine process (ONE thread)
    PUSH (inputs)  --add / abort / cut / call / stop-->  PULL
    PULL (outputs) <--ready / acks / ret / out / dead--  PUSH

One thread runs the loop and the sockets (``serve_all``, ``EngineLoop.adopt``):
nothing contends for the GIL. Each turn drains every queued input message and
admits the requests among them at once (one ``acks`` message answers them), so
a burst joins the next step; then one step launches step N and settles N-1,
whose outputs are encoded and sent while the device runs N. Idle, it sleeps in
``poll`` (no busy wait), after the garbage collector's full pass when one is due:
while serving, full passes wait for an idle turn (``quiet_gc``, up to
``FULL_GC_CAP``). On CUDA the step's one readback sleeps on its event
(``BLOCKING_WAIT``: no core spun while the device runs).

With ``--api-server-count N`` every API process has such a socket pair (a
"channel") per model: the setup's ``peers`` lists the other API processes'
addresses (bound by those processes; a connect before their bind is queued by
ZeroMQ). A request is known here by (channel, its API process's id), and its
outputs go back on its own channel only: each step sends one ``out`` message
per channel with rows in it (here a completion id carries its channel in its
bits from ``WIRE_BITS`` on, taken off before it is sent). A channel's ``stop``
closes that channel (its requests are aborted, nothing more is sent on it); a
model's loop stops when all its channels did, or when its channel 0 did (the
first API process's, which stops after the others ended); the process when
every channel did.

Messages (msgpack arrays; the first element is the kind):

    add   key, [[prompt ids, params], ...], cache salt, first completion id
          (the API process numbers a submission's completions first, first + 1,
          ... prompt by prompt, so outputs name a completion by one int)
    adds  [add, ...]   the API process's submissions of one event-loop turn, sent
          together (``ProcEngine._queue_add``): a burst arrives as few messages
    acks  [[key, None | error kind, message], ...]   one per drain
    out   wires, tokens, rows   ONE per step: ``wires``/``tokens`` (int arrays,
          same length) the running completions that gained one token and the
          token; ``rows`` every other delta in full: [completion id, token ids,
          logprob rows, finish reason, stop reason, error, cached tokens,
          prompt logprob rows]

Inputs are token ids and SamplingParams (a structured-output constraint as its
(kind, spec) source, compiled here); the engine does not tokenize or
detokenize (its groups carry no tokenizer; logprob rows carry no texts). A stop
STRING is found by the API process, which then ends that completion here
(``cut``). ``StepTimes`` (``unikv.engine.step_times``) times every step by
phase; the ``snapshot`` call returns them (``step_times``).

If the loop dies (``EngineLoop``'s fatal errors), its streams get their error
deltas, a ``dead`` message follows and the process exits with status 1; the
API process also watches the process itself (a kill -9 sends nothing). The
process exits when its parent dies (it polls its parent pid, and a send the API
process does not take within a second checks it too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from functools import partial
from time import perf_counter

import msgspec

EXIT_DEATH = 1
POLL_MS = 100
SEND_TIMEOUT_MS = 1000  # a send waits this long, then checks that the API process lives
PARENT = [os.getppid()]  # the API process's pid (its own word, from the setup, in main)
WIRE_BITS = 48  # a completion id's channel, in the engine: chan << WIRE_BITS | the API's id
BLOCKING_WAIT = True  # the step's readback sleeps on its CUDA event (no core spun; runner.py)
FULL_GC_DUE = 10  # a full collection is due after this many gen-1 passes (CPython's default)
FULL_GC_CAP = 100  # while the engine is busy, only past this many (10x rarer): ``quiet_gc``
PARAMS_KEPT = 64  # decoded SamplingParams kept by their wire form (``Core.params_of``)


def send_or_exit(sock, data) -> None:
    """Send ``data``; while the API process does not take it, wait, and end this
    process at once if the API process is gone (a PUSH socket blocks without a
    reader: it would hang forever)."""
    import zmq

    while True:
        try:
            sock.send(data, copy=False)
            return
        except zmq.Again:
            if os.getppid() != PARENT[0]:
                os._exit(0)


def _push(ctx, address: str):
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    sock.connect(address)
    return sock


FAULT_POISON = "poison-token"  # test-only: the forward raises when this token id is fed


def encode_params(params) -> dict:
    """SamplingParams as plain data (a compiled constraint as its source)."""
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    s = out["structured"]
    out["structured"] = None if s is None else [s.kind, s.spec]
    return out


def decode_params(data: dict, compile_structured):
    """SamplingParams of their wire form; ``compile_structured(kind, spec)`` compiles a
    structured-output constraint with the engine's tokenizer."""
    from unikv.engine.sampling import SamplingParams

    data = dict(data)
    s = data.get("structured")
    if s is not None:
        data["structured"] = compile_structured(s[0], s[1])
    for key in ("stop", "stop_token_ids"):
        if isinstance(data.get(key), list):
            data[key] = tuple(data[key])
    return SamplingParams(**data)


class Poison:
    """Test-only (``UNIKV_TEST_ENGINE_FAULT=poison-token:ID``): the forward raises
    when token ``marker`` is fed, so one request fails and the others go on."""

    def __init__(self, model, marker: int) -> None:
        self.model, self.marker = model, marker

    def __call__(self, input_ids, *args, **kwargs):
        if bool((input_ids == self.marker).any()):
            raise RuntimeError("poisoned input")
        return self.model(input_ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _fault(llm, spec: str | None) -> None:
    """Test-only faults, comma-separated: die-after-steps:N, poison-token:ID,
    step-delay-ms:MS (each step sleeps: a slow engine)."""
    from unikv.env import FAULT_ENV

    for one in filter(None, (spec or "").split(",")):
        kind, _, num = one.partition(":")
        if not num.isdigit():
            raise ValueError(f"{FAULT_ENV}: expected KIND:N[,KIND:N], got {spec!r}")
        if kind == "die-after-steps":
            llm.engine.die_after_steps = int(num)
        elif kind == FAULT_POISON:
            llm.runner.model = Poison(llm.runner.model, int(num))
        elif kind == "step-delay-ms":
            llm.engine.on_step = lambda *_, s=int(num) / 1000: time.sleep(s)
        else:
            raise ValueError(f"{FAULT_ENV}: unknown fault {one!r}")


class Core:
    """The engine process's state: the engine loop, what makes its requests
    (``RequestMaker``), its prefix-cache reset and constraint compiler, the sockets."""

    def __init__(
        self, loop, requests, reset_prefix_cache, compile_structured, ctx, outputs: list[str],
        max_waiting,
    ) -> None:  # fmt: skip
        from unikv.engine.step_times import StepTimes

        self.loop, self.requests = loop, requests
        self.reset_prefix_cache, self.compile_structured = reset_prefix_cache, compile_structured
        self.enc = msgspec.msgpack.Encoder()
        # one socket per channel, one thread (``serve_all``): acks, answers and steps'
        # outputs in order
        self.main_outs = self.step_outs = [_push(ctx, o) for o in outputs]
        self.open = [True] * len(outputs)  # channels not stopped
        self.groups: dict[tuple[int, int], list] = {}  # (channel, submission id) -> its groups
        self.dead = threading.Event()
        self.loop.max_waiting = max_waiting or None
        self.loop.publish = self._publish
        self.loop.publish_ids = self._publish_ids
        self.loop.on_death = self._died
        self.times = self.loop.times = StepTimes()  # host time per step, by phase
        self.budget = None  # an idle shrink's SharedBudget (started with the loop)
        self.admission_window_s = 0.0  # EngineConfig.admission_window_ms (set by _core)
        self.resize_kv = None  # resize_kv of the LLM (set by main)
        self._params: dict[bytes, object] = {}  # wire form -> SamplingParams (``params_of``)

    def params_of(self, data: dict):
        """The SamplingParams of their wire form, decoded (and validated) once per
        distinct form: a burst's requests mostly share theirs, and SamplingParams is
        immutable (``LLM.generate`` shares one between prompts too). A structured-output
        constraint is compiled per request (its matcher is the request's own)."""
        if data.get("structured") is not None:
            return decode_params(data, self.compile_structured)
        key = self.enc.encode(data)
        params = self._params.get(key)
        if params is None:
            params = decode_params(data, self.compile_structured)  # (a ValueError: not kept)
            if len(self._params) >= PARAMS_KEPT:
                self._params.clear()
            self._params[key] = params
        return params

    def send(self, msg, chan: int = 0) -> None:
        send_or_exit(self.main_outs[chan], self.enc.encode(msg))

    # -- the loop's steps ----------------------------------------------------------

    def _publish(self, pairs: list) -> None:
        self._publish_ids([], [], pairs)

    def _publish_ids(self, wires: list[int], tokens: list[int], pairs: list) -> None:
        """ONE ``out`` message per step and channel: ``wires``/``tokens`` the running
        completions that gained one token (their ids, their tokens: two int arrays),
        ``rows`` every other delta in full (finish, logprobs, several tokens, errors)."""
        rows = []
        for group, d in pairs:
            rows.append((group.tracks[d.index].wire, d.token_ids, d.logprobs, d.finish_reason,
                         d.stop_reason, d.error, group.requests[d.index].num_cached_tokens,
                         d.prompt_logprobs))  # fmt: skip
        if len(self.step_outs) == 1:  # one API process: the ids are its own
            if self.open[0]:
                send_or_exit(self.step_outs[0], self.enc.encode(("out", wires, tokens, rows)))
            return
        mask = (1 << WIRE_BITS) - 1
        per = [([], [], []) for _ in self.step_outs]
        for w, t in zip(wires, tokens):
            mine = per[w >> WIRE_BITS]
            mine[0].append(w & mask)
            mine[1].append(t)
        for row in rows:
            per[row[0] >> WIRE_BITS][2].append((row[0] & mask, *row[1:]))
        for chan, (w, t, r) in enumerate(per):
            if (w or r) and self.open[chan]:  # (a stopped channel's reader is gone)
                send_or_exit(self.step_outs[chan], self.enc.encode(("out", w, t, r)))

    def _died(self, err: BaseException) -> None:
        data = self.enc.encode(("dead", f"{type(err).__name__}: {err}"))
        for chan, out in enumerate(self.step_outs):
            if self.open[chan]:
                send_or_exit(out, data)
        self.dead.set()

    # -- between steps -----------------------------------------------------------------

    def add_all(self, adds: list, chan: int = 0) -> None:
        """Channel ``chan``'s ``add`` messages drained together: their groups made (a
        refusal stays with its request; parameters decoded once per distinct wire
        form, ``params_of``), admitted in one call
        (``EngineLoop.submit_each``), and ONE ``acks`` message answers them all."""
        acks, made = [], []
        for _, key, items, salt, first in adds:
            try:
                groups = []
                # the API process numbers the completions first, first + 1, ...
                wire = chan << WIRE_BITS | first
                for ids, params in items:
                    sp = self.params_of(params)
                    group = self.requests.make_group(
                        ids, sp, sink=True, cache_salt=salt, detokenize=False
                    )
                    group.sink = group
                    for track in group.tracks:
                        track.wire, wire = wire, wire + 1
                        track.bare = track.token_only and not track.passive
                    groups.append(group)
            except Exception as err:  # noqa: BLE001  (this request's answer; the engine goes on)
                acks.append(_refusal(key, err))
                continue
            made.append((key, groups))
        for (key, groups), err in zip(made, self.loop.submit_each([g for _, g in made])):
            if err is not None:
                acks.append(_refusal(key, err))
                continue
            ident = (chan, key)
            self.groups[ident] = groups
            for group in groups:
                group.on_done = lambda g, ident=ident: self._done(ident)
            acks.append((key, None, None))
        self.send(("acks", acks), chan)

    def _done(self, ident: tuple[int, int]) -> None:
        groups = self.groups.get(ident)
        if groups is not None and all(g.done for g in groups):
            self.groups.pop(ident, None)

    def abort(self, keys: list[int], chan: int = 0) -> None:
        for key in keys:
            for group in self.groups.pop((chan, key), ()):
                if not group.done:
                    self.loop.abort(group)

    def cut(self, items: list, chan: int = 0) -> None:
        """Stop strings the API process found: end those completions."""
        for key, prompt, index in items:
            groups = self.groups.get((chan, key))
            if groups is not None:
                self.loop.stop_completion(groups[prompt], index)

    def call(self, cid: int, name: str, args=(), chan: int = 0) -> None:
        try:
            if name == "snapshot":
                from unikv.serving.metrics import engine_snapshot

                value = self.loop.call(lambda: engine_snapshot(self.loop.core)).result(timeout=10)
                value["waiting"] += self.loop.num_queued
                value["step_times"] = self.times.snapshot()
            elif name == "reset_prefix_cache":
                value = self.reset_prefix_cache()
            elif name == "resize_kv_cache":
                value = self.resize_kv(*args)
            else:
                raise ValueError(f"unknown call {name!r}")
        except Exception as err:  # noqa: BLE001  (returned to the API process)
            self.send(("ret", cid, False, f"{type(err).__name__}: {err}"), chan)
            return
        self.send(("ret", cid, True, value), chan)

    def handle_all(self, msgs: list, chan: int = 0) -> bool:
        """Channel ``chan``'s messages, in order (the adds among them admitted
        together, before any other message); True when one was ``stop``."""
        adds = []
        for msg in msgs:
            if msg[0] == "add":
                adds.append(msg)
                continue
            if msg[0] == "adds":  # one event-loop turn's submissions of the API process
                adds.extend(msg[1])
                continue
            if adds:
                self.add_all(adds, chan)
                adds = []
            if self.handle(msg, chan):
                return True
        if adds:
            self.add_all(adds, chan)
        return False

    def handle(self, msg, chan: int = 0) -> bool:
        """One message of channel ``chan``'s API process; True when it was ``stop``
        (that channel closed: its requests aborted; the loop stops with the last)."""
        kind = msg[0]
        if kind == "add":
            self.add_all([msg], chan)
        elif kind == "adds":
            self.add_all(msg[1], chan)
        elif kind == "abort":
            self.abort(msg[1], chan)
        elif kind == "cut":
            self.cut(msg[1], chan)
        elif kind == "call":
            self.call(msg[1], msg[2], msg[3] if len(msg) > 3 else (), chan)
        elif kind == "stop":
            # channel 0 is the first API process's, which stops after the others ended
            # (drained, or killed: a channel whose process died says nothing): all end
            for c in range(len(self.open)) if chan == 0 else (chan,):
                self.open[c] = False
            if any(self.open):  # another API process still uses this model
                self.abort([key for c, key in list(self.groups) if c == chan], chan)
            else:
                self.loop.shutdown(drain=False, timeout=10)
            return True
        else:
            raise AssertionError(f"engine protocol: unknown message {kind!r}")
        return False


def _refusal(key: int, err: Exception) -> tuple:
    """The ack of a request the engine could not take (kind, message)."""
    from unikv.engine.online import EngineClosed, QueueFull

    known = isinstance(err, (QueueFull, EngineClosed, ValueError))
    kind = type(err).__name__ if known else "Error"
    return key, kind, str(err) if known else f"{type(err).__name__}: {err}"


def drain(sock, dec) -> list:
    """Every message queued on ``sock``, decoded (none: an empty list)."""
    import zmq

    msgs = []
    while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        try:
            msgs.append(dec.decode(sock.recv(zmq.NOBLOCK, copy=False)))
        except zmq.Again:
            break
    return msgs


def quiet_gc() -> bool:
    """The loop is idle: run the garbage collector's full pass now if one is due
    (whether it ran). While serving, ``serve_all`` raises the full pass's threshold
    to ``FULL_GC_CAP``, so the pauses that scan the whole heap (the largest; a step
    waits for them) run between bursts, when nothing waits, instead of mid-stream."""
    import gc

    if gc.get_count()[2] >= FULL_GC_DUE:
        gc.collect()
        return True
    return False


def serve_all(cores: list[Core], inputs: list) -> int:
    """Answer the API processes until every channel got ``stop`` (0) or a loop
    died (EXIT_DEATH). ``inputs[i]`` is (socket, its core, the channel's index in
    that core): one channel per model of a ``MultiLLM`` and per API process.

    ONE thread does everything (``EngineLoop.adopt``): each turn drains every
    input socket (all its messages; their requests admitted at once, so a burst
    joins the next step), then runs one step per model with work. A step
    launches step N, then settles N-1 (its outputs encoded and sent) while the
    device runs N, and the next turn's reads happen then too. Idle, it sleeps in
    ``poll`` on the sockets (and on a pipe that other threads' ``call`` wakes),
    after the garbage collector's full pass if one is due (``quiet_gc``)."""
    import zmq

    dec = msgspec.msgpack.Decoder()
    poller = zmq.Poller()
    for sock, _, _ in inputs:
        poller.register(sock, zmq.POLLIN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    poller.register(wake_r, zmq.POLLIN)
    for core in cores:
        core.loop.wake = partial(_wake, wake_w)
        core.loop.adopt()
        core.times.watch_gc()
        if core.budget is not None:
            core.budget.start()
    open_ = set(range(len(inputs)))
    window = max(core.admission_window_s for core in cores)  # decided once (0: none)

    def read_all() -> None:
        """Every input socket drained, its messages handled (adds admitted together)."""
        nonlocal open_
        for i in sorted(open_):
            sock, core, chan = inputs[i]
            start = perf_counter()
            msgs = drain(sock, dec)
            if not msgs:
                continue
            if core.handle_all(msgs, chan):
                open_ = {j for j in open_ if inputs[j][1].open[inputs[j][2]]}
            else:
                core.times.add("io", perf_counter() - start)

    import gc

    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], FULL_GC_CAP)  # full passes: when idle
    try:
        while open_:
            if os.getppid() != PARENT[0]:  # the API process is gone: nobody to answer
                os._exit(0)
            live = [core for core in cores if any(core.open)]  # (a few models)
            idle = not any(core.loop.busy for core in live)
            if idle and not quiet_gc() and wake_r in dict(poller.poll(POLL_MS)):
                with contextlib.suppress(BlockingIOError):  # idle: slept on the sockets
                    os.read(wake_r, 4096)
            read_all()
            if window and open_:
                admission_window(live, poller, wake_r, window, read_all)
            for core in live:
                if any(core.open) and (not core.loop.turn() or core.dead.is_set()):
                    return EXIT_DEATH
    finally:
        gc.set_threshold(*thresholds)
        for core in cores:
            core.times.unwatch_gc()
            if core.budget is not None:
                core.budget.stop()
        os.close(wake_r)
        os.close(wake_w)
    return 0


WINDOW_CAP = 10  # the admission window ends this many windows after it opened at most


def admission_window(live: list[Core], poller, wake_r: int, window: float, read_all) -> None:
    """Requests just arrived and nothing runs (no step would be delayed): wait for
    more before the first step plans them, so that a burst reaching the engine
    over some milliseconds (the API process forwards what each turn of its event
    loop received) is planned as few large prefill steps, as ``LLM.generate``
    plans it. The window closes ``window`` seconds after the last arrival, at
    ``WINDOW_CAP`` windows at most, or at once when a call is queued (``wake_r``)."""
    if not any(core.loop.num_queued for core in live):
        return
    if any(core.loop.stepping for core in live):
        return  # steps run anyway: the new requests join the next one
    start = last = perf_counter()
    seen = sum(core.loop.num_queued for core in live)
    while True:
        wait = min(last + window, start + WINDOW_CAP * window) - perf_counter()
        if wait <= 0:
            return
        ready = dict(poller.poll(wait * 1000))
        if not ready or wake_r in ready:  # quiet for a window, or a call waits
            return
        read_all()
        queued = sum(core.loop.num_queued for core in live)
        if queued > seen:
            seen, last = queued, perf_counter()
        if not any(any(core.open) for core in live):
            return


def _wake(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, OSError):  # full: a wake is pending anyway
        os.write(fd, b"w")


def ready_info(llm) -> dict:
    """What the API process needs of the engine (it loads only the tokenizer)."""
    return {
        "max_model_len": llm.max_model_len,
        "vocab_size": llm.config.vocab_size,
        "eos_token_ids": sorted(llm.eos_token_ids),
        "pool_bytes": llm.pool.total_bytes,
        "device": str(llm.device),
        "prefix_caching": bool(llm.prefix_caching),
        "switch_interval": sys.getswitchinterval(),  # as this process runs (serve's flag)
        "pid": os.getpid(),
    }


def _single(setup, ctx, outs: dict) -> tuple[list[Core], object]:
    """The one LLM of ``setup["config"]``: ([its Core], the LLM); ``outs[None]``:
    its channels' output addresses (one per API process)."""
    import pickle

    from unikv.engine.budget_broker import idle_budget
    from unikv.engine.llm import LLM

    llm = LLM(pickle.loads(setup["config"]))  # the API process's own config
    _fault(llm, setup.get("fault"))
    core = _core(llm, ctx, outs[None], setup.get("max_waiting"))
    idle = setup.get("kv_idle")  # [seconds, floor bytes]: shrink when idle
    if idle:
        core.budget = idle_budget(llm, idle[0], idle[1])  # its watcher: in serve
    return [core], llm


def _multi(setup, ctx, outs: dict) -> tuple[list[Core], object]:
    """The ``MultiLLM`` of ``setup["multi"]`` (``unikv serve --model A --model B``):
    one Core per model, each on its own socket pairs (``outs[name]``: one per API
    process); the shared budget's idle watcher starts with the first one."""
    import pickle

    from unikv.engine.multi import MultiLLM

    spec = pickle.loads(setup["multi"])  # {"models", "total_kv_bytes", "kwargs"}
    multi = MultiLLM(spec["models"], total_kv_bytes=spec["total_kv_bytes"], **spec["kwargs"])
    cores = []
    for name, outputs in outs.items():
        llm = multi[name]
        _fault(llm, setup.get("fault"))
        cores.append(_core(llm, ctx, outputs, setup.get("max_waiting")))
    cores[0].budget = multi.budget  # one watcher for every model
    return cores, multi


def _core(llm, ctx, outputs: list[str], max_waiting) -> Core:
    from unikv.engine.budget_broker import resize_kv
    from unikv.engine.structured import compile_structured

    core = Core(llm.engine, llm.requests, llm.reset_prefix_cache,
                partial(compile_structured, llm), ctx, outputs, max_waiting)  # fmt: skip
    core.resize_kv = partial(resize_kv, llm)  # the admin route's resize (within a shared budget)
    config = getattr(llm, "engine_config", None)
    if config is not None:
        core.admission_window_s = config.admission_window_ms / 1000
    runner = getattr(llm, "runner", None)
    if runner is not None:  # this thread has nothing to do while a step runs: no spin
        runner.blocking_readback = BLOCKING_WAIT
    return core


def channels_of(setup) -> list[tuple]:
    """Every channel, (model name or None, input address, output address): the
    spawning API process's first (one per model), then ``peers``' (the other API
    processes of ``--api-server-count``)."""
    if setup.get("multi"):
        own = [tuple(c) for c in setup["channels"]]
    else:
        own = [(None, setup["inputs"], setup["outputs"])]
    return own + [tuple(c) for c in setup.get("peers") or ()]


def main() -> int:
    import zmq

    setup = msgspec.msgpack.decode(sys.stdin.buffer.read())
    PARENT[0] = setup["parent"]  # (when it died before this started, getppid() is not it)
    if setup.get("switch_interval"):  # the loop thread beside the input reader (serve's flag)
        sys.setswitchinterval(setup["switch_interval"])
    if os.getppid() != PARENT[0]:
        return 0
    ctx = zmq.Context()
    multi = bool(setup.get("multi"))
    channels = channels_of(setup)
    outs: dict = {}  # model name (None: the one model) -> its channels' output addresses
    for name, _, out in channels:
        outs.setdefault(name, []).append(out)
    pulls = []
    for _, address, _ in channels:  # connected while the model loads
        pulls.append(ctx.socket(zmq.PULL))
        pulls[-1].connect(address)
    try:
        cores, built = (_multi if multi else _single)(setup, ctx, outs)
    except Exception as err:  # noqa: BLE001  (reported to the API processes; the first exits 2)
        for _, _, out in channels:
            boot = _push(ctx, out)
            send_or_exit(boot, msgspec.msgpack.encode(("failed", f"{type(err).__name__}: {err}")))
            boot.close()
        return 2
    by_name = dict(zip(outs, cores, strict=True))
    inputs, seen = [], {name: 0 for name in outs}
    for (name, _, _), sock in zip(channels, pulls, strict=True):
        core, chan = by_name[name], seen[name]
        seen[name] += 1
        inputs.append((sock, core, chan))
        llm = built[name] if multi else built
        core.send(("ready", ready_info(llm)), chan)  # first on its channel's main socket
    import gc

    gc.collect()  # the model, its modules and the imports are kept for good: out of the
    gc.freeze()  # collector's full passes (each a pause of every step while serving)
    rc = serve_all(cores, inputs)
    for core in cores:
        for sock in core.main_outs + core.step_outs:
            sock.close()
    for sock, _, _ in inputs:
        sock.close()
    ctx.term()
    return rc


if __name__ == "__main__":
    sys.exit(main())  # (a normal exit: atexit hooks run, e.g. a TP launcher's worker cleanup)
