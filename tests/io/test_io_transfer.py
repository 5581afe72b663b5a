"""Transfer between two processes over gloo on loopback: byte-identical round
trip; a flipped byte, a swapped pair of pages, other specs, other page counts,
bad destination pages and a sender dying mid-way are all refused (on both
sides where the sender lives to see it) with the receiver's pool unchanged.

Rank 0 sends, rank 1 receives. Both build the sender's pool from the same seed,
so the receiver checks the bytes it got against its own copy of the source."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_io_support import CONFIGS, assert_same_contents, make_pool, naive_expected, page_contents

from unikv.ids import PhysicalPageIds
from unikv.io import PageIntegrityError, SpecMismatchError, TransferError, recv_pages, send_pages
from unikv.io.checksum import page_checksums
from unikv.io.envelopes import page_rows
from unikv.io.transfer import _handshake
from unikv.pool import SubPoolConfig

SRC = {"full": [3, 7, 5, 12], "swa": [40, 9]}
DST = {"full": [8, 2, 10, 14], "swa": [30, 100]}
SENDER_SEED, RECEIVER_SEED = 10, 11
TIMEOUT_S = 60


def _ids(pages: dict[str, list[int]]) -> dict[str, PhysicalPageIds]:
    return {n: PhysicalPageIds(torch.tensor(p), n) for n, p in pages.items()}


def _flip(name: str, staged: torch.Tensor) -> None:
    if name == "swa":
        staged[1, 17] ^= 0x01


def _swap(name: str, staged: torch.Tensor) -> None:
    if name == "full":
        staged[[0, 2]] = staged[[2, 0]]


def _outcome(fn, error: type, *needles: str) -> str:
    """'ok' if fn raises ``error`` whose message contains every needle."""
    try:
        fn()
    except error as e:
        missing = [n for n in needles if n not in str(e)]
        return "ok" if not missing else f"message lacks {missing}: {e}"
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return f"raised {type(e).__name__}: {e}"
    return f"did not raise {error.__name__}"


def _sender(out: dict) -> None:
    pool = make_pool(seed=SENDER_SEED)
    send = lambda pages=SRC: send_pages(pool, _ids(pages), 1)
    send()
    out["roundtrip"] = "ok"
    out["flip"] = _outcome(send, TransferError, "rank 1", "1 failed")
    out["swap"] = _outcome(send, TransferError, "2 failed")
    out["spec"] = _outcome(send, SpecMismatchError, pool["full"].spec.fingerprint())
    out["count"] = _outcome(lambda: send({"full": [3, 7], "swa": [40, 9]}), ValueError, "counts")
    out["refused"] = _outcome(send, ValueError, "rank 1 refused", "sink")
    # partial: the handshake and the first checksums go out, then the sender dies
    pages = {n: torch.tensor(p) for n, p in sorted(SRC.items())}
    _handshake(pool, pages, None, 1, None, torch.device("cpu"), sender=True)
    first = min(SRC)
    rows = page_rows(pool, first).index_select(0, pages[first])
    dist.send(page_checksums(rows), 1)
    out["partial"] = "ok"


def _receive_ok(out: dict) -> None:
    source, target = make_pool(seed=SENDER_SEED), make_pool(seed=RECEIVER_SEED)
    before = target.buffer.clone()
    recv_pages(target, _ids(DST), 0)
    for name, src in SRC.items():
        got = page_contents(target, name, DST[name])
        assert_same_contents(got, page_contents(source, name, src))
        before = naive_expected(before, source.buffer, source[name].page_bytes, src, DST[name])
    out["roundtrip"] = "ok" if torch.equal(target.buffer, before) else "bytes differ"


def _receiver(out: dict) -> None:
    _receive_ok(out)
    target = make_pool(seed=RECEIVER_SEED)
    before = target.buffer.clone()

    def unchanged(result: str) -> str:
        return result if torch.equal(target.buffer, before) else f"pool changed ({result})"

    recv = lambda hook=None, pages=DST: recv_pages(target, _ids(pages), 0, staging_hook=hook)
    out["flip"] = unchanged(_outcome(lambda: recv(_flip), PageIntegrityError, "'swa': [1]"))
    out["swap"] = unchanged(_outcome(lambda: recv(_swap), PageIntegrityError, "'full': [0, 2]"))
    other = [SubPoolConfig("full", CONFIGS[0].spec, page_size=8), *CONFIGS[1:]]
    mismatched = make_pool(other, seed=RECEIVER_SEED)
    kept = mismatched.buffer.clone()
    out["spec"] = _outcome(
        lambda: recv_pages(mismatched, _ids(DST), 0),
        SpecMismatchError,
        CONFIGS[0].spec.fingerprint(),
        "page_size 8",
        "page_size 4",
    )
    out["spec"] += "" if torch.equal(mismatched.buffer, kept) else " (pool changed)"
    out["count"] = unchanged(_outcome(recv, ValueError, "counts"))
    sink = {"full": [0, 2, 10, 14], "swa": [30, 100]}
    out["refused"] = unchanged(_outcome(lambda: recv(pages=sink), ValueError, "sink"))
    try:
        recv()
        out["partial"] = "did not raise"
    except Exception:  # noqa: BLE001 - gloo reports the closed peer as RuntimeError
        out["partial"] = unchanged("ok")


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    out: dict[str, str] = {}
    try:
        (_sender if rank == 0 else _receiver)(out)
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    if rank == 0:
        os._exit(0)  # die without a goodbye: the receiver sees a partial transfer
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_gloo_transfer(tmp_path) -> None:
    ctx = mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 2 * TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "transfer processes did not finish in time"
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    scenarios = ["roundtrip", "flip", "swap", "spec", "count", "refused", "partial"]
    for rank, result in enumerate(results):
        assert {s: result.get(s) for s in scenarios} == {s: "ok" for s in scenarios}, (rank, result)
