"""``LLM(model, tensor_parallel_size=N)``: the caller's process is rank 0 and
starts ranks 1 .. N-1 itself.

Start-up, all in ``launch`` before rank 0 builds anything:

    checks (no process, no weight yet): the size, no ``tp_group`` too, no
        torch.distributed group already in this process, no host tier or elastic
        pool, ``parallel.check_tp_config`` on the model's config, enough GPUs
    a TCPStore on a free loopback port (the OS picks it: no race)
    N-1 processes (torch.multiprocessing, spawn), each with a pipe to rank 0
    every rank joins the group: NCCL with GPU ``base + rank`` per rank when the
        device is CUDA, gloo on the CPU; collectives time out (``UNIKV_TP_TIMEOUT_S``,
        300 s: a rank's first Triton compiles fit)
    every rank builds the same engine from the same ``EngineConfig`` (sent, pickled,
        to each worker) over ``tp_group=WORLD`` (its shard, its pool)
    rank 0 waits for each worker's "ready" (or its error, which it raises)

Mirroring: the workers run the same SPMD steps as rank 0 because they run the
same engine loop (``online.EngineLoop``) over the same inputs. The loop's state
changes only through its inputs, so rank 0's loop (``LeaderLoop``) sends each
input, in the order it applies it, to every worker's pipe as one small pickled
message, and each worker (``tp_worker.follow``) applies it to its own loop:

    ("step", isolate, new groups, aborted group ids)   at the start of each step
    ("call", Engine method name, args)                 a state-changing call
                                                       (resize_now, reset_prefix_now)
    ("recover",)  ("stop",)  ("close",)

Pipes rather than a broadcast on a side gloo group: an idle server leaves the
workers waiting for minutes or days, which a pipe allows (a collective would
time out), and a pipe tells a worker that rank 0 is gone (end of file).

Everything a step does after its inputs is deterministic on every rank: the
schedule, the allocator, the forward (whose all-reduces pair up), the sampler
(every rank has the same logits and seeds), stop tokens and stop strings (every
rank detokenizes), and the failure isolation. Rank 0 sends without waiting:
the collectives inside the forward keep the ranks in step, and a pipe write
costs microseconds. Only rank 0 has streams, futures and outputs; a worker's
groups get a sink that drops their deltas (so that they are watched exactly
when rank 0's are). Requests travel as their ids, prompt, parameters and seeds
(a structured-output constraint as its source, compiled again by the worker).

Failures: a worker that dies (or fails to start) gives rank 0 a
``TensorParallelError`` naming its rank, its exit code and its last error, never
a hang: a watcher thread notices the exit at once, the next send or the failed
collective raises (gloo fails a collective with a closed peer at once; NCCL's
collectives are aborted by the watcher, and time out otherwise). Any failed
collective is fatal for the engine (the ranks are out of step), and so is a step
that rank 0 alone leaves (Ctrl-C): the serving loop dies (``unikv serve`` exits
non-zero); ``generate`` raises each time. A worker
whose rank 0 went away (its pipe closed) exits. ``LLM.close()``, ``with``, or
the interpreter's exit (``atexit``) stops the workers: "close", a bounded join,
then kill; rank 0 then destroys its process group, so a second TP LLM can start.

A script that builds a TP LLM at import must guard it with
``if __name__ == "__main__":`` (spawned workers import the main module).
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
import threading
import weakref
from datetime import timedelta
from functools import partial
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unikv.engine.online import EngineLoop
from unikv.engine.tp_worker import collective_error, group_message, receive, worker_main
from unikv.engine.tp_worker import send as send_one

TIMEOUT_ENV = "UNIKV_TP_TIMEOUT_S"  # start-up's and collectives' limit (env.FLAGS.tp_timeout_s)
JOIN_S = 10.0  # close(): how long a worker may take to exit before it is killed
DEATH_GRACE_S = 2.0  # a failed collective: how long to wait for a worker's exit to show
# LLM options that do not combine with tensor parallelism (yet), and their defaults
REFUSED = {
    "speculative_config": None,  # refused under TP (engine/speculative)
    "swap_host_bytes": 0,  # every rank must make the same swap decisions
    "prefix_host_bytes": 0,  # the reload rule measures each rank's own bandwidth
    "kv_cache_max_bytes": None,  # an elastic pool: every rank would have to resize alike
    "kv_cache_margin_bytes": None,
}


class TensorParallelError(RuntimeError):
    """A worker died or a collective failed: the ranks are out of step and this
    LLM cannot go on (close it; a new one can be built)."""


def timeout_s() -> float:
    """Start-up's and each collective's limit (``UNIKV_TP_TIMEOUT_S``, read by
    ``unikv.env``; the workers get rank 0's value)."""
    from unikv import env

    return env.FLAGS.tp_timeout_s


def check_launch(config, tp_group=None) -> list[torch.device]:
    """Refuse what cannot start, before any process or weight: returns each rank's device."""
    from unikv.engine.options import model_dir_of
    from unikv.models.loader import load_model_config
    from unikv.models.parallel import check_tp_config

    size = config.tensor_parallel_size
    if tp_group is not None:
        raise ValueError(
            "give tensor_parallel_size (unikv starts the ranks) or tp_group (you started "
            "them and build the LLM in every rank), not both"
        )
    if not dist.is_available():
        raise ValueError("tensor_parallel_size > 1 needs torch.distributed, absent in this torch")
    if dist.is_initialized():
        raise ValueError(
            "tensor_parallel_size starts its own process group, but torch.distributed is "
            "already initialised in this process; pass tp_group=<your group> instead (and "
            "build the LLM in every rank), or destroy the group first"
        )
    for name, default in REFUSED.items():
        if getattr(config, name) != default:
            raise ValueError(
                f"{name}={getattr(config, name)!r} is not supported with tensor parallelism yet; "
                f"leave it at {default!r} with tensor_parallel_size={size}"
            )
    model_config, _ = load_model_config(model_dir_of(config.model, None))
    check_tp_config(model_config, size)
    device = config.device
    if device.type != "cuda":
        return [device] * size
    base = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if base + size > count:
        raise ValueError(
            f"tensor_parallel_size={size} on {device} needs GPUs {base}..{base + size - 1} "
            f"(one per rank), but {count} are visible; lower it or pick device='cuda:0'"
        )
    return [torch.device("cuda", base + r) for r in range(size)]


def launch(config, tp_group=None):
    """Rank 0 of ``config.tensor_parallel_size`` ranks: check, spawn the workers,
    build every rank's engine; returns (rank 0's ``build.Engine``, the ``Workers``)."""
    from unikv.engine.build import build_engine

    devices = check_launch(config, tp_group)
    workers = Workers(devices, config)
    try:
        workers.join_group(devices[0])
        core = build_engine(config.replace(device=devices[0]), dist.group.WORLD)
        workers.wait_ready()
    except BaseException as err:
        if collective_error(err):  # a worker failed first: its error is the one to show
            workers.collect_failure()
        workers.close()
        if workers.failure is not None and not isinstance(err, TensorParallelError):
            raise TensorParallelError(workers.failure) from err
        raise
    return core, workers


class Workers:
    """Ranks 1 .. N-1 of a launched LLM: processes, pipes, the watcher thread."""

    def __init__(self, devices: list[torch.device], config) -> None:
        self.size, self.timeout_s = len(devices), timeout_s()
        self.backend = "nccl" if devices[0].type == "cuda" else "gloo"
        self.failure: str | None = None  # why a worker failed or died (set once)
        self.broken = threading.Event()  # a worker died, or the ranks fell out of step
        self.on_death: list = []  # called (watcher thread) once a worker died
        self._closed = False
        self._lock = threading.Lock()  # one sender at a time
        timeout = timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, self.size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        threads = torch.get_num_threads()
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            args = (rank, self.size, self.store.port, self.backend, devices[rank], config, child)
            proc = ctx.Process(
                target=worker_main,
                args=(*args, self.timeout_s, threads),
                name=f"unikv-tp-rank{rank}",
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        _LIVE.add(self)

    def leader_loop(self, core, owner) -> LeaderLoop:
        """Rank 0's engine loop over ``core``; the workers close when ``owner`` (the
        ``LLM``) is collected unclosed."""
        weakref.finalize(owner, self.close).atexit = False
        return LeaderLoop(core, self, owner=owner)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (rank 1 first)."""
        return [p.pid for p in self.procs]

    # -- start-up ----------------------------------------------------------------------

    def _expect(self, kind: str, what: str) -> None:
        """Wait for every worker's ``kind`` message; a worker's error, exit or
        silence past the timeout raises."""
        waiting = dict(enumerate(self.conns, start=1))
        while waiting:
            sentinels = {self.procs[r - 1].sentinel: r for r in waiting}
            ready = wait([*waiting.values(), *sentinels], timeout=self.timeout_s)
            if not ready:
                self.failure = (
                    f"tensor-parallel ranks {sorted(waiting)} did not finish {what} within "
                    f"{self.timeout_s:.0f} s ({TIMEOUT_ENV})"
                )
                raise TensorParallelError(self.failure)
            for rank, conn in list(waiting.items()):
                if conn in ready or conn.poll():
                    message = receive(conn)
                    if message is not None and message[0] == kind:
                        del waiting[rank]
                        continue
                    self._failed(rank, message)
                elif self.procs[rank - 1].sentinel in ready:
                    self._failed(rank, None)

    def _failed(self, rank: int, message) -> None:
        proc = self.procs[rank - 1]
        if message is None or message[0] != "failed":
            proc.join(DEATH_GRACE_S)
            detail = f"exited with code {proc.exitcode}"
        else:
            detail = f"failed:\n{message[1]}"
        self.failure = f"tensor-parallel worker rank {rank} (pid {proc.pid}) {detail}"
        raise TensorParallelError(self.failure)

    def collect_failure(self) -> None:
        """After rank 0's build failed in a collective: the first worker error that
        arrives within ``DEATH_GRACE_S``, if any, becomes ``failure``."""
        ready = wait(self.conns, timeout=DEATH_GRACE_S)
        for rank, conn in enumerate(self.conns, start=1):
            message = receive(conn) if conn in ready else None
            if message is not None and message[0] == "failed":
                self.failure = f"tensor-parallel worker rank {rank} failed:\n{message[1]}"
                return

    def join_group(self, device: torch.device) -> None:
        """Rank 0 joins the process group once every worker is about to."""
        self._expect("joining", "starting")
        dist.init_process_group(
            self.backend,
            store=self.store,
            rank=0,
            world_size=self.size,
            timeout=timedelta(seconds=self.timeout_s),
            device_id=device if self.backend == "nccl" else None,  # NCCL: bound to its GPU
        )

    def wait_ready(self) -> None:
        """Every worker built its LLM; then the watcher starts."""
        self._expect("ready", "building the engine")
        threading.Thread(target=self._watch, name="unikv-tp-watcher", daemon=True).start()

    # -- running -------------------------------------------------------------------------

    def _watch(self) -> None:
        """Until a worker exits: then record why, and abort NCCL's collectives."""
        ready = wait([p.sentinel for p in self.procs])
        if self._closed:
            return
        rank = next(r for r, p in enumerate(self.procs, start=1) if p.sentinel in ready)
        proc, conn = self.procs[rank - 1], self.conns[rank - 1]
        proc.join(DEATH_GRACE_S)
        last = message = None
        with contextlib.suppress(Exception):
            while conn.poll() and (message := receive(conn)) is not None:  # None: at its end
                last = message
        why = f":\n{last[1]}" if last is not None and last[0] == "failed" else ""
        self.failure = (
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) died (exit code "
            f"{proc.exitcode}){why}; this LLM cannot go on: close it and build a new one"
        )
        self.broken.set()
        for callback in self.on_death:
            callback()
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if self.backend == "nccl" and abort is not None:
            with contextlib.suppress(Exception):
                abort()  # rank 0's pending NCCL collectives fail instead of waiting

    def send(self, message: tuple) -> None:
        """One message to every worker; TensorParallelError once one is gone."""
        if self.broken.is_set() or self._closed:
            raise TensorParallelError(self.failure or "the tensor-parallel workers are closed")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            for conn in self.conns:
                try:
                    conn.send_bytes(data)
                except OSError as err:  # a worker's end closed: it is exiting
                    self.broken.wait(DEATH_GRACE_S)
                    raise TensorParallelError(
                        self.failure or f"a worker went away ({err})"
                    ) from err

    def check(self, err: BaseException) -> None:
        """After ``err`` escaped a step: raise TensorParallelError if a worker died
        or ``err`` is a failed collective (the ranks are out of step)."""
        if isinstance(err, TensorParallelError):
            return
        collective = collective_error(err)
        if collective:
            self.broken.wait(DEATH_GRACE_S)  # its exit shows a moment after the socket closed
        if self.broken.is_set():
            raise TensorParallelError(self.failure) from err
        if collective:
            raise TensorParallelError(
                f"a tensor-parallel collective failed ({type(err).__name__}: {err}); the "
                "ranks are out of step: close this LLM and build a new one"
            ) from err

    def out_of_step(self, why: str) -> None:
        """Rank 0 left a step the workers may still be in: nothing can follow."""
        if self.failure is None:
            self.failure = f"{why}; the ranks are out of step: close this LLM and build a new one"
        self.broken.set()

    def close(self) -> None:
        """Stop the workers (a bounded join, then kill) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for conn in self.conns:  # also when broken: a worker that still reads ends now
                send_one(conn, ("close",))
        for proc in self.procs:
            proc.join(JOIN_S)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_S)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # (a group the watcher aborted)
                dist.destroy_process_group()
        _LIVE.discard(self)


_LIVE: set[Workers] = set()  # started and not closed


@atexit.register
def _close_all() -> None:
    """The interpreter exits: stop every launched worker (before multiprocessing
    joins its children, whose atexit hook was registered earlier and runs later)."""
    for workers in list(_LIVE):
        with contextlib.suppress(Exception):
            workers.close()


class LeaderLoop(EngineLoop):
    """Rank 0's engine loop: every input it applies goes to the workers first
    (the module docstring)."""

    def __init__(self, core, workers: Workers, *, owner=None) -> None:
        super().__init__(core, owner=owner)
        self.workers = workers
        workers.on_death.append(self._wake)

    def _wake(self) -> None:
        """A worker died: an idle serving loop wakes, and its next step raises
        (the loop dies, ``unikv serve`` exits non-zero, a supervisor restarts it)."""
        with self._cv:
            self._cv.notify()

    def _has_work(self) -> bool:
        return self.workers.broken.is_set() or super()._has_work()

    def _drain_inbox(self):
        groups, aborts = super()._drain_inbox()
        try:
            new = [group_message(g) for g in groups]
            self.workers.send(("step", self.isolate, new, [g.request_id for g in aborts]))
        except BaseException:
            with self._cv:  # nothing was taken: a dying loop still ends them
                self._inbox[:0], self._aborts[:0] = groups, aborts
            raise
        return groups, aborts

    def _invoke(self, fn):
        method = _core_method(fn, self.core)
        if method is not None:
            self.workers.send(("call", *method))
        elif (mirror := getattr(fn, "mirror", None)) is not None:  # a loop-level change
            self.workers.send(mirror)  # ("stop_completion", request id, index)
        return fn()

    def stop_work(self) -> None:
        with contextlib.suppress(TensorParallelError):
            self.workers.send(("stop",))
        super().stop_work()

    def recover(self) -> None:
        with contextlib.suppress(TensorParallelError):
            self.workers.send(("recover",))
        super().recover()

    def step(self):
        try:
            return super().step()
        except Exception as err:  # the same on every rank, unless check says otherwise
            self.workers.check(err)
            raise
        except BaseException as err:  # Ctrl-C: this rank alone left the step
            self.workers.out_of_step(f"a step was interrupted on rank 0 ({type(err).__name__})")
            raise

    def _failed_launch(self, batch, err: Exception) -> None:
        self.workers.check(err)  # a dead worker or a failed collective is fatal
        super()._failed_launch(batch, err)


def _core_method(fn, core) -> tuple[str, tuple] | None:
    """(name, args) when ``fn`` is a method of ``core`` (the ``build.Engine``; bound,
    or a partial of one)."""
    args: tuple = ()
    if isinstance(fn, partial):
        assert not fn.keywords, "tp_launch protocol: a mirrored call takes positional args"
        fn, args = fn.func, fn.args
    if getattr(fn, "__self__", None) is core:
        return fn.__name__, args
    return None
