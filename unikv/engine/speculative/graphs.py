"""CUDA graphs of verify steps: every lane feeds exactly ``q = k + 1`` rows.

One graph per padded batch size R, captured over ``planner.plan(Batch(), rows=R,
pad_q=q)`` (every lane the sink, ``q`` tokens each): R * q token rows at fixed
addresses, an extend plan with full-width tables, the logits of every row. A
verify batch whose requests all feed ``q`` rows (the speculator pads drafts to k
when graphs exist) replays the graph of its padded size; any other runs eagerly.
``capture=False`` runs the same padded plans eagerly (the CPU tests' stand-in).
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from unikv.engine.graphs import graph_batch_sizes
from unikv.engine.request import Batch


class VerifyGraphs:
    """Captured verify forwards, one per padded batch size up to ``max_rows``.

    Args:
        forward: StepPlan -> logits of every token row (R * q, vocab).
        planner: the StepPlanner whose buffers the graphs read.
        max_rows: the largest verify batch run under a graph.
        q: rows per request (k + 1).
        capture: False runs the padded plans eagerly instead (no CUDA).
    """

    def __init__(self, forward, planner, max_rows: int, q: int, capture: bool = True) -> None:
        self.forward, self.planner, self.q = forward, planner, q
        self.sizes = graph_batch_sizes(max_rows)
        self.graphs: dict[int, tuple] = {}
        if capture:
            self.graphs = capture_padded(planner, self.sizes, q, lambda plan, _: forward(plan))

    def rows_for(self, batch: Batch) -> int | None:
        """The padded size whose graph runs ``batch``, or None (eager)."""
        num = len(batch.requests)
        if num > self.sizes[-1] or batch.num_new.count(self.q) != num:
            return None
        return self.sizes[bisect_left(self.sizes, num)]

    def run(self, plan, rows: int) -> torch.Tensor:
        """Logits of every token row of ``plan`` (planned with ``rows`` and ``pad_q``):
        the graph's replay (its own buffer), or the eager forward."""
        if not self.graphs:
            return self.forward(plan)
        graph, logits = self.graphs[rows]
        graph.replay()
        return logits


@torch.inference_mode()
def capture_padded(planner, sizes: list[int], q: int, run) -> dict[int, tuple]:
    """One CUDA graph per padded size R, largest first, sharing one memory pool:
    ``run(plan, R)`` over ``planner.plan(Batch(), rows=R, pad_q=q)``, first on a side
    stream (kernels compiled, allocations settled), then captured. R -> (graph, what
    the captured ``run`` returned: the buffers its replays refill)."""
    device = planner.device
    graphs: dict[int, tuple] = {}
    pool, stream = None, torch.cuda.current_stream(device)
    for rows in sorted(sizes, reverse=True):
        plan = planner.plan(Batch(), rows=rows, pad_q=q)
        side = torch.cuda.Stream(device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            run(plan, rows)
        stream.wait_stream(side)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run(plan, rows)
        pool = graph.pool()
        graphs[rows] = (graph, out)
    torch.cuda.synchronize(device)
    return graphs
