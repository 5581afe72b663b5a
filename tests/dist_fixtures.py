"""Two-process torch.distributed tests on CPU: gloo over loopback, bounded.

``run_two(worker, args)`` starts ``worker(rank, port, out_dir, *args)`` in two
processes (``run_n(n, ...)`` in ``n``; its worker passes ``world_size=n`` to
``init_group``), forked from a fork server that imported torch, unikv and transformers
once for the test process, waits at most ``deadline_s`` (then kills them and fails), and
returns each rank's ``torch.load``-ed result file ``out_dir/rank{r}.pt``. A
worker calls ``init_group(rank, port, backend)`` first and ``save_result`` at the end;
collectives time out after ``TIMEOUT_S`` so a broken peer never hangs CI.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backends(ranks: int) -> list:
    """gloo on CPU always; NCCL with one GPU per rank only on a machine with ``ranks``
    GPUs (-m gpu)."""
    return [
        "gloo",
        pytest.param(
            "nccl",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < ranks, reason=f"needs {ranks} GPUs"),
            ],
        ),
    ]


BACKENDS = backends(2)


def rank_device(backend: str, rank: int) -> torch.device:
    """gloo: the CPU; nccl: GPU ``rank``."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def init_group(rank: int, port: int, backend: str = "gloo", world_size: int = 2) -> torch.device:
    """Join the ``world_size``-rank group on 127.0.0.1; returns this rank's device. gloo
    ranks use one intra-op thread; NCCL keeps NVLink multicast off."""
    device = rank_device(backend, rank)
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    return device


def save_result(out_dir: str, rank: int, result: dict) -> None:
    torch.save(result, Path(out_dir, f"rank{rank}.pt"))


# What every rank imports before its first model (torch, unikv, transformers' model
# classes: ~8 s of CPU a process): on CPU the fork server imports it once per test
# process and each rank forks from it ready (a spawned rank imports it again). On a
# GPU host the ranks are spawned: nothing forks after the CUDA driver's start. The
# ranks see the environment of the test process at its first run_n (the server's).
PRELOAD = ["unikv.engine", "transformers.models.auto.modeling_auto"]


def run_n(n: int, worker, out_dir: str, *args, deadline_s: float = 2 * TIMEOUT_S) -> list[dict]:
    """Run ``worker(rank, port, out_dir, *args)`` on ranks 0 .. n-1; their results."""
    method = "spawn" if torch.cuda.is_available() else "forkserver"
    mp.set_forkserver_preload(PRELOAD)  # (no-op once the server runs)
    ctx = mp.start_processes(
        worker, args=(free_port(), out_dir, *args), nprocs=n, join=False, start_method=method
    )
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=2):
            assert time.monotonic() < deadline, f"the {n} ranks did not finish in time"
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    files = [Path(out_dir, f"rank{r}.pt") for r in range(n)]
    return [torch.load(f, weights_only=False, map_location="cpu") for f in files]


def run_two(worker, out_dir: str, *args, deadline_s: float = 2 * TIMEOUT_S) -> list[dict]:
    """Run ``worker(rank, port, out_dir, *args)`` on ranks 0 and 1; their results."""
    return run_n(2, worker, out_dir, *args, deadline_s=deadline_s)
