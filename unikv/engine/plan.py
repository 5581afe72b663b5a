"""Plan, then run: the step planner owns the step buffers and builds every StepPlan.

A step's batch is translated exactly once per sub-pool (docs/design.md section 5),
into fixed buffers the planner owns (sized at start-up to ``max_seqs`` requests
and ``max_tokens`` tokens, on every device):

    DECODE batch:  alloc.decode_step wrote tables/write ids  (the scheduler hands
                   it ``StepPlanner.tables``; nothing left to translate)
    EXTEND batch:  virtual ids --alloc.translate--> write kernel ids    (per sub-pool)
                   req_to_token + v2p --alloc.block_table--> block table (per sub-pool)
    hybrid models: request slots --alloc.mamba_slots--> physical state slots

    host arrays --one copy--> one device byte buffer, typed views for (R rows, T tokens):
        input_ids (T,) i64 | positions (T,) i64 | logits_indices (R,) i64 |
        lanes (R,) i64 | seq_lens (R,) i32 | slots (R,) i32 | q_indptr (R+1,) i32

``lanes``: in a one-token step whose every input is a placeholder (steady
decoding), lane i's placeholder's lane, so input_ids[:B] = prev_tokens[lanes] is
one gather (else ``Pending.fill``, or nothing when the host sees no placeholder).

``plan(batch, rows=R)`` pads the batch to R rows (CUDA graphs): a padded lane
feeds token 0 at position 0 with seq_len 1, block-table row 0, write id 0 and
state slot 0, so it reads and writes only sink bytes. For a given R the views
lie at the same addresses every step, so a graph captured over ``plan(Batch(),
rows=R)`` replays over any later plan of R rows. Decode attention's launch plan
(``backend.plan_decode``: splits, config, workspace) is made here once per step
and sub-pool; every layer only reads the StepPlan.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np
import torch

from unikv.engine.request import Pending
from unikv.engine.scheduler import Batch, BatchKind
from unikv.ids import KernelIds
from unikv.kernels.backend import DecodePlan, KernelBackend

if TYPE_CHECKING:
    from unikv.allocator import PoolAllocator

I64, I32 = 8, 4  # bytes per element of the two sections of the packed buffer
_NUM_CACHED, _SLOT = attrgetter("num_cached"), attrgetter("slot")
_ALL, _SOME, _NONE = "all", "some", "none"  # which input tokens are placeholders


def _token_at(r, index: int) -> int:
    """all_ids[index] of request ``r`` without building all_ids."""
    n = len(r.prompt_ids)
    return r.prompt_ids[index] if index < n else r.output_ids[index - n]


@dataclass(frozen=True)
class StepTables:
    """The planner's table buffers, per token sub-pool: ``block_tables[n]``
    (max_seqs, ceil(max_context / page_size)) int32 kernel page entries and
    ``write_ids[n]`` (max_tokens,) int64 kernel ids; ``alloc.decode_step`` and
    the planner write them in place (fixed addresses: CUDA-graph inputs)."""

    block_tables: dict[str, torch.Tensor]
    write_ids: dict[str, torch.Tensor]


@dataclass
class SubPoolStep:
    """One sub-pool's translated ids for one step.

    write_ids: kernel ids (T,) of the step's new tokens (where store_kv writes).
    block_table: (B, max_pages) int32 kernel page entries (0 = the sink)."""

    write_ids: KernelIds
    block_table: torch.Tensor


@dataclass
class StepPlan:
    """Everything a forward step reads, on the device (views of planner buffers).

    input_ids: (T,) int64 tokens of the step, requests in batch order.
    positions: (T,) int64 position of each token in its request.
    logits_indices: (B,) int64 row of each request's last token in the step.
    seq_lens: (B,) int32 tokens in the cache after the step (new ones included).
    q_indptr: (B+1,) int32 cumulative new-token counts.
    max_q_len: host int, the largest new-token count (a grid size, no sync).
    subpools: per token sub-pool write ids and block table.
    decode: per attention sub-pool its DecodePlan (decode steps), else None.
    state_slots: (B,) int64 physical state slot of each request (hybrid models;
        0 = the sink for padded lanes), else None.
    fresh: host bool, an extend step in which no request has cached tokens (every
        seq_len is its q_len): extend attention may read the step's own K/V rows.
    """

    is_decode: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    seq_lens: torch.Tensor
    q_indptr: torch.Tensor
    max_q_len: int
    subpools: dict[str, SubPoolStep]
    decode: dict[str, DecodePlan] | None = None
    state_slots: torch.Tensor | None = None
    fresh: bool = False


class StepPlanner:
    """Builds every StepPlan over buffers it owns.

    Args:
        alloc: the PoolAllocator (decode_step fills ``tables``; translate,
            block_table and mamba_slots fill them otherwise).
        backend: the KernelBackend (its ``plan_decode``).
        max_seqs: requests per step at most; max_tokens: tokens per step at most.
        q_per_kv: query heads per KV head (sizes decode attention's workspace).
        pin: stage host arrays in pinned memory (CUDA), decided once.
    """

    def __init__(
        self,
        alloc: PoolAllocator,
        backend: KernelBackend,
        *,
        max_seqs: int,
        max_tokens: int,
        q_per_kv: int,
        pin: bool = False,
    ) -> None:
        pool = alloc.pool
        self.alloc, self.backend, self.device = alloc, backend, pool.device
        self.max_seqs, self.max_tokens = max_seqs, max(max_tokens, max_seqs)
        self.max_context = alloc.parts.requests.req_to_token.shape[1]
        subs = [s for s in pool.subpools.values() if s.spec.kind != "mamba"]
        self.subpools, self.has_state = subs, len(subs) < len(pool.subpools)
        self.attention = [s for s in subs if s.spec.kind in ("full", "swa")]
        dev, rows = self.device, max_seqs
        self.tables = StepTables(
            {
                s.name: torch.zeros((rows, self._pages(s)), dtype=torch.int32, device=dev)
                for s in subs
            },
            {s.name: torch.zeros(self.max_tokens, dtype=torch.int64, device=dev) for s in subs},
        )
        self.state_slots = torch.zeros(rows, dtype=torch.int64, device=dev)
        nbytes = I64 * (2 * self.max_tokens + 2 * rows) + I32 * (3 * rows + 1)
        self._buffer = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        staging = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2)]
        self._staging = [t.pin_memory() for t in staging] if pin else staging
        self._host = [t.numpy() for t in self._staging]
        self._num_plans = 0
        self._layouts: dict[tuple[int, int, int], tuple[dict, dict, int]] = {}
        self._arange = np.arange(self.max_tokens + 1, dtype=np.int64)
        self._q_per_kv = q_per_kv
        self.workspace = torch.empty(self._workspace_numel(), dtype=torch.float32, device=dev)

    def _workspace_numel(self) -> int:
        """fp32 elements of decode attention's workspace for every step this planner
        can plan: the largest plan over batch sizes and attention sub-pools, at the
        whole context (splits never decrease with the visible length)."""
        plans = [
            self._decode_plan(sub, rows, None)
            for sub in self.attention
            for rows in range(1, self.max_seqs + 1)
        ]
        return max([p.workspace_numel for p in plans] + [1])

    def _pages(self, sub, longest: int | None = None) -> int:
        """Block-table columns spanning ``longest`` tokens (None: the whole context)."""
        return -(-(longest or self.max_context) // sub.page_size)

    def plan(
        self, batch: Batch, prev_tokens: torch.Tensor | None = None, *, rows: int | None = None
    ) -> StepPlan:
        """The StepPlan of ``batch``; placeholders (``Pending``) in its tokens are
        read from ``prev_tokens`` (B_prev,) int64, the previous step's samples on the
        device. rows: None (eager: B rows, tables as wide as the longest request),
        or R >= B (CUDA graphs: padded to R sink lanes, full-width tables)."""
        num = len(batch.requests)
        assert num <= (rows or num) <= self.max_seqs, (
            f"step planner invariant: {num} requests in a step of {rows} rows, buffers "
            f"hold {self.max_seqs}"
        )
        assert batch.kind is BatchKind.EXTEND or batch.tables is self.tables, (
            "step planner invariant: a DECODE batch's tables are this planner's buffers "
            "(build the Scheduler with tables=StepPlanner.tables)"
        )
        dev, host, pending = self._upload(batch, rows or num)
        longest = None  # tokens the tables must span (None: the whole context)
        if rows is None:
            rows = num
            longest = int(host["seq_lens"].max()) if num else 1
        if prev_tokens is not None and pending is _ALL:  # steady decoding: one gather
            torch.index_select(prev_tokens, 0, dev["lanes"][:num], out=dev["input_ids"][:num])
        elif prev_tokens is not None and pending is _SOME:
            Pending.fill(dev["input_ids"], prev_tokens)
        max_q_len = max(batch.num_new, default=1)
        is_decode = batch.is_decode
        return StepPlan(
            is_decode=is_decode,
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            logits_indices=dev["logits_indices"],
            seq_lens=dev["seq_lens"],
            q_indptr=dev["q_indptr"],
            max_q_len=max_q_len,
            subpools=self._tables(batch, dev, rows, longest, max_q_len),
            decode=self._decode_plans(rows, longest) if is_decode else None,
            state_slots=self._state_slots(dev["slots"], num) if self.has_state else None,
            fresh=not is_decode and not any(r.num_cached for r in batch.requests),
        )

    def _upload(self, batch: Batch, rows: int) -> tuple[dict, dict, object]:
        """The step's int arrays, padded to ``rows`` lanes, written into a host
        staging buffer and copied to the device in one copy; (typed device views,
        typed host views, which tokens are placeholders: _ALL, _SOME or _NONE).
        One-token steps (decodes) take a path without per-token arrays: positions
        are the starts, q_indptr an arange, and ``lanes`` the placeholders' lanes."""
        reqs, num_new = batch.requests, batch.num_new
        num = len(reqs)
        starts = list(map(_NUM_CACHED, reqs))
        one_token = len(num_new) == num_new.count(1)
        if one_token:
            # a one-token lane feeds its token at num_cached: a decode's last token, or
            # a prefill chunk of one (a chunk cut at a state checkpoint, a budget's last)
            tokens = [_token_at(r, s) for r, s in zip(reqs, starts)]
            num_tokens = rows
        else:
            tokens = [t for r, s, n in zip(reqs, starts, num_new) for t in r.token_slice(s, s + n)]
            num_tokens = len(tokens) + rows - num
        assert num_tokens <= self.max_tokens, (
            f"step planner invariant: {num_tokens} tokens in a step, buffers hold {self.max_tokens}"
        )
        slot = self._num_plans % 2  # the other slot may still be copying (step in flight)
        self._num_plans += 1
        host, dev, nbytes = self._layout(slot, rows, num_tokens)
        seq_lens, input_ids = host["seq_lens"], host["input_ids"]
        seq_lens[:num] = starts
        seq_lens[num:] = 0
        input_ids[:num_tokens] = 0
        input_ids[: len(tokens)] = tokens
        host["slots"][:num] = list(map(_SLOT, reqs))
        host["slots"][num:] = 0
        q_indptr, positions = host["q_indptr"], host["positions"]
        pending = _NONE if not tokens or input_ids[: len(tokens)].min() >= 0 else _SOME
        if one_token:
            positions[:] = seq_lens  # the starts, 0 on padded lanes
            q_indptr[:] = self._arange[: rows + 1]
            host["logits_indices"][:] = self._arange[:rows]
            if pending is _SOME and input_ids[:num].max() < 0:  # -(1 + lane) -> lane
                np.subtract(-1, input_ids[:num], out=host["lanes"][:num])
                pending = _ALL
        else:
            counts = np.ones(rows, np.int64)
            counts[:num] = num_new
            q_indptr[0] = 0
            np.cumsum(counts, out=q_indptr[1:])
            positions[:] = self._arange[:num_tokens] - np.repeat(q_indptr[:-1] - seq_lens, counts)
            host["logits_indices"][:] = q_indptr[1:] - 1
        seq_lens += 1 if one_token else counts  # padded lanes: 1, a token at position 0
        self._buffer[:nbytes].copy_(self._staging[slot][:nbytes], non_blocking=True)
        return dev, host, pending

    def _layout(self, slot: int, rows: int, num_tokens: int) -> tuple[dict, dict, int]:
        """(host views of staging slot ``slot``, device views, bytes) for ``rows``
        requests and ``num_tokens`` tokens, built once per shape (views are cheap
        to keep, slow to make on every step)."""
        key = (slot, rows, num_tokens)
        found = self._layouts.get(key)
        if found is None:
            host, nbytes = self._views(self._host[slot], rows, num_tokens)
            with torch.inference_mode(False):  # kept views: usable in and out of it
                dev = self._views(self._buffer, rows, num_tokens)[0]
            found = host, dev, nbytes
            if len(self._layouts) < 4 * self.max_seqs:  # decode shapes and some extends
                self._layouts[key] = found
        return found

    @staticmethod
    def _views(buffer, rows: int, num_tokens: int) -> tuple[dict, int]:
        """Typed views of a byte buffer (numpy or torch) for ``rows`` requests and
        ``num_tokens`` tokens (the layout in the module docstring), and its bytes."""
        fields, views, start = [], {}, 0
        fields += [("input_ids", I64, num_tokens), ("positions", I64, num_tokens)]
        fields += [("logits_indices", I64, rows), ("lanes", I64, rows)]
        fields += [("seq_lens", I32, rows), ("slots", I32, rows)]
        fields += [("q_indptr", I32, rows + 1)]
        for name, size, count in fields:
            raw = buffer[start : start + size * count]
            if isinstance(raw, np.ndarray):
                views[name] = raw.view(np.int64 if size == I64 else np.int32)
            else:
                views[name] = raw.view(torch.int64 if size == I64 else torch.int32)
            start += size * count
        return views, start

    def _tables(self, batch: Batch, dev: dict, rows: int, longest, max_q_len: int) -> dict:
        """Per token sub-pool, the write ids and block table of the step: decode_step
        wrote them (DECODE), else translated here; padded rows point at the sink."""
        num, steps = len(batch.requests), {}
        num_tokens = dev["input_ids"].shape[0]
        real = num_tokens - (rows - num)  # tokens of real requests (padded lanes: 1 each)
        virtual_ids = batch.virtual_ids if num and batch.kind is BatchKind.EXTEND else None
        for sub in self.subpools:
            table = self.tables.block_tables[sub.name][:rows, : self._pages(sub, longest)]
            write = self.tables.write_ids[sub.name][:num_tokens]
            if virtual_ids is not None:
                window = sub.spec.sliding_window or 0
                window += max_q_len - 1 if window else 0  # a first new token sees W back
                seq_lens, slots = dev["seq_lens"][:num], dev["slots"][:num]
                self.alloc.block_table(slots, seq_lens, sub.name, table[:num], window=window)
                self.alloc.translate(virtual_ids, sub.name, out=write)
            if num < rows:
                table[num:].zero_()
                write[real:].zero_()
            steps[sub.name] = SubPoolStep(KernelIds(write, sub.name), table)
        return steps

    def _decode_plans(self, rows: int, longest) -> dict[str, DecodePlan]:
        """Decode attention's launch plan per attention sub-pool, once per step."""
        return {s.name: self._decode_plan(s, rows, self.workspace, longest) for s in self.attention}

    def _decode_plan(self, sub, rows: int, workspace, longest=None) -> DecodePlan:
        spec = sub.spec
        max_len = self._pages(sub, longest) * sub.page_size  # the block table's capacity
        if spec.sliding_window:
            max_len = min(max_len, spec.sliding_window)
        return self.backend.plan_decode(
            rows,
            num_q_heads=spec.num_kv_heads * self._q_per_kv,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            v_head_dim=spec.v_head_dim,
            page_size=sub.page_size,
            max_len=max_len,
            device=self.device,
            workspace=workspace,
        )

    def _state_slots(self, slots: torch.Tensor, num: int) -> torch.Tensor:
        """(R,) int64 physical state slots of the rows (padded rows: 0, the sink),
        translated once per step, outside any graph."""
        state = self.state_slots[: slots.shape[0]]
        if num:
            state[:num].copy_(self.alloc.mamba_slots(slots[:num]).data)
        state[num:].zero_()
        return state
