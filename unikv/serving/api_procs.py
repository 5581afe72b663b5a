"""``unikv serve --api-server-count N``: N API server processes (HTTP,
tokenization, detokenization, SSE; each its own event loop and GIL) in front of
ONE engine process, as vLLM's ``--api-server-count``.

The first API process (the one started) is the supervisor: it binds the port,
starts the engine process, starts the N-1 others (``python -m
unikv.serving.api_procs``, their setup on stdin as msgpack) and serves HTTP too.

The port: the first process binds N listening sockets to the same address with
``SO_REUSEPORT`` and hands socket k to process k (an inherited descriptor).
Linux spreads new connections over the N sockets by a hash of the connection's
addresses, so a burst of connections lands evenly (one socket shared by all
would let the first event loop to wake accept a whole burst: asyncio accepts up
to its backlog in one wake-up; measured 63 of 64 connections on one process).
Binding all N here checks the port once, before any model loads (a port in use
fails start-up with status 2). The cost of ``SO_REUSEPORT``: another process of
the same user that also sets it could join the port; and connections queued on
one process's socket are reset if that process ends (the server then ends
anyway: see below).

The engine: each API process has its own channel (a ZeroMQ socket pair) per
model to the engine process; the addresses of processes 1..N-1 are chosen here
and given to the engine process as its ``peers`` (``engine_core``), which sends
each request's outputs back on the channel it came from.

Failures: an API process whose engine process dies exits with status 1 (it
watches the engine through a pidfd, ``engine_client.ForeignProc``); if any API
process 1..N-1 exits while the server runs, the first one reports it and exits
1 too (and with it the engine process and the others). SIGTERM or SIGINT to the
first process is passed on (SIGTERM) to the others (their own process group,
so a terminal's Ctrl-C reaches only the first): every process drains its
streams for ``--shutdown-timeout``, and the engine process stops once all of
them did. Metrics: ``metrics.SharedFigures`` (every scrape adds all up).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import msgspec

BACKLOG = 2048  # as uvicorn's default
STOP_GRACE_S = 10.0  # after its own drain, how long the first waits for the others


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on (``host``, ``port``), ``SO_REUSEPORT`` (port
    0: the one the kernel chose for the first); ValueError naming the flags if
    the address cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as err:
        raise ValueError(f"--host {host!r}: {err}") from None
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            address = sock.getsockname()
            sock.listen(BACKLOG)
    except OSError as err:
        for sock in socks:
            sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} ({err}); give a free --port or --host"
        ) from None
    return socks


class ApiPlan:
    """The channels of API processes 1..N-1 (their ZeroMQ addresses, chosen
    before the engine process starts) and the directory of the shared metrics."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.dir = tempfile.mkdtemp(prefix="unikv-api-")
        self.channels: list[list] = [[] for _ in range(count - 1)]  # [name, in, out] each

    def peers(self, names: list) -> list[list]:
        """The engine process's ``peers``: a channel per model (``names``; [None]
        for one model) per API process 1..N-1, in that order."""
        from unikv.serving.engine_client import channel_addresses

        out = []
        for mine in self.channels:
            for name in names:
                mine.append([name, *channel_addresses(self.dir)])
                out.append(mine[-1])
        return out

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


class ApiProcs:
    """API processes 1..N-1, started by the first (``argv``: ``unikv serve``'s own;
    ``socks[k-1]``: process k's listening socket, closed here once handed over)."""

    def __init__(self, argv: list[str], socks: list, plan: ApiPlan, engine_pid: int) -> None:
        self.procs: list[subprocess.Popen] = []
        self.stopping = False
        for k, sock in enumerate(socks, start=1):
            setup = {"argv": argv, "index": k, "count": plan.count, "fd": sock.fileno(),
                     "engine_pid": engine_pid, "channels": plan.channels[k - 1],
                     "metrics_dir": plan.dir, "parent": os.getpid()}  # fmt: skip
            proc = subprocess.Popen(
                [sys.executable, "-m", "unikv.serving.api_procs"], stdin=subprocess.PIPE,
                pass_fds=[sock.fileno()], start_new_session=True,
            )  # fmt: skip
            proc.stdin.write(msgspec.msgpack.encode(setup))
            proc.stdin.close()
            sock.close()
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def watch(self, on_exit) -> None:
        """``on_exit(message)`` (from a thread) when one of them exits before ``stop``."""

        def wait(k: int, proc: subprocess.Popen) -> None:
            rc = proc.wait()
            if not self.stopping:
                on_exit(f"API server process {k} (pid {proc.pid}) exited with status {rc}")

        for k, proc in enumerate(self.procs, start=1):
            threading.Thread(target=wait, args=(k, proc), daemon=True).start()

    def terminate(self) -> None:
        """SIGTERM to each one running: each drains as the first does."""
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def wait(self, timeout_s: float) -> list:
        """Until each has exited (killed after ``timeout_s``); their exit statuses."""
        import time

        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return [p.returncode for p in self.procs]

    def kill(self) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()


def main() -> int:
    setup = msgspec.msgpack.decode(sys.stdin.buffer.read())
    if os.getppid() != setup["parent"]:
        return 1  # the first process is gone already
    from unikv.serving.cli import serve_child

    return serve_child(setup)


if __name__ == "__main__":
    sys.exit(main())
