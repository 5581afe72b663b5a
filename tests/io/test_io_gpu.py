"""Page I/O on a CUDA pool (run with ``-m gpu`` on the device machine): pinned
host tier on side streams, both copy paths, offload and reload at once, the
allocator-level tiering with real events, save/restore, and an NCCL transfer
when two GPUs are present. Same oracles as the CPU tests."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unikv.ids import PhysicalPageIds, VirtualPageIds
from unikv.io import HostTier, restore_pages, save_pages
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CONFIG = SubPoolConfig("kv", MHASpec(4, 8, 128, dtype=torch.bfloat16), page_size=16)  # 256 KiB


def _pool(pages: int, seed: int, device: str = "cuda") -> UnifiedPool:
    pool = UnifiedPool([CONFIG], pool_bytes_for([CONFIG], {"kv": pages}), device)
    gen = torch.Generator(device=device).manual_seed(seed)
    pool.buffer.copy_(
        torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, device=device, generator=gen)
    )
    return pool


def _rows(pool: UnifiedPool) -> torch.Tensor:
    sub = pool["kv"]
    return pool.buffer[: sub.num_pages * sub.page_bytes].view(sub.num_pages, sub.page_bytes)


def _ids(pages: list[int], device: str = "cpu") -> PhysicalPageIds:
    return PhysicalPageIds(torch.tensor(pages, device=device), "kv")


@pytest.mark.parametrize("ids_device", ["cpu", "cuda"])
@pytest.mark.parametrize("direct_min", [0, 1 << 40])
def test_offload_and_reload_at_once_on_side_streams(direct_min: int, ids_device: str) -> None:
    pool = _pool(64, seed=1)
    rows = _rows(pool)
    perm = (torch.randperm(pool["kv"].usable_pages) + pool["kv"].first_page).tolist()
    a, b, c = perm[:20], perm[20:40], perm[40:60]
    tier = HostTier(pool, "kv", 40, direct_min_bytes=direct_min, staging_bytes=5 << 18)
    assert tier.host.is_pinned()
    want_a, want_b = rows[a].clone(), rows[b].clone()
    held = tier.offload(_ids(b, ids_device))
    # reload b into c while a goes out: the two directions overlap
    out, back = tier.offload(_ids(a, ids_device)), tier.reload(held.host_slots, _ids(c, ids_device))
    assert out.event is not None and back.event is not None
    back.wait()  # the current stream orders itself after the reload
    assert torch.equal(rows[c], want_b)
    out.synchronize()
    assert torch.equal(tier.host[out.host_slots.data], want_a.cpu())


def test_tiering_with_real_events() -> None:
    from unikv.allocator import PoolAllocator
    from unikv.io.tiering import Tiering

    pool = _pool(32, seed=2)
    alloc = PoolAllocator(pool, max_requests=4, max_context=512)
    slot = alloc.new_request()
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([160])) is not None
    vpages = VirtualPageIds(alloc.parts.requests.req_to_token[slot, :160:16].long() // 16, "kv")
    tiering = Tiering(alloc, HostTier(pool, "kv", 16))
    rows = _rows(pool)
    want = rows[
        torch.from_numpy(alloc.parts.books["kv"].v2p_host[vpages.data.cpu().numpy()]).long()
    ].clone()
    off = tiering.offload(vpages)
    off.copy.synchronize()
    rows.fill_(0)  # every device copy is gone; only the host tier has the bytes
    copy = tiering.reload(off)
    assert copy is not None
    copy.wait()
    phys = torch.from_numpy(alloc.parts.books["kv"].v2p_host[vpages.data.cpu().numpy()]).long()
    assert torch.equal(rows[phys.cuda()], want)
    copy.synchronize()
    assert tiering.num_in_flight == 0
    alloc.check_integrity()


def test_save_restore_from_and_to_cuda(tmp_path) -> None:
    source, target = _pool(16, seed=3), _pool(16, seed=4)
    save_pages(tmp_path / "p.safetensors", source, {"kv": _ids([3, 9, 5], "cuda")})
    restore_pages(tmp_path / "p.safetensors", target, {"kv": _ids([12, 2, 7], "cuda")})
    assert torch.equal(_rows(target)[[12, 2, 7]], _rows(source)[[3, 9, 5]])


def _nccl_worker(rank: int, port: int, out_dir: str) -> None:
    from unikv.io import recv_pages, send_pages

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    device = f"cuda:{rank}"
    source = _pool(16, seed=5, device=device)
    if rank == 0:
        send_pages(source, {"kv": _ids([3, 9, 5], device)}, 1)
        ok = True
    else:
        target = _pool(16, seed=6, device=device)
        recv_pages(target, {"kv": _ids([12, 2, 7], device)}, 0)
        ok = torch.equal(_rows(target)[[12, 2, 7]], _rows(source)[[3, 9, 5]])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"ok": bool(ok)}))
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL transfer needs two GPUs")
def test_nccl_transfer_between_two_gpus(tmp_path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(
        _nccl_worker, args=(port, str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "NCCL transfer did not finish in time"
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"ok": True}
