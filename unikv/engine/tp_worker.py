"""A tensor-parallel worker (rank 1 .. N-1 of ``LLM(model, tensor_parallel_size=N)``)
and the messages rank 0 sends it (``tp_launch`` has the protocol and rank 0's side).

``worker_main`` joins the process group, builds the same LLM over its shard
(``tp_group=WORLD``) and then ``follow``s: it applies each message of rank 0's
pipe to its own engine loop, in order, until "close" or until the pipe closes
(rank 0 went away). A message that raises here is expected to raise on rank 0
too (the same inputs): it is reported on stderr and the worker goes on, except a
failed collective or a broken protocol, after which the ranks are out of step:
the worker sends its traceback and exits, which rank 0 reports.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import sys
import traceback
import weakref
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from unikv.engine.request import Request
from unikv.engine.tracks import RequestGroup


def group_message(group: RequestGroup) -> tuple:
    """What a worker needs to make the same RequestGroup."""
    first = group.requests[0]
    params, structured = first.params, None
    if params.structured is not None:  # a compiled grammar does not pickle: its source does
        structured = (params.structured.kind, params.structured.spec)
        params = replace(params, structured=None)
    seeds = [(r.request_id, r.seed) for r in group.requests]
    detokenizes = first.track.tokenizer is not None  # stop strings matched in the engine
    return (first.prompt_ids, params, structured, seeds, first.stop_ids, first.cache_salt,
            group.sink is not None, detokenizes)  # fmt: skip


def _drop(delta) -> None:
    """A worker group's sink: only rank 0 has streams."""


def rebuild(llm, message: tuple) -> RequestGroup:
    ids, params, structured, seeds, stop_ids, cache_salt, has_sink, detokenizes = message
    if structured is not None:
        from unikv.engine.structured import compile_structured

        params = replace(params, structured=compile_structured(llm, *structured))
    requests = []
    for request_id, seed in seeds:
        r = Request(request_id, list(ids), params, seed, stop_ids, llm.max_model_len)
        r.cache_salt = cache_salt
        requests.append(r)
    # as rank 0's group: without its tokenizer, stop strings are the API process's to
    # find (``unikv serve``'s engine process), and they come back as stop_completion
    tokenizer = llm.tokenizer if detokenizes else None
    return RequestGroup(requests, None, _drop if has_sink else None, tokenizer)


def collective_error(err: BaseException) -> bool:
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return any(s in text for s in ("gloo", "NCCL", "Connection closed by peer", "ProcessGroup"))


def receive(conn):
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None


def send(conn, message: tuple) -> None:
    with contextlib.suppress(OSError):
        conn.send_bytes(pickle.dumps(message))


def worker_main(rank, size, port, backend, device, config, conn, timeout, threads) -> None:
    """Rank ``rank``: join the group, build the LLM, then follow rank 0's messages."""
    from unikv.engine.llm import LLM

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it closes us
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(threads)
        send(conn, ("joining",))
        limit = timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=limit)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=size,
            timeout=limit,
            device_id=device if backend == "nccl" else None,  # NCCL: bound to its GPU
        )
        # rank 0's config on this rank's device; the ranks are started already
        llm = LLM(config.replace(device=device, tensor_parallel_size=1), tp_group=dist.group.WORLD)
    except Exception:  # noqa: BLE001  (sent to rank 0, which raises it)
        send(conn, ("failed", traceback.format_exc()))
        sys.exit(1)
    send(conn, ("ready",))
    try:
        _follow(llm, conn, rank)
    except Exception:  # noqa: BLE001  (sent to rank 0, which raises it)
        send(conn, ("failed", traceback.format_exc()))
        sys.exit(1)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _follow(llm, conn, rank: int) -> None:
    """Apply rank 0's messages to this rank's loop until "close" or rank 0 is gone."""
    loop = llm.engine
    groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> live group
    while True:
        message = receive(conn)
        if message is None or message[0] == "close":  # None: rank 0 went away
            return
        op = message[0]
        try:
            if op == "step":
                isolate, new, aborts = message[1:]
                made = [rebuild(llm, m) for m in new]
                for g in made:
                    groups[g.request_id] = g
                loop.submit_all(made, bounded=False)
                for request_id in aborts:
                    if (g := groups.get(request_id)) is not None:
                        loop.abort(g)
                loop.isolate = isolate
                loop.step()
            elif op == "call":
                getattr(llm.core, message[1])(*message[2])
            elif op == "stop_completion":  # a stop string the API process found
                if (g := groups.get(message[1])) is not None:
                    loop.stop_completion(g, message[2])
            elif op == "recover":
                loop.recover()
            elif op == "stop":
                loop.stop_work()
            else:
                raise AssertionError(f"tp_launch protocol: unknown message {op!r}")
        except Exception as err:
            if collective_error(err) or isinstance(err, AssertionError):
                raise  # out of step with rank 0: exit (rank 0 is told)
            print(f"unikv tensor-parallel rank {rank}: {op} raised {type(err).__name__}: "
                  f"{err} (rank 0 meets the same)", file=sys.stderr, flush=True)  # fmt: skip
