"""Host cost of the device operations the allocator issues each step (CUDA only).

Times, on the host (time.perf_counter around N back-to-back calls, no
synchronisation inside), one small launch of each kind:

    triton_jit      a Triton kernel through ``kernel[grid](...)`` (binder,
                    specialisation key, cache lookup, launch)
    triton_direct   the same compiled kernel through ``unikv.kernels.runtime.launch``
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
from unikv.kernels.tables import table_update


def per_call_us(fn, calls: int = 100, rounds: int = 30) -> float:
    """Median host time of one call, over ``rounds`` batches of ``calls`` calls,
    the device drained between batches (no queue back-pressure in the timing)."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return float(np.median(samples))


def launches() -> dict:
    from triton import knobs

    from unikv.kernels.runtime.launch import Launcher

    n = 256
    ids = torch.randint(0, 4096, (n,), dtype=torch.int32, device="cuda")
    v2p = torch.arange(8192, dtype=torch.int32, device="cuda")
    out = torch.empty(n, dtype=torch.int32, device="cuda")
    kernel = table_update._translate_kernel
    grid = (1,)
    args = (ids, v2p, out, n)
    meta = {"MULT": 16, "PS": 16, "BLOCK": 256}
    compiled = kernel[grid](*args, **meta)
    fast = Launcher(kernel)
    stream = torch._C._cuda_getCurrentRawStream(0)
    ring = PinnedRing(torch.device("cuda"))
    array = np.arange(1024, dtype=np.int32)
    pinned = torch.empty(4096, dtype=torch.int32, pin_memory=True)
    event = torch.cuda.Event()
    event.record()
    idx, table = np.arange(256), np.arange(1000)
    cases = {
        "python_call": lambda: None,
        "numpy_fancy_256": lambda: table[idx],
        "current_device": torch.cuda.current_device,
        "raw_stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "current_stream": torch.cuda.current_stream,
        "data_ptr": ids.data_ptr,
        "knobs_hook": lambda: knobs.runtime.launch_enter_hook,
        "launcher_key": lambda: fast.key(args, meta),
        "triton_jit": lambda: kernel[grid](*args, **meta),
        "triton_direct": lambda: fast(grid, *args, **meta),
        "compiled_run_raw": lambda: compiled.run(
            1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
            *args, *meta.values(),
        ),
        "torch_index": lambda: v2p.index_select(0, ids),
        "tensor_slice": lambda: v2p[10:300],
        "pinned_to_device": lambda: pinned[:1024].to("cuda", non_blocking=True),
        "ring_upload": lambda: ring(array),
        "event_record": event.record,
        "event_query": event.query,
        "new_event": torch.cuda.Event,
    }  # fmt: skip
    return {name: per_call_us(fn) for name, fn in cases.items()}


def profile(steps: int, batch: int, ps: int) -> str:
    """cProfile of ``steps`` decode_step calls of bench_allocator's chain."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import bench_allocator as bench

    rng = np.random.default_rng(0)
    alloc, slots, lens = bench.build(batch, ps, steps + 40, "cuda", rng)
    cols = alloc.parts.requests.max_pages
    names = alloc.parts.roles.token_names
    tables = {n: torch.zeros((batch, cols), dtype=torch.int32, device="cuda") for n in names}
    locs = {n: torch.zeros(batch, dtype=torch.int32, device="cuda") for n in names}

    def step():
        alloc.decode_step(slots, lens, block_tables=tables, write_ids=locs)
        lens[:] += 1
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
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    result = launches()
    for name, us in result.items():
        print(f"{name:>18}: {us:7.2f} us/call")
    from triton import knobs

    print("launch_enter_hook:", knobs.runtime.launch_enter_hook)
    for batch, ps in ((1, 16), (256, 16)):
        print(f"=== decode_step profile, B={batch} ps={ps}")
        print(profile(args.steps, batch, ps))
    out = pathlib.Path(__file__).parent / "results" / "launch_overhead_cuda.json"
    from common import environment

    out.write_text(json.dumps({**environment(), "us_per_call": result}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
