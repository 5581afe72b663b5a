"""The API process's view of the engine process (``engine_core``): ``ProcEngine``.

``ProcEngine.launch`` binds the two ZeroMQ sockets, starts the engine process
and waits for its ``ready`` (or its failure). It offers the app what
``AsyncEngine`` offers (``asubmit``, ``Submission``s fed once per engine step,
``healthy``, ``snapshot``, ``reset_prefix_cache``), and ``front``: the
tokenizer side of an LLM (tokenizer, context length, vocabulary size) that the
app tokenizes, renders chat templates and detokenizes with.

Submissions go out once per turn of the event loop: the ``add`` of every request
submitted during one turn leaves in ONE ``adds`` message at the next turn
(``_queue_add``), so a burst of HTTP requests reaches the engine together and is
planned together; any other message sent flushes the queued adds first (an
abort never overtakes its add).

The event loop itself receives the engine's messages: the output socket's
file descriptor is watched by the loop (``add_reader``), and each wake-up
drains every message queued (``DRAIN_MAX`` at most, then it goes on at the
loop's next turn). No reader thread: nothing contends for the GIL in this
process and no step costs a thread switch or a self-pipe write. The ``out``
messages drained together (one per engine step) are turned into Deltas by each
completion's ``TextStage`` (text, stop strings, logprob texts) and dispatched
to their submissions in ONE ``_dispatch``, as ``AsyncEngine`` does. A stop
string found here aborts the completion in the engine. If the engine process
exits (a ``dead`` message, or the process is found gone by a check every
``POLL_MS``: a kill -9 sends nothing), every live completion gets an error
delta, pending submissions fail with EngineClosed, ``healthy`` turns False and
``on_death`` is called on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from types import SimpleNamespace

import msgspec

from unikv.engine.online import EngineClosed, QueueFull
from unikv.serving.async_engine import Submission, _dispatch
from unikv.serving.engine_core import encode_params
from unikv.serving.text_stage import TextStage

POLL_MS = 100  # how often the event loop checks that the engine process lives
DRAIN_MAX = 256  # messages taken in one wake-up of the event loop (then it yields)
READY_TIMEOUT_S = 900.0  # loading a large checkpoint (and TP workers) takes minutes
CALL_TIMEOUT_S = 30.0


class EngineStartError(RuntimeError):
    """The engine process failed to start (its message says why)."""


def front_of(tokenizer, config, info: dict):
    """The tokenizer side of the LLM the engine process built (``ready``'s info;
    ``config`` the checkpoint's model config, as ``LLM`` reads it)."""
    import threading as th

    from unikv.engine.prompts import PromptMaker

    assert config.vocab_size == info["vocab_size"], "engine process: one checkpoint, one vocab"
    front = SimpleNamespace(
        tokenizer=tokenizer,
        tokenizer_lock=th.Lock(),
        config=config,
        max_model_len=info["max_model_len"],
        eos_token_ids=set(info["eos_token_ids"]),
        prefix_caching=info["prefix_caching"],
    )
    front.prompts = PromptMaker(tokenizer, front.tokenizer_lock, config, front.max_model_len)
    return front


class ProcEngine:
    """The engine in its own process. Args: ``config`` the engine's ``EngineConfig``
    (or ``LLM``'s keyword arguments, ``model`` among them, which make one here;
    the config itself is sent to the engine process), ``max_waiting`` the
    admission bound (None or 0: none), ``on_death(err)`` called on the event loop
    when the engine process dies, ``fault`` the test-only fault spec; ``wait``
    False: return once the process is started (``wait_ready`` before use);
    ``kv_idle`` None or ``[seconds, floor bytes]``: the engine shrinks its elastic
    pool to the floor after that long idle (``budget_broker.idle_budget``)."""

    def __init__(
        self, config, *, max_waiting=None, on_death=None, fault=None, wait: bool = True,
        kv_idle=None,
        switch_interval: float | None = None,
        spawn: bool = True,
        channel: tuple[str, str] | None = None,
        proc=None,
        peers: list | None = None,
    ) -> None:  # fmt: skip
        import pickle

        import zmq

        from unikv.engine.config import EngineConfig

        if not isinstance(config, EngineConfig):
            config = EngineConfig.of(**config)

        if max_waiting is not None and (
            isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0
        ):
            raise ValueError(
                f"max_waiting must be None or an int >= 0 (0 = no bound), got {max_waiting!r}"
            )
        self.on_death = on_death
        self.enc, self.dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        if channel is None:  # addresses of our own
            self._dir = tempfile.mkdtemp(prefix="unikv-ipc-")
            self.addr_in, self.addr_out = channel_addresses(self._dir)
        else:  # an API process of several: the addresses the first one chose (its dir)
            self._dir = None
            self.addr_in, self.addr_out = channel
        self.ctx = zmq.Context()
        self.inputs = self.ctx.socket(zmq.PUSH)
        self.inputs.setsockopt(zmq.LINGER, 0)
        self.inputs.bind(self.addr_in)
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.bind(self.addr_out)
        self._send_lock = threading.Lock()  # the event loop and ``call``'s threads send
        self._adds: list[tuple] = []  # submissions' adds of this event-loop turn (not sent)
        self.subs: dict[int, tuple[Submission, list[list[TextStage]], range]] = {}
        # completion id (numbered here, ``engine_core``'s ``add``) -> (key, prompt, index)
        self.wires: dict[int, tuple[int, int, int]] = {}
        self._next_wire = 0
        self._acks: dict[int, asyncio.Future] = {}
        self._calls: dict[int, tuple[threading.Event, list]] = {}
        self._keys = itertools.count()  # submission ids (the event loop's thread)
        self._call_ids = itertools.count()  # call ids (any thread, under _send_lock)
        self.error: str | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None  # the output socket's descriptor, while watched
        self._stopping = False
        setup = {"config": pickle.dumps(config), "inputs": self.addr_in, "outputs": self.addr_out,
                 "max_waiting": max_waiting or None, "fault": fault,
                 "parent": os.getpid(), "kv_idle": kv_idle,
                 "switch_interval": switch_interval, "peers": peers}  # fmt: skip
        self.group: set | None = None  # the channels sharing one process (ProcMulti)
        self.owner = proc is None  # this process started the engine (and ends it)
        if proc is None:
            proc = _spawn(self.enc.encode(setup)) if spawn else None  # (ProcMulti: its own)
        self.proc = proc
        self.model = config.model
        self.info: dict | None = None
        self.front = None
        self.before_stop = None  # called first by ``shutdown`` (the API processes' wait)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> ProcEngine:
        """Until the engine process has built its LLM (ValueError with its message
        when that failed, EngineStartError when it died or took too long)."""
        if self.info is None:
            from unikv.models.hub import resolve_model
            from unikv.models.loader import load_model_config, load_tokenizer

            model_dir = resolve_model(self.model)  # (a repo id: as LLM resolves it)
            tokenizer = load_tokenizer(model_dir)  # while the engine loads
            config = load_model_config(model_dir)[0]
            self.info = self._wait_ready(timeout_s)
            self.front = front_of(tokenizer, config, self.info)
        return self

    def _wait_ready(self, timeout_s: float) -> dict:
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.outputs.poll(POLL_MS):
                msg = self.dec.decode(self.outputs.recv())
                if msg[0] == "ready":
                    return msg[1]
                self.close()
                raise ValueError(msg[1]) if msg[0] == "failed" else EngineStartError(str(msg))
            if self.proc.poll() is not None:
                self.close()
                raise EngineStartError(f"the engine process exited with {self.proc.returncode}")
        self.close()
        raise EngineStartError(f"the engine process was not ready within {timeout_s} s")

    # -- the event loop ------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def healthy(self) -> bool:
        return self.error is None and self.proc.poll() is None

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the app runs on (set by ``start``; None before)."""
        return self._aloop

    def start(self) -> None:
        """Watch the engine's messages from the running event loop."""
        import zmq

        self._aloop = asyncio.get_running_loop()
        self._fd = self.outputs.getsockopt(zmq.FD)
        self._aloop.add_reader(self._fd, self._drain)
        self._aloop.call_soon(self._drain)  # queued before: the descriptor is edge-triggered
        self._aloop.call_later(POLL_MS / 1000, self._watch)

    def _unwatch(self) -> None:
        fd, self._fd = self._fd, None
        aloop = self._aloop
        if fd is not None and aloop is not None and not aloop.is_closed():
            with contextlib.suppress(Exception):  # (a loop of another thread, or gone)
                aloop.remove_reader(fd)

    def _send(self, msg) -> None:
        with self._send_lock:
            self._flush_adds_locked()  # a submission's add goes before its abort or cut
            self.inputs.send(self.enc.encode(msg), copy=False)

    def _queue_add(self, add: tuple) -> None:
        """Event loop: queue one submission's ``add``; the adds queued during one turn
        of the event loop leave together, as ONE ``adds`` message (``_flush_adds``,
        at the loop's next turn): a burst of requests reaches the engine together."""
        with self._send_lock:
            self._adds.append(add)
            first = len(self._adds) == 1
        if first:
            self._aloop.call_soon(self._flush_adds)

    def _flush_adds(self) -> None:
        with self._send_lock:
            self._flush_adds_locked()

    def _flush_adds_locked(self) -> None:
        if self._adds:
            adds, self._adds = self._adds, []
            self.inputs.send(self.enc.encode(("adds", adds)), copy=False)

    async def asubmit(self, items, cache_salt: str | None = None) -> Submission:
        """Submit (token ids, text, SamplingParams) per prompt, all or none; raises
        BadRequest (the engine refused the parameters), QueueFull or EngineClosed."""
        from unikv.serving.protocol import BadRequest

        if self.error is not None:
            raise EngineClosed(f"the engine process died: {self.error}")
        sub = Submission(self)
        key = next(self._keys)
        tok, lock = self.front.tokenizer, self.front.tokenizer_lock
        stages = [
            [TextStage(i, ids, params, tok, lock) for i in range(params.n)]
            for ids, _, params in items
        ]
        sub.key, sub.left = key, sum(len(s) for s in stages)
        ack = self._aloop.create_future()
        self._acks[key] = ack
        first = self._next_wire
        wires = range(first, first + sub.left)
        self._next_wire = wires.stop
        self.subs[key] = (sub, stages, wires)
        w = first
        for prompt, row in enumerate(stages):
            for index in range(len(row)):
                self.wires[w] = (key, prompt, index)
                w += 1
        payload = [(list(ids), encode_params(params)) for ids, _, params in items]
        self._queue_add(("add", key, payload, cache_salt, first))
        try:
            kind, message = await ack
        except asyncio.CancelledError:  # the client went away before the engine answered
            if self._forget(key) and self.error is None:
                self._send(("abort", [key]))
            raise
        finally:
            self._acks.pop(key, None)
        if kind is None:
            return sub
        self._forget(key)
        if kind == "QueueFull":
            raise QueueFull(message)
        if kind == "EngineClosed":
            raise EngineClosed(message)
        if kind != "ValueError":  # the engine could not take it: a 500 for this request
            raise RuntimeError(f"the engine refused the request: {message}")
        field = message.split(" ", 1)[0]
        raise BadRequest(message, field if field == "stop_token_ids" else None)

    def _forget(self, key: int) -> bool:
        """Drop submission ``key`` and its completion ids; whether it was known."""
        entry = self.subs.pop(key, None)
        if entry is None:
            return False
        for w in entry[2]:
            self.wires.pop(w, None)
        return True

    def abort_submission(self, sub: Submission) -> None:
        self._forget(sub.key)
        if self.error is None:
            self._send(("abort", [sub.key]))

    def call(self, name: str, *args):
        """Run ``name`` ("snapshot", "reset_prefix_cache", "resize_kv_cache") with
        ``args`` in the engine process (any thread but the event loop's, which
        receives the answer); its value, or
        RuntimeError (ValueError for a ValueError there)."""
        if self.error is not None:
            raise EngineClosed(f"the engine process died: {self.error}")
        with contextlib.suppress(RuntimeError):  # (no running loop: a thread, as it must be)
            here = asyncio.get_running_loop()
            assert here is not self._aloop, "ProcEngine.call waits for the event loop: not on it"
        done, box = threading.Event(), []
        with self._send_lock:
            cid = next(self._call_ids)
            self._calls[cid] = (done, box)
        self._send(("call", cid, name, list(args)))
        if not done.wait(CALL_TIMEOUT_S):
            self._calls.pop(cid, None)
            raise TimeoutError(f"the engine did not answer {name!r} within {CALL_TIMEOUT_S} s")
        ok, value = box
        if not ok:
            if value.startswith("ValueError: "):
                raise ValueError(value.removeprefix("ValueError: "))
            raise RuntimeError(value)
        return value

    def snapshot(self) -> dict:
        return self.call("snapshot")

    def reset_prefix_cache(self) -> bool:
        return self.call("reset_prefix_cache")

    def resize_kv_cache(self, total_bytes: int) -> int:
        return self.call("resize_kv_cache", total_bytes)

    def _leave(self) -> bool:
        """Whether no other channel of this engine process is open (always, for
        one model); this channel counts as closed from now on."""
        if self.group is None:
            return True
        self.group.discard(self)
        return not self.group

    def shutdown(self) -> None:
        self._stopping = True
        if self.before_stop is not None:  # the other API processes drain first
            self.before_stop()
        last = self._leave() and self.owner  # a model of several: its loop stops, the process waits
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):  # (it is killed below)
                self._send(("stop",))
                if last:
                    self.proc.wait(timeout=15)
        if last and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.close()

    def close(self) -> None:
        import shutil

        if self._leave() and self.owner and self.proc.poll() is None:
            self.proc.kill()
        self._unwatch()
        for s in (self.inputs, self.outputs):
            s.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # -- the event loop: the engine's messages -------------------------------------

    def _watch(self) -> None:
        """Every ``POLL_MS``: the engine process lives (a kill -9 sends nothing), and
        nothing queued was missed."""
        if self._stopping or self.error is not None or self._fd is None:
            return
        if self.proc.poll() is not None:
            self._drain()  # what it sent before it died goes out first
            if self.error is None:
                self._died(f"the engine process exited with status {self.proc.returncode}")
            return
        self._drain()
        self._aloop.call_later(POLL_MS / 1000, self._watch)

    def _drain(self) -> None:
        """Event loop: every message queued (up to ``DRAIN_MAX``; the rest at the
        loop's next turn), the steps' deltas dispatched together."""
        import zmq

        if self._stopping or self.error is not None or self._fd is None:
            return
        pairs: list = []
        sock = self.outputs
        try:
            for _ in range(DRAIN_MAX):
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # (no zmq.Again raised)
                    break
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = self.dec.decode(data)
                kind = msg[0]
                if kind == "out":
                    self._out(msg[1], msg[2], msg[3], pairs)
                elif kind == "acks":
                    for key, failed, message in msg[1]:
                        _resolve(self._acks.get(key), (failed, message))
                elif kind == "ret":
                    call = self._calls.pop(msg[1], None)
                    if call is not None:
                        call[1].extend((msg[2], msg[3]))
                        call[0].set()
                elif kind == "dead":
                    _dispatch(pairs)
                    return self._died(f"the engine loop died: {msg[1]}")
            else:  # more may be queued: go on after the loop's other work
                self._aloop.call_soon(self._drain)
        except zmq.ZMQError:  # closed at shutdown
            _dispatch(pairs)
            return
        except Exception as err:  # noqa: BLE001  (the server cannot go on without it)
            _dispatch(pairs)
            return self._died(f"the engine client failed: {type(err).__name__}: {err}")
        if pairs:
            _dispatch(pairs)

    def _later(self, fn, *args) -> None:
        aloop = self._aloop
        if aloop is not None and not aloop.is_closed():
            try:
                aloop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the event loop closed meanwhile
                pass

    def _out(self, wires: list, tokens: list, rows: list, pairs: list) -> None:
        """One step's output: its one-token rows (``wires``/``tokens``) and full
        ``rows``, their Deltas appended to ``pairs``."""
        cut = []
        plain = [None, None, None, None, None, None]  # the rest of a one-token raw row
        known, subs = self.wires, self.subs
        for w, token in zip(wires, tokens):
            ident = known.get(w)
            if ident is None:
                continue  # aborted
            key, prompt, index = ident
            sub, stages, _ = subs[key]
            stage = stages[prompt][index]
            if stage.plain and not stage.done:  # the common row: one call, no checks
                pairs.append(((sub, prompt), stage.token(token)))
            else:
                self._row(w, [token], plain, pairs, cut)
        for w, *raw in rows:
            self._row(w, raw[0], raw[1:], pairs, cut)
        if cut:
            self._send(("cut", cut))

    def _row(self, wire: int, new: list, rest: list, pairs: list, cut: list) -> None:
        """Completion ``wire``'s raw delta (``new`` tokens, then ``rest``: logprobs,
        finish, stop, error, cached, prompt logprobs) made a Delta for its stream."""
        ident = self.wires.get(wire)
        if ident is None:
            return  # aborted
        key, prompt, index = ident
        sub, stages, _ = self.subs[key]
        stage = stages[prompt][index]
        delta = stage.advance((new, *rest))
        if delta is None:
            return
        if stage.hit_stop:  # a stop string: the engine ends this completion
            stage.hit_stop = False
            if rest[1] is None:
                cut.append((key, prompt, index))
        pairs.append(((sub, prompt), delta))
        if delta.finish_reason is not None and all(s.done for r in stages for s in r):
            self._forget(key)

    def _died(self, message: str) -> None:
        if self._stopping or self.error is not None:
            return
        self.error = message
        self._unwatch()
        pairs = []
        for sub, stages, _ in list(self.subs.values()):
            for prompt, row in enumerate(stages):
                for stage in row:
                    delta = stage.failed(message)
                    if delta is not None:
                        pairs.append(((sub, prompt), delta))
        self.subs.clear()
        self.wires.clear()
        for call in list(self._calls.values()):
            call[1].extend((False, message))
            call[0].set()
        for key, ack in list(self._acks.items()):
            self._later(_resolve, ack, ("EngineClosed", f"the engine process died: {message}"))
        if pairs:
            self._later(_dispatch, pairs)
        if self.on_death is not None:
            self._later(self.on_death, RuntimeError(message))


def _spawn(setup: bytes) -> subprocess.Popen:
    """Start the engine process and hand it its (msgpack) setup on stdin."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "unikv.serving.engine_core"], stdin=subprocess.PIPE
    )
    proc.stdin.write(setup)
    proc.stdin.close()
    return proc


class ProcMulti:
    """Several models under one KV budget in ONE engine process (a ``MultiLLM``
    there: one reservation, one ``SharedBudget``, each model's loop in a thread of
    its own), with one ``ProcEngine`` channel (a socket pair) per model here.

    One process rather than one per model: the models' pools are slices of one
    reserved range and the capacity oracle moves committed chunks between them
    between steps; that needs every pool in one address space (several processes
    would need CUDA IPC handles of the reservation and a budget kept across
    processes). Args: ``models`` {served name: ``EngineConfig``} (each one's
    ``model`` is the checkpoint, whose tokenizer this process loads);
    ``total_kv_bytes`` the shared budget; ``kwargs`` the ``MultiLLM`` keyword
    arguments every model takes (``idle_seconds``/``idle_floor`` among them);
    the rest as ``ProcEngine``'s.
    """

    budget = None  # the shared budget and its idle watcher live in the engine process

    def __init__(
        self, models: dict, *, total_kv_bytes: int, kwargs: dict, max_waiting=None,
        fault=None, switch_interval: float | None = None, wait: bool = True,
        peers: list | None = None, channels: dict | None = None, proc=None,
    ) -> None:  # fmt: skip
        """``peers``: the other API processes' channels ([name, in, out] each);
        ``channels`` ({name: (in, out)}) and ``proc`` (a ``ForeignProc``): this is
        another API process's view of an engine process started elsewhere."""
        import pickle

        self.engines = {
            name: ProcEngine(config, max_waiting=max_waiting, wait=False, spawn=False,
                             channel=None if channels is None else channels[name], proc=proc)
            for name, config in models.items()
        }  # fmt: skip
        group = set(self.engines.values())
        if proc is None:
            spec = {"models": {n: c.model for n, c in models.items()},
                    "total_kv_bytes": total_kv_bytes, "kwargs": kwargs}  # fmt: skip
            setup = {"multi": pickle.dumps(spec), "max_waiting": max_waiting or None,
                     "fault": fault, "parent": os.getpid(), "switch_interval": switch_interval,
                     "channels": [[n, e.addr_in, e.addr_out] for n, e in self.engines.items()],
                     "peers": peers}  # fmt: skip
            proc = _spawn(msgspec.msgpack.encode(setup))
        for engine in self.engines.values():
            engine.proc, engine.group = proc, group
        if wait:
            self.wait_ready()

    @property
    def names(self) -> list[str]:
        return list(self.engines)

    def __getitem__(self, name: str) -> ProcEngine:
        return self.engines[name]

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> ProcMulti:
        for engine in self.engines.values():
            engine.wait_ready(timeout_s)
        return self

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def channel_addresses(directory: str) -> tuple[str, str]:
    """A fresh (input, output) pair of ZeroMQ ipc addresses in ``directory``."""
    tag = uuid.uuid4().hex[:8]
    return f"ipc://{directory}/in-{tag}", f"ipc://{directory}/out-{tag}"


class ForeignProc:
    """The engine process seen from an API process that did not start it (``unikv
    serve --api-server-count N``'s others): ``poll`` as ``Popen``'s (None while it
    runs), through a pidfd (readable once the process has exited, zombie or
    reaped); its exit status is its parent's to know. ``kill``/``wait``: not ours."""

    returncode = "unknown (the engine process is another process's child)"

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)

    def poll(self):
        import select

        if select.select([self._fd], [], [], 0)[0]:
            return self.returncode
        return None

    def kill(self) -> None:
        raise AssertionError(
            "ForeignProc: the engine process is ended by the API process owning it"
        )

    wait = kill


def _resolve(future, value) -> None:
    if future is not None and not future.done():
        future.set_result(value)


def kill_engine(engine: ProcEngine) -> None:
    """Test helper: SIGKILL the engine process (nothing is sent)."""
    os.kill(engine.pid, 9)
