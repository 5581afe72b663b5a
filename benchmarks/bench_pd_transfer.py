"""Benchmark page transfer between two instances against GPU-to-GPU ceilings.

    python benchmarks/bench_pd_transfer.py --device cuda [--out benchmarks/results/pd_transfer_h200x2.json]
    python benchmarks/bench_pd_transfer.py --device cpu --tiny   (gloo; checks that it runs)

Two processes (rank r on GPU r, NCCL; or gloo on CPU). Rank 0 holds the
prefill pool, rank 1 the decode pool; both are filled with the same random
bytes (one seed), so rank 1 can check what it received. For Llama-3-8B-shaped
page envelopes (32 layers x 8 KV heads x D128 bf16 = 128 KiB per token; page
size 1, 16, 64 -> 128 KiB, 2 MiB, 8 MiB envelopes) and N scattered source
pages (a random permutation) into N scattered destination pages, it times:

- ``transfer``: ``send_pages`` -> ``recv_pages`` end to end (handshake, gather,
  checksums on both sides, the payload, verification, the commit scatter and
  the ack), as rank 0 sees it between two barriers;
- ``nccl_raw``: one ``dist.send`` / ``dist.recv`` of a contiguous buffer of
  the same bytes (the point-to-point ceiling of this process group);
- ``peer_copy`` (GPU only, rank 0 alone): ``b.copy_(a)`` from cuda:0 to cuda:1,
  the same bytes (the NVLink copy-engine ceiling);
- ``local_overhead``: rank 0's gather + checksum of the same pages (the work a
  transfer adds on each side besides moving bytes).

Every configuration is checked byte-for-byte on rank 1 before it is timed.
GB/s = payload bytes / median seconds; each figure is also given as % of the
ceilings measured in the same run. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0), as the machines require.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import environment, save_json
from unikv.ids import PhysicalPageIds
from unikv.io import page_checksums, recv_pages, send_pages
from unikv.io.envelopes import page_rows
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

MIB = 1 << 20
FULL = {"spec": MHASpec(32, 8, 128, dtype=torch.bfloat16), "pages": [1, 16, 64], "n": [64, 512]}
TINY = {"spec": MHASpec(2, 2, 16, dtype=torch.float32), "pages": [1, 4], "n": [8, 32]}
SEED = 1234


def _pool(spec: MHASpec, page_size: int, num_pages: int, device: torch.device) -> UnifiedPool:
    """A one-sub-pool ("full") pool of ``num_pages`` pages filled with seeded random bytes."""
    configs = [SubPoolConfig("full", spec, page_size=page_size)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": num_pages}), device)
    g = torch.Generator(device=device).manual_seed(SEED)  # same bytes on both ranks
    pool.buffer.random_(0, 256, generator=g)
    return pool


def _pages(pool: UnifiedPool, n: int, salt: int) -> torch.Tensor:
    """(n,) int64 distinct random real pages (host), the same on both ranks."""
    sub = pool["full"]
    g = torch.Generator().manual_seed(SEED + salt)
    real = torch.randperm(sub.num_pages - sub.first_page, generator=g)[:n] + sub.first_page
    return real.to(torch.int64)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, reps: int) -> float:
    """Median wall seconds of ``fn()`` started together on both ranks."""
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _check(pool, src, dst, rank: int) -> None:
    """Rank 0 sends ``src``; rank 1 checks that ``dst`` now holds its own copy of ``src``."""
    if rank == 0:
        send_pages(pool, {"full": PhysicalPageIds(src, "full")}, 1)
        return
    rows = page_rows(pool, "full")
    expected = rows.index_select(0, src.to(pool.device)).clone()
    recv_pages(pool, {"full": PhysicalPageIds(dst, "full")}, 0)
    got = rows.index_select(0, dst.to(pool.device))
    assert torch.equal(got, expected), "transferred pages differ from the source pages"


def _one_config(rank, device, spec, page_size, n, reps) -> dict:
    pool = _pool(spec, page_size, 2 * n + 8, device)
    src, dst = _pages(pool, n, 1), _pages(pool, n, 2)
    _check(pool, src, dst, rank)
    src_ids = {"full": PhysicalPageIds(src, "full")}
    dst_ids = {"full": PhysicalPageIds(dst, "full")}
    nbytes = n * pool["full"].page_bytes

    def transfer():
        if rank == 0:
            send_pages(pool, src_ids, 1)
        else:
            recv_pages(pool, dst_ids, 0)

    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    raw = torch.empty(nbytes, dtype=torch.uint8, device=comm)

    def nccl_raw():
        (dist.send if rank == 0 else dist.recv)(raw, 1 - rank)

    rows = page_rows(pool, "full")
    src_dev = src.to(device)
    result = {
        "page_size": page_size,
        "envelope_bytes": pool["full"].page_bytes,
        "num_pages": n,
        "payload_bytes": nbytes,
        "transfer_s": _median_s(transfer, device, reps),
        "p2p_raw_s": _median_s(nccl_raw, device, reps),
        "local_overhead_s": _median_s(
            lambda: page_checksums(rows.index_select(0, src_dev)), device, reps
        ),
    }
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        result["peer_copy_s"] = _peer_copy_s(rank, nbytes, reps)
    return result


def _peer_copy_s(rank: int, nbytes: int, reps: int) -> float:
    """cuda:0 -> cuda:1 copy of ``nbytes`` on rank 0 (rank 1 only joins the barriers)."""
    if rank == 0:
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        fn = lambda: (b.copy_(a), torch.cuda.synchronize("cuda:1"))
    else:
        fn = lambda: None
    return _median_s(fn, torch.device("cuda", rank), reps)


def _worker(rank: int, port: int, args) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    shapes = TINY if args.tiny else FULL
    rows = [
        _one_config(rank, device, shapes["spec"], ps, n, args.reps)
        for ps in shapes["pages"]
        for n in shapes["n"]
    ]
    if rank == 0:
        _report(rows, args)
    dist.destroy_process_group()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _report(rows: list[dict], args) -> None:
    print(
        f"{'env':>9} {'pages':>6} {'MiB':>8} {'transfer':>10} {'p2p raw':>10} {'peer cp':>10} "
        f"{'%p2p':>6} {'%peer':>6} {'local':>10}"
    )
    for r in rows:
        b = r["payload_bytes"]
        r["transfer_GBps"] = _gbps(b, r["transfer_s"])
        r["p2p_raw_GBps"] = _gbps(b, r["p2p_raw_s"])
        r["local_overhead_GBps"] = _gbps(b, r["local_overhead_s"])
        r["pct_of_p2p_raw"] = 100 * r["p2p_raw_s"] / r["transfer_s"]
        peer = r.get("peer_copy_s")
        if peer:
            r["peer_copy_GBps"] = _gbps(b, peer)
            r["pct_of_peer_copy"] = 100 * peer / r["transfer_s"]
        print(
            f"{r['envelope_bytes'] / 1024:>7.1f}Ki {r['num_pages']:>6} {b / MIB:>8.1f} "
            f"{r['transfer_GBps']:>8.3f}GB {r['p2p_raw_GBps']:>8.3f}GB "
            f"{r.get('peer_copy_GBps', 0):>8.3f}GB {r['pct_of_p2p_raw']:>5.0f}% "
            f"{r.get('pct_of_peer_copy', 0):>5.0f}% {r['local_overhead_GBps']:>8.3f}GB"
        )
    if args.out:
        save_json(args.out, {"environment": environment(), "device": args.device, "rows": rows})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(f"--device cuda needs 2 GPUs, found {torch.cuda.device_count()}")
    args.reps = args.reps or (3 if args.tiny else 10)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    mp.start_processes(_worker, args=(_free_port(), args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
