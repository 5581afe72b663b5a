"""Host cost of the device operations the allocator issues each step (CUDA only).

Times, on the host (time.perf_counter around N back-to-back calls, no
synchronisation inside), one small launch of each kind:

    triton_jit      a Triton kernel through ``kernel[grid](...)`` (binder,
                    specialisation key, cache lookup, launch)
    triton_direct   the same compiled kernel through ``unikv.kernels.launch``
    torch_index     a torch ``index_select`` of the same size
    upload          one pinned-ring upload of 1k int32 (``PinnedRing``)

then profiles ``--steps`` decode steps of bench_allocator's B=256 page-16 chain
with cProfile and prints the 25 most expensive functions (own time).
Saves JSON to benchmarks/results/launch_overhead_cuda.json.

    python benchmarks/launch_overhead.py [--steps 100]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pathlib
import pstats
import time

import numpy as np
import torch

from unikv.allocator.device import PinnedRing
from unikv.kernels import table_update


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def launches() -> dict:
    n = 256
    ids = torch.randint(0, 4096, (n,), dtype=torch.int32, device="cuda")
    v2p = torch.arange(8192, dtype=torch.int32, device="cuda")
    out = torch.empty(n, dtype=torch.int32, device="cuda")
    kernel = table_update._translate_kernel
    grid = (1,)

    def jit():
        kernel[grid](ids, v2p, out, n, MULT=16, PS=16, BLOCK=256)

    result = {"triton_jit": per_call_us(jit)}
    try:
        from unikv.kernels.launch import launcher

        fast = launcher(kernel)

        def direct():
            fast(grid, ids, v2p, out, n, MULT=16, PS=16, BLOCK=256)

        result["triton_direct"] = per_call_us(direct)
    except ImportError:
        pass
    result["torch_index"] = per_call_us(lambda: v2p.index_select(0, ids))
    ring = PinnedRing(torch.device("cuda"))
    array = np.arange(1024, dtype=np.int32)
    result["upload"] = per_call_us(lambda: ring(array))
    result["current_stream"] = per_call_us(lambda: torch.cuda.current_stream().cuda_stream)
    return result


def profile(steps: int) -> str:
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import bench_allocator as bench

    rng = np.random.default_rng(0)
    alloc, slots, lens = bench.build(256, 16, steps + 40, "cuda", rng)
    parts = bench.step_parts(alloc, slots, lens, "cuda")

    def step():
        for fn in parts.values():
            fn()
        event = torch.cuda.Event()
        event.record()
        alloc.mark_in_flight(event)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        step()
        if i % 16 == 15:
            torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    result = launches()
    for name, us in result.items():
        print(f"{name:>16}: {us:7.2f} us/call")
    text = profile(args.steps)
    print(text)
    out = pathlib.Path(__file__).parent / "results" / "launch_overhead_cuda.json"
    from common import environment

    out.write_text(json.dumps({**environment(), "us_per_call": result}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
