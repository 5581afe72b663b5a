"""Benchmark the elastic pool (issue 44's targets, same run):

    python benchmarks/bench_elastic.py --device cuda [--out benchmarks/results/elastic_h100.json]
    python benchmarks/bench_elastic.py --device cpu   (small sizes: checks that it runs)

- grow and shrink by ``--step`` bytes (1 GiB) with nothing to move, through
  ``Room.resize`` (chunk commits/releases, the fill of new bytes, the page books'
  regrid): median ms (target <= 10 ms);
- memory handed back: ``torch.cuda.mem_get_info`` before and after a shrink
  against the bytes released (target: equal within one chunk);
- a shrink that moves live pages (the DOWN band's top pages into holes below the
  new top): GB/s of bytes read + written against the device copy ceiling
  (``common.copy_ceilings``) measured in the same process (target >= 80 %).

Every moved page is checked byte for byte before the figures are saved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, save_json
from unikv.allocator import PoolAllocator
from unikv.backing import EmulatedBacking
from unikv.pool import SubPoolConfig, UnifiedPool
from unikv.specs import MHASpec

MIB, GIB = 1 << 20, 1 << 30
SPEC = MHASpec(16, 8, 128, dtype=torch.bfloat16)  # 64 KiB per token
PS = 16  # 1 MiB pages


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pool(device: torch.device, total: int, most: int) -> tuple[UnifiedPool, PoolAllocator]:
    configs = [SubPoolConfig("full", SPEC, page_size=PS)]
    backing = EmulatedBacking(2 * MIB) if device.type == "cpu" else None
    pool = UnifiedPool(configs, total, device, max_bytes=most, backing=backing)
    pages = most // pool["full"].page_bytes
    alloc = PoolAllocator(pool, max_requests=2, max_context=pages * PS)
    return pool, alloc


def grow_shrink(device: torch.device, base: int, step: int, reps: int) -> dict:
    """Median ms of resizing ``base -> base + step -> base`` with nothing live."""
    pool, alloc = _pool(device, base, base + step)
    grow, shrink, handed = [], [], []
    for _ in range(reps):
        for size, out in ((base + step, grow), (base, shrink)):
            _sync(device)
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
            t0 = time.perf_counter()
            alloc.resize(size)
            _sync(device)
            out.append((time.perf_counter() - t0) * 1e3)
            if device.type == "cuda" and size == base:
                handed.append(torch.cuda.mem_get_info(device)[0] - free)
    alloc.check_integrity()
    result = {
        "step_bytes": step,
        "chunk_bytes": pool.backing.chunk,
        "grow_ms": statistics.median(grow),
        "shrink_ms": statistics.median(shrink),
        "target_ms": 10.0,
    }
    if handed:
        result["handed_back_bytes"] = statistics.median(handed)
        result["handed_back_error_bytes"] = max(abs(h - step) for h in handed)
        result["handed_back_within_a_chunk"] = (
            result["handed_back_error_bytes"] <= pool.backing.chunk
        )
    pool.backing.close()
    return result


def shrink_with_moves(device: torch.device, live: int) -> dict:
    """A request holding ``live`` bytes at the top of the DOWN band, a freed one
    below it: shrinking by ``live`` moves every page of the first into the holes."""
    pool, alloc = _pool(device, 2 * live + 64 * MIB, 2 * live + 64 * MIB)
    pb = pool["full"].page_bytes
    tokens = live // pb * PS
    a, b = alloc.new_request(), alloc.new_request()
    for slot in (a, b):
        assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([tokens])) is not None
    book = alloc.parts.books["full"]
    held = {v: int(book.v2p_host[v]) for v in np.flatnonzero(book.v2p_host[1:] > 0) + 1}
    gen = torch.Generator(device=device).manual_seed(0)
    for v, p in held.items():  # distinct bytes per page
        env = pool.page_envelope("full", p)
        env.copy_(torch.randint(0, 255, env.shape, dtype=torch.uint8, device=device, generator=gen))
    want = {
        v: pool.page_envelope("full", p).clone()
        for v, p in held.items()
        if alloc.parts.vspace.owner[v] == a
    }
    alloc.free_request(b)
    _sync(device)
    t0 = time.perf_counter()
    moved = alloc.resize(pool.total_bytes - live)
    _sync(device)
    ms = (time.perf_counter() - t0) * 1e3
    alloc.check_integrity()
    for v, data in want.items():
        assert torch.equal(pool.page_envelope("full", int(book.v2p_host[v])), data), v
    moved_bytes = moved * pb
    result = {
        "moved_pages": moved,
        "moved_bytes": moved_bytes,
        "ms": ms,
        "GBps_read_plus_written": 2 * moved_bytes / ms / 1e6,
    }
    pool.backing.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    base, step, live = (GIB, GIB, 4 * GIB) if cuda else (64 * MIB, 64 * MIB, 64 * MIB)
    payload = {"environment": environment() if cuda else {"device": "cpu"}}
    payload["grow_shrink"] = grow_shrink(device, base, step, args.reps)
    payload["shrink_with_moves"] = shrink_with_moves(device, live)
    if cuda:
        from benchmarks.common import copy_ceilings

        ceiling = copy_ceilings()["d2d_GBps"]
        moves = payload["shrink_with_moves"]
        moves["d2d_ceiling_GBps"] = ceiling
        moves["fraction_of_ceiling"] = moves["GBps_read_plus_written"] / ceiling
        moves["target_fraction"] = 0.8
    print(payload)
    if args.out:
        save_json(args.out, payload)


if __name__ == "__main__":
    main()
