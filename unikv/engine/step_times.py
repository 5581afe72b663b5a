"""Host time per engine step, by phase: where a slow step (an ITL tail) went.

``EngineLoop.times`` (None: untimed) gets one figure per phase per step:

    plan     the inbox taken, the step scheduled (host)
    launch   the step enqueued on the device (``ModelRunner.launch``: on CUDA the
             host's planning and launches; on CPU the whole forward)
    wait     the previous step's tokens awaited (its device time the host did not
             cover)
    output   the previous step's tokens applied and its outputs published
    step     the whole step
    io       ``unikv serve``'s engine process: its sockets read and the requests
             admitted between two steps
    gc       a pause of Python's garbage collector (``watch_gc``)

Each phase is a histogram over ``EDGES_S`` (Prometheus ``le`` bounds, seconds)
with its count, sum and maximum: a few integer adds per step, no lock (one
thread writes; a reader copies, ``snapshot``).
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left

EDGES_S = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.006,
           0.008, 0.012, 0.016, 0.025, 0.05, 0.1, 0.25, 1.0)  # fmt: skip
PHASES = ("plan", "launch", "wait", "output", "step", "io", "gc")


class StepTimes:
    """Per-phase histograms of host seconds (one writer thread)."""

    def __init__(self) -> None:
        self.counts = {p: [0] * (len(EDGES_S) + 1) for p in PHASES}  # last: above every edge
        self.sums = dict.fromkeys(PHASES, 0.0)
        self.maxes = dict.fromkeys(PHASES, 0.0)
        self._gc_start = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.counts[phase][bisect_left(EDGES_S, seconds)] += 1  # le: seconds <= edge
        self.sums[phase] += seconds
        self.maxes[phase] = max(self.maxes[phase], seconds)

    def snapshot(self) -> dict:
        """{"edges_s": [...], "phases": {phase: {"counts", "sum_s", "max_s", "n"}}}:
        plain data (msgpack, JSON); counts per bucket, the last above every edge."""
        phases = {}
        for p in PHASES:
            counts = list(self.counts[p])
            phases[p] = {"counts": counts, "sum_s": self.sums[p], "max_s": self.maxes[p],
                         "n": sum(counts)}  # fmt: skip
        return {"edges_s": list(EDGES_S), "phases": phases}

    # -- the garbage collector's pauses ---------------------------------------------------

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.add("gc", time.perf_counter() - self._gc_start)

    def watch_gc(self) -> None:
        """Record every collection's pause as phase "gc" (``unwatch_gc`` ends it)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def quantile(snapshot_phase: dict, edges: list[float], q: float) -> float | None:
    """The upper edge of the bucket holding quantile ``q`` (0..1) of one phase's
    histogram (its max when above the last edge); None when it is empty."""
    counts, n = snapshot_phase["counts"], snapshot_phase["n"]
    if not n:
        return None
    rank, seen = q * n, 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= rank and c:
            return edges[i] if i < len(edges) else snapshot_phase["max_s"]
    return snapshot_phase["max_s"]
