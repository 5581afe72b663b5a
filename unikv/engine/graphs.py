"""CUDA graphs for decode steps: capture and replay over the step planner's buffers.

One graph per padded batch size R, captured over ``planner.plan(Batch(), rows=R)``
(every lane the sink). The planner lays a plan of R rows at the same addresses
every step (``StepPlanner.plan``), so a replay after ``planner.plan(batch,
rows=R)`` reads that batch: translation, padding and placeholder tokens all
happen in the planner, outside the graph.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

import torch

from unikv.engine.plan import StepPlan, StepPlanner
from unikv.engine.scheduler import Batch


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch`` (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured ``forward`` of decode steps, one graph per padded batch size.

    Args:
        forward: the runner's forward, StepPlan -> fp32 logits (R, vocab).
        planner: the StepPlanner whose buffers the graphs read.
        max_batch: the largest decode batch run under a graph (<= planner.max_seqs).
    """

    def __init__(
        self, forward: Callable[[StepPlan], torch.Tensor], planner: StepPlanner, max_batch: int
    ) -> None:
        self.sizes = graph_batch_sizes(max_batch)
        self.device = planner.device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture(forward, planner)

    @torch.inference_mode()
    def _capture(self, forward: Callable[[StepPlan], torch.Tensor], planner: StepPlanner) -> None:
        pool, stream = None, torch.cuda.current_stream(self.device)
        for rows in reversed(self.sizes):
            plan = planner.plan(Batch(), rows=rows)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(stream)
            with torch.cuda.stream(side):  # warm up: compile kernels, settle allocations
                forward(plan)
            stream.wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward(plan)
            pool = graph.pool()
            self.graphs[rows] = (graph, logits)
        torch.cuda.synchronize(self.device)

    def rows_for(self, batch: Batch) -> int | None:
        """The padded size whose graph runs ``batch``, None to run it eagerly (not
        a decode batch, or larger than every graph)."""
        if not batch.is_decode or len(batch.requests) > self.sizes[-1]:
            return None
        return self.sizes[bisect_left(self.sizes, len(batch.requests))]

    def replay(self, rows: int) -> torch.Tensor:
        """Replay the graph of ``rows`` over the planner's current plan of that many
        rows; fp32 logits (rows, vocab), a view of the graph's output."""
        graph, logits = self.graphs[rows]
        graph.replay()
        return logits
