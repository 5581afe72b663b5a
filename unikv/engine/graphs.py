"""CUDA graphs for decode steps: capture and replay over the step planner's buffers.

One graph per padded batch size R, captured over ``planner.plan(Batch(), rows=R)``
(every lane the sink). The planner lays a plan of R rows at the same addresses
every step (``StepPlanner.plan``), so a replay after ``planner.plan(batch,
rows=R)`` reads that batch: translation, padding and placeholder tokens all
happen in the planner, outside the graph.

Sizes of at most ``GREEDY_ROWS`` rows get a second graph with the greedy argmax
captured with the forward (``forward_greedy``), for all-greedy batches: inside the
LM head's GEMV where the model and backend fuse it (one request: the GEMV's
programs pack their best logits into one key per row, and one launch unpacks it),
else a launch after the head that overlaps its tail (PDL), instead of waiting for
a launch after the graph (one request's step: two launches of 6 us). Its tokens
live in the graph's own buffer, rewritten by its next replay.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

import torch

from unikv.engine.plan import StepPlan, StepPlanner
from unikv.engine.scheduler import Batch
from unikv.env import FLAGS

# decode graphs of at most this many rows also come with the argmax inside
# (UNIKV_GRAPH_GREEDY_ROWS, fixed at import: 0 turns it off, the A/B switch)
GREEDY_ROWS = FLAGS.graph_greedy_rows


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
        forward_greedy: StepPlan -> (logits (R, vocab), (R,) int64 greedy tokens),
            captured at sizes of at most ``GREEDY_ROWS`` rows (None: none).
    """

    def __init__(
        self,
        forward: Callable[[StepPlan], torch.Tensor],
        planner: StepPlanner,
        max_batch: int,
        forward_greedy: Callable[[StepPlan], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.sizes = graph_batch_sizes(max_batch)
        self.greedy_sizes = [r for r in self.sizes if r <= GREEDY_ROWS] if forward_greedy else []
        self.device = planner.device
        # (rows, greedy) -> (graph, logits, tokens or None)
        self.graphs: dict[tuple[int, bool], tuple] = {}
        self._capture(forward, planner, forward_greedy)

    @torch.inference_mode()
    def _capture(self, forward, planner: StepPlanner, forward_greedy) -> None:
        pool, stream = None, torch.cuda.current_stream(self.device)
        cases = [(r, False) for r in self.sizes] + [(r, True) for r in self.greedy_sizes]
        for rows, greedy in sorted(cases, reverse=True):

            def run(plan, greedy=greedy):
                return forward_greedy(plan) if greedy else (forward(plan), None)

            plan = planner.plan(Batch(), rows=rows)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(stream)
            with torch.cuda.stream(side):  # warm up: compile kernels, settle allocations
                run(plan)
            stream.wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits, tokens = run(plan)
            pool = graph.pool()
            self.graphs[rows, greedy] = (graph, logits, tokens)
        torch.cuda.synchronize(self.device)

    def rows_for(self, batch: Batch) -> int | None:
        """The padded size whose graph runs ``batch``, None to run it eagerly (not
        a decode batch, or larger than every graph)."""
        if not batch.is_decode or len(batch.requests) > self.sizes[-1]:
            return None
        return self.sizes[bisect_left(self.sizes, len(batch.requests))]

    def has_greedy(self, rows: int) -> bool:
        """Whether the size ``rows`` has a graph with the greedy argmax inside."""
        return rows in self.greedy_sizes

    def replay(self, rows: int, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the graph of ``rows`` over the planner's current plan of that many
        rows: (logits (rows, vocab), the graph's output; its greedy tokens (rows,)
        int64 where ``greedy`` (the size has a greedy graph: ``has_greedy``), else None)."""
        graph, logits, tokens = self.graphs[rows, greedy]
        graph.replay()
        return logits, tokens
