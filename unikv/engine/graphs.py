"""CUDA graphs for decode steps.

One graph per padded batch size, all reading fixed-size buffers owned here:

    input_ids, positions (Bmax,) int64      seq_lens, slots (Bmax,) int32
    per sub-pool: write_ids (Bmax,)  block_table (Bmax, ceil(max_context / ps)) int32
    hybrid models: state_slots (Bmax,) int64 physical recurrent-state slots

Before a replay, translation runs OUTSIDE the graph into prefixes of these
buffers: the scheduler's ``alloc.decode_step`` writes the block tables and
write ids straight into them (``step_buffers``), else ``alloc.translate(...,
out=)`` and ``block_table(out=)`` do; the padded lanes are reset to the sink
(kernel id 0, block-table entry 0, seq_len 1, token 0, position 0, state slot
0), so a padded lane reads and writes only sink bytes.
"""

from __future__ import annotations

import torch

from unikv.engine.plan import StepPlan, SubPoolStep
from unikv.ids import KernelIds


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch`` (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captures ``runner.forward`` of decode steps and replays it.

    Args:
        runner: the ModelRunner (model, pool, allocator, backend).
        max_batch: the largest decode batch run under a graph.
    """

    def __init__(self, runner, max_batch: int) -> None:
        self.runner = runner
        self.sizes = graph_batch_sizes(max_batch)
        dev, n = runner.device, self.sizes[-1]
        max_context = runner.alloc.req_to_token.shape[1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.slots = torch.zeros(n, dtype=torch.int32, device=dev)
        self.q_indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.write_ids, self.tables = {}, {}
        for sub in runner.subpools:
            self.write_ids[sub.name] = torch.zeros(n, dtype=torch.int64, device=dev)
            pages = -(-max_context // sub.page_size)
            self.tables[sub.name] = torch.zeros((n, pages), dtype=torch.int32, device=dev)
        self.state_slots = (
            torch.zeros(n, dtype=torch.int64, device=dev) if runner.has_state else None
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    def _static_plan(self, bs: int) -> StepPlan:
        subpools = {
            name: SubPoolStep(KernelIds(self.write_ids[name][:bs], name), self.tables[name][:bs])
            for name in self.write_ids
        }
        return StepPlan(
            is_decode=True,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            logits_indices=self.logits_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            q_indptr=self.q_indptr[: bs + 1],
            max_q_len=1,
            subpools=subpools,
            state_slots=self.state_slots[:bs] if self.state_slots is not None else None,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):
            plan = self._static_plan(bs)
            side = torch.cuda.Stream(self.runner.device)
            side.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(side):  # warm up: compile kernels, settle allocations
                self.runner.forward(plan)
            torch.cuda.current_stream(self.runner.device).wait_stream(side)
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.runner.forward(plan)
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize(self.runner.device)

    def step_buffers(self) -> tuple[dict, dict, int]:
        """(block tables, write ids, max rows) of the token sub-pools, for
        ``Scheduler.step_buffers``."""
        names = self.runner.alloc.token_names
        tables = {n: self.tables[n] for n in names}
        return tables, {n: self.write_ids[n] for n in names}, self.sizes[-1]

    def fits(self, batch) -> bool:
        return len(batch.requests) <= self.sizes[-1]

    def run(self, batch, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Fill the buffers for ``batch`` (translating outside the graph), replay,
        return fp32 logits (B, vocab) (a view of the graph's output).
        ``prev_tokens``: the previous step's sampled tokens, for placeholders."""
        b = len(batch.requests)
        bs = next(s for s in self.sizes if s >= b)
        runner = self.runner
        dev = runner.device_arrays(batch, prev_tokens)
        for buf, name, pad in (
            (self.input_ids, "input_ids", 0),
            (self.positions, "positions", 0),
            (self.seq_lens, "seq_lens", 1),
            (self.slots, "slots", 0),
        ):
            buf[:b].copy_(dev[name])
            buf[b:bs].fill_(pad)
        done = batch.step_tables
        if done is not None and not (
            all(
                t.data.data_ptr() == self.tables[n].data_ptr() for n, t in done.block_tables.items()
            )
            and all(
                w.data.data_ptr() == self.write_ids[n].data_ptr() for n, w in done.write_ids.items()
            )
        ):
            done = None  # decode_step wrote elsewhere: translate into our buffers (LESSONS 3)
        virtual_ids = None if done is not None else batch.virtual_ids
        for sub in runner.subpools:
            write, table = self.write_ids[sub.name], self.tables[sub.name]
            if done is None:
                runner.alloc.translate(virtual_ids, sub.name, out=write[:b])
                runner.alloc.block_table(
                    self.slots[:b],
                    self.seq_lens[:b],
                    sub.name,
                    table[:b],
                    window=sub.spec.sliding_window or 0,
                )
            if b < bs:
                write[b:bs].zero_()
                table[b:bs].zero_()
        if self.state_slots is not None:  # translated outside the graph; padded lanes: sink
            self.state_slots[:b].copy_(runner.state_slots(self.slots[:b]))
            self.state_slots[b:bs].zero_()
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits[:b]
