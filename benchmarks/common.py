"""Shared benchmark plumbing: timing, copy ceilings, JSON results (README.md, Results).

Times are ``triton.testing.do_bench`` medians (it flushes L2 between reps);
work under ~50 us also gets a CUDA-graph replay time. Every figure is reported
as a ratio to a ceiling or peer measured in the same process.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import torch
import triton
import triton.testing

GIB = 1 << 30


def bench_us(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median microseconds of ``fn()`` (L2 flushed between reps)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def graph_us(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median microseconds of replaying ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_us(graph.replay, warmup, rep)


def copy_ceilings(d2d_bytes: int = 4 * GIB, host_bytes: int = 2 * GIB) -> dict:
    """Device-to-device copy (bytes read + written) and pinned host<->device GB/s."""
    a = torch.empty(d2d_bytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    d2d = bench_us(lambda: b.copy_(a), 5, 30)
    a = b = None
    host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(host_bytes, dtype=torch.uint8, device="cuda")
    h2d = bench_us(lambda: dev.copy_(host, non_blocking=True), 3, 20)
    d2h = bench_us(lambda: host.copy_(dev, non_blocking=True), 3, 20)
    host = dev = None
    torch.cuda.empty_cache()
    return {
        "d2d_GBps": d2d_bytes / d2d / 1e3,
        "h2d_GBps": host_bytes / h2d / 1e3,
        "d2h_GBps": host_bytes / d2h / 1e3,
    }


def environment() -> dict:
    commit = os.environ.get("UNIKV_GIT_COMMIT", "")  # set by the device runs: wins
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
            if not commit
            else commit
        )
    except OSError:
        pass
    if not commit:
        commit = "unknown"
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit or "unknown",
    }


def save_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=False))
    print(f"saved {path}")


class JitWatch:
    """Records every Triton compile (in-process specialisations, disk-cache loads
    included) while active: (kernel name, seconds from the pre-compile hook to the
    post-compile hook, ``tag``'s value at the time). A compile inside a timed run
    is a stall the warm-up did not cover."""

    def __init__(self) -> None:
        import time

        self.clock, self.tag, self.compiles, self._open = time.perf_counter, None, [], {}

    def _before(self, *, key, repr, fn, **_):
        self._open[str(key)] = self.clock()

    def _after(self, *, key, repr, fn, **_):
        start = self._open.pop(str(key), self.clock())
        self.compiles.append((fn.name, self.clock() - start, self.tag))

    def __enter__(self):
        knobs = triton.knobs.runtime
        self._saved = knobs.jit_cache_hook, knobs.jit_post_compile_hook
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc) -> None:
        triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook = (
            self._saved
        )

    def summary(self) -> list[dict]:
        return [{"kernel": k, "seconds": round(s, 4), "at": t} for k, s, t in self.compiles]


class GcWatch:
    """Records every garbage-collector pass while active: (generation, seconds,
    ``tag``'s value at its start), through ``gc.callbacks``."""

    def __init__(self) -> None:
        import time

        self.clock, self.tag, self.passes, self._start = time.perf_counter, None, [], None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = (self.clock(), self.tag)
        elif self._start is not None:
            t, tag = self._start
            self.passes.append((info["generation"], self.clock() - t, tag))

    def __enter__(self):
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """Per generation: passes and total ms; the longest pass (ms, tag)."""
        out = {}
        for gen, secs, tag in self.passes:
            row = out.setdefault(f"gen{gen}", {"passes": 0, "ms": 0.0, "max_ms": 0.0})
            row["passes"] += 1
            row["ms"] = round(row["ms"] + secs * 1e3, 3)
            if secs * 1e3 > row["max_ms"]:
                row["max_ms"], row["max_at"] = round(secs * 1e3, 3), tag
        return out


ALLOC_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_counts() -> dict:
    """The CUDA caching allocators' counters that mean driver calls or syncs: the
    device allocator's, and the pinned host blocks created (``num_host_alloc``)."""
    stats = torch.cuda.memory_stats()
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {k: stats.get(k, 0) for k in ALLOC_KEYS} | {
        "num_host_alloc": host.get("num_host_alloc", host.get("allocations.allocated", -1))
    }
