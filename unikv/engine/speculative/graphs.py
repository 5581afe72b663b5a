"""CUDA graphs of verify steps: every lane feeds exactly ``q = k + 1`` rows.

One graph per padded batch size R, captured over ``planner.plan(Batch(), rows=R,
pad_q=q)`` (every lane the sink, ``q`` tokens each): R * q token rows at fixed
addresses, an extend plan with full-width tables, the logits of every row. A
verify batch whose requests all feed ``q`` rows (the speculator pads drafts to k
when graphs exist) replays the graph of its padded size; any other runs eagerly.
``capture=False`` runs the same padded plans eagerly (the CPU tests' stand-in).

Greedy acceptance is captured with the forward (``accept_in_graph``): a lane's
drafts are its rows 1 .. k of the plan's ``input_ids`` (placeholders filled there
before the replay), every real lane has k of them, so the accepted prefix, the
bonus token and the one small tensor the host reads (``packed``: the emitted
tokens then the accepted count) are device ops of the replay. A greedy verify step
under a graph builds no host array for its acceptance and uploads nothing for it;
rejection sampling (temperature > 0) reads the same graph's logits and accepts
eagerly (``step.verify_step``), exact as before.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import NamedTuple

import torch

from unikv.engine.graphs import graph_batch_sizes
from unikv.engine.request import Batch
from unikv.engine.speculative.verify import greedy_accept


class Accepted(NamedTuple):
    """A greedy verify step's outputs on the device, (R,) lanes first: ``packed`` (R,
    q + 1) int64 (emitted tokens, -1 past them, then the accepted count: the host's
    one read), ``last`` (R,) each lane's next pending token, ``tokens`` (R, q) and
    ``accepted`` (R,)."""

    packed: torch.Tensor
    last: torch.Tensor
    tokens: torch.Tensor
    accepted: torch.Tensor

    def lanes(self, num: int) -> Accepted:
        """The first ``num`` lanes (the real requests of a padded step)."""
        return Accepted(*(t[:num] for t in self))


def accept_in_graph(logits: torch.Tensor, input_ids: torch.Tensor, rows: int, q: int, force: bool):
    """Greedy acceptance of a verify step whose ``rows`` lanes feed ``q`` rows each:
    logits (rows * q, V) of every row, input_ids (>= rows * q,) the fed tokens (a
    lane's pending token, then its k = q - 1 drafts). Device ops only (captured in
    the verify graph); ``force``: every draft accepted (benchmarks)."""
    fed = input_ids[: rows * q].view(rows, q)
    drafts = fed[:, 1:]
    num = torch.full((rows,), q - 1, dtype=torch.int64, device=logits.device)
    tokens, accepted = greedy_accept(logits[: rows * q].view(rows, q, -1), drafts, num, force)
    last = tokens.gather(1, accepted[:, None])[:, 0]
    return Accepted(torch.cat([tokens, accepted[:, None]], dim=1), last, tokens, accepted)


class VerifyGraphs:
    """Captured verify forwards, one per padded batch size up to ``max_rows``.

    Args:
        forward: StepPlan -> logits of every token row (R * q, vocab).
        planner: the StepPlanner whose buffers the graphs read.
        max_rows: the largest verify batch run under a graph.
        q: rows per request (k + 1).
        capture: False runs the padded plans eagerly instead (no CUDA).
        force: the benchmark mode ``force_accept`` (every draft accepted), decided
            at capture.
    """

    def __init__(
        self, forward, planner, max_rows: int, q: int, capture: bool = True, force: bool = False
    ) -> None:
        self.forward, self.planner, self.q, self.force = forward, planner, q, force
        self.sizes = graph_batch_sizes(max_rows)
        self.graphs: dict[int, tuple] = {}
        if capture:
            self.graphs = capture_padded(planner, self.sizes, q, self._step)

    def _step(self, plan, rows: int) -> tuple[torch.Tensor, Accepted]:
        """What a graph captures: every row's logits, then greedy acceptance."""
        logits = self.forward(plan)
        return logits, accept_in_graph(logits, plan.input_ids, rows, self.q, self.force)

    def rows_for(self, batch: Batch) -> int | None:
        """The padded size whose graph runs ``batch``, or None (eager)."""
        num = len(batch.requests)
        if num > self.sizes[-1] or batch.num_new.count(self.q) != num:
            return None
        return self.sizes[bisect_left(self.sizes, num)]

    def run(self, plan, rows: int) -> tuple[torch.Tensor, Accepted]:
        """(logits of every token row of ``plan`` (planned with ``rows`` and
        ``pad_q``), its greedy acceptance over all ``rows`` lanes): the graph's replay
        (its own buffers, rewritten by the next replay of this size), or the same ops
        eagerly."""
        if not self.graphs:
            return self._step(plan, rows)
        graph, out = self.graphs[rows]
        graph.replay()
        return out


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
