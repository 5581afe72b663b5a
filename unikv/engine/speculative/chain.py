"""A draft head's chain as one unit: ``HiddenDraft.propose`` in one plan and (on CUDA)
one graph per lane count.

At k drafts, request b's first draft is kept on the device (``HiddenDraft.first``,
its hidden state ``hidden``); drafts 2 .. k come from k - 1 chained one-token
steps of the layer, step s over position ``L_b + s`` (L_b its cached tokens), the
K/V written into the verify step's row s of the request (rows the verify step
allocated first). Every lane drafts k here (a request with fewer, or a windowed
draft sub-pool, takes ``HiddenDraft.propose_steps``: one plan a step).

One plan a chain: the chain's rows (positions ``L_b .. L_b + k - 2``) planned as one
step of k - 1 rows per lane (``StepPlanner.plan``, ``pad_q = k - 1`` under a
graph): its positions, write ids (lane-major) and block tables (spanning the last
row) hold every step's. Step s is a decode step over lane-column s of them, its
``seq_lens`` the plan's minus ``k - 2 - s`` (a padded lane: s + 1, the sink),
with decode attention's launch plan and the row plans made once per lane count
(``StepPlanner.decode_plans``, ``backend.plan_rows``). The steps derive their
inputs on the device: no upload, no host read between them; the drafts stay on
the device, (lanes, k), and the verify step reads them there.

Under CUDA graphs (``capture``): one graph per padded lane count R (the verify
graphs' sizes), captured over ``plan(Batch(), rows=R, pad_q=k - 1)``; a chain of
n <= R lanes plans with ``rows=R`` (every buffer at the captured addresses) and
replays it. ``capture=False`` runs the same function eagerly (CPU).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import replace

import numpy as np
import torch

from unikv.engine.graphs import graph_batch_sizes
from unikv.engine.plan import SubPoolStep
from unikv.engine.request import Batch
from unikv.engine.speculative.draft import to_device
from unikv.engine.speculative.graphs import capture_padded
from unikv.ids import KernelIds


class DraftChain:
    """The k - 1 chained steps of a ``HiddenDraft`` (module docstring).

    Args:
        draft: the ``HiddenDraft`` (its ``planner``, ``backend``, ``first``,
            ``hidden`` and ``step``); k: drafts per request (>= 2);
        max_rows: the largest chain under a graph (0: none); capture: capture the
            graphs (CUDA), else run eagerly.
    """

    def __init__(self, draft, k: int, max_rows: int = 0, capture: bool = False) -> None:
        assert k >= 2, "draft chain invariant: a chain has at least one step (k >= 2)"
        planner = draft.planner
        self.draft, self.k, self.planner = draft, k, planner
        self.q = k - 1  # chain rows per lane
        self.sizes = graph_batch_sizes(max_rows) if max_rows >= 1 else []
        self.arange = torch.arange(planner.max_seqs + 1, device=planner.device)
        self.q_indptr = self.arange.to(torch.int32)
        self.row_plans: dict[int, object] = {}
        self.graphs: dict[int, tuple] = {}
        if capture and self.sizes:
            chain = lambda plan, rows: self._chain(plan, rows, None)
            self.graphs = capture_padded(planner, self.sizes, self.q, chain)

    def fits(self, lanes: int) -> bool:
        """Whether a chain of ``lanes`` lanes fits one plan (the planner's buffers)."""
        planner = self.planner
        return lanes <= planner.max_seqs and lanes * self.q <= planner.max_tokens

    def run(self, requests: list, virtual_ids: torch.Tensor, starts: np.ndarray) -> torch.Tensor:
        """(n, k) int64 drafts on the device of ``requests`` (n lanes, k each):
        ``virtual_ids``: the verify step's; ``starts``: each request's first row there."""
        num = len(requests)
        rows = self._rows(num)
        lanes = [_Lane(r.slot, r.num_cached) for r in requests]
        if virtual_ids.shape[0] == num * (self.k + 1):  # every request drafts: a view
            vids = virtual_ids.reshape(num, self.k + 1)[:, : self.q].reshape(-1)
        else:  # some request drafts nothing this step: its rows are skipped
            index = (starts[:, None] + np.arange(self.q)).reshape(-1)
            vids = virtual_ids.index_select(0, to_device(index, virtual_ids.device))
        batch = Batch(lanes, [self.q] * num, [vids])
        if rows is None:  # eager: n lanes, tables as wide as the longest
            plan = self.planner.plan(batch)
            longest = max(r.num_cached for r in requests) + self.q
            return self._chain(plan, num, longest)
        plan = self.planner.plan(batch, rows=rows, pad_q=self.q)
        graph, out = self.graphs.get(rows, (None, None))
        if graph is None:  # capture=False: the padded plan, eagerly
            return self._chain(plan, rows, None)[:num]
        graph.replay()
        return out[:num]

    def _rows(self, num: int) -> int | None:
        """The padded lane count whose graph runs ``num`` lanes, or None (eager)."""
        if not self.sizes or num > self.sizes[-1]:
            return None
        return self.sizes[bisect_left(self.sizes, num)]

    def _chain(self, plan, rows: int, longest: int | None) -> torch.Tensor:
        """The k - 1 steps over ``plan`` (``rows`` lanes, k - 1 rows each) -> (rows, k)
        drafts: device ops only (a graph's body)."""
        draft, q = self.draft, self.q
        launch = self.planner.decode_plans(rows, longest)
        rows_plan = self.row_plans.get(rows)
        if rows_plan is None:
            rows_plan = self.row_plans[rows] = draft.backend.plan_rows(rows)
        slots = plan.slots[:rows].long()
        ids = draft.first.index_select(0, slots)
        hidden = draft.hidden.index_select(0, slots)
        positions = plan.positions.view(rows, q)
        writes = {n: s.write_ids.data.view(rows, q) for n, s in plan.subpools.items()}
        out = [ids]
        for s in range(q):
            step = replace(
                plan,
                is_decode=True,
                positions=positions[:, s].contiguous(),
                seq_lens=plan.seq_lens[:rows] - (q - 1 - s),
                q_indptr=self.q_indptr[: rows + 1],
                logits_indices=self.arange[:rows],
                max_q_len=1,
                subpools={
                    n: SubPoolStep(KernelIds(writes[n][:, s].contiguous(), n), sub.block_table)
                    for n, sub in plan.subpools.items()
                },
                decode=launch,
                state_slots=None,
                draft_slots=None,
                fresh=False,
                split=None,
                extend=None,
                feedback=None,
                rows=rows_plan,
                logit_rows=rows_plan,
            )
            hidden, ids = draft.step(step, ids, hidden)
            out.append(ids)
        return torch.stack(out, dim=1)


class _Lane:
    """A chain lane as the step upload reads a request: ``slot``, ``num_cached`` (its
    first chain row's position) and zero tokens (the chain feeds its own)."""

    prompt_ids = ()

    def __init__(self, slot: int, start: int) -> None:
        self.slot, self.num_cached = slot, start
        self.output_ids = _Zeros()

    @staticmethod
    def token_slice(start: int, stop: int) -> list[int]:
        return [0] * (stop - start)


class _Zeros:
    """``output_ids`` of a lane: token 0 at any position (a one-row chain, k = 2)."""

    def __getitem__(self, index: int) -> int:
        return 0


class VerifyRowGraphs:
    """``HiddenDraft.forward_verify`` after a verify graph, one graph per its padded
    size R (every lane q rows): the step's emitted tokens (B, q) and accepted counts
    (B,) are copied into fixed buffers (padded lanes: 0) and the graph, captured over
    ``plan(Batch(), rows=R, pad_q=q)``, writes the layer's rows of every lane and
    keeps each real lane's first draft (a padded lane's goes to the scratch row,
    ``HiddenDraft.scratch``, told apart on the device by its seq_len).
    ``capture=False`` runs the same padded function eagerly (CPU)."""

    def __init__(self, draft, sizes: list[int], q: int, capture: bool) -> None:
        planner = draft.planner
        self.draft, self.planner, self.q, self.sizes = draft, planner, q, sizes
        rows = max(sizes)
        self.tokens = torch.zeros(rows, q, dtype=torch.int64, device=planner.device)
        self.accepted = torch.zeros(rows, dtype=torch.int64, device=planner.device)
        self.graphs: dict[int, tuple] = {}
        if capture:
            self.graphs = capture_padded(planner, sizes, q, self._rows)

    def run(self, plan, rows: int, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """The rows of verify step ``plan`` (its graph's ``rows``): tokens (B, q),
        accepted (B,) on the device."""
        num = tokens.shape[0]
        assert tokens.shape[1] == self.q, (
            "verify rows invariant: a graphed verify step's lanes feed q rows"
        )
        self.tokens[:num].copy_(tokens)
        self.tokens[num:rows].zero_()
        self.accepted[:num].copy_(accepted)
        self.accepted[num:rows].zero_()
        graph, _ = self.graphs.get(rows, (None, None))
        if graph is None:
            self._rows(plan, rows)
        else:
            graph.replay()

    def _rows(self, plan, rows: int) -> None:
        self.draft.write_verify_rows(
            plan, rows, self.tokens[:rows], self.accepted[:rows], padded=self.q
        )
