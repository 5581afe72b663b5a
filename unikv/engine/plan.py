"""Plan, then run: the step planner owns the step buffers and builds every StepPlan.

A step's batch is translated exactly once per sub-pool (docs/design.md section 5),
into fixed buffers the planner owns (sized at start-up to ``max_seqs`` requests
and ``max_tokens`` tokens, on every device):

    DECODE batch:  alloc.decode_step wrote tables/write ids  (the scheduler hands
                   it ``StepPlanner.tables``; nothing left to translate)
    EXTEND batch:  virtual ids --alloc.translate--> write kernel ids    (per sub-pool)
                   req_to_token + v2p --alloc.block_table--> block table (per sub-pool)
    hybrid models: request slots --alloc.mamba_slots--> physical state slots
                   (verify steps also --mamba_slots(drafts=True)--> per-draft-position
                   slots, (B, k): the state after each draft token is written there)

    host arrays --one copy--> one device byte buffer (``plan_upload.StepUpload``):
        input_ids, positions, logits_indices, lanes, seq_lens, slots, q_indptr

``plan(batch, rows=R)`` pads the batch to R rows (CUDA graphs): a padded lane
feeds token 0 at position 0 with seq_len 1, block-table row 0, write id 0 and
state slot 0, so it reads and writes only sink bytes. For a given R the views
lie at the same addresses every step, so a graph captured over ``plan(Batch(),
rows=R)`` replays over any later plan of R rows. Decode attention's launch plan
(``backend.plan_decode``: splits, config, workspace) is made here once per step
and sub-pool, and the row-shaped ops' plan (``backend.plan_rows``: the GEMV routing,
the MoE's dense table or sparse loop and bucket, the FP8 GEMM's variant) once per
step for its token rows and once for its logits rows (a graph's: its captured size);
every layer only reads the StepPlan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from unikv.engine.plan_tables import KeptTables
from unikv.engine.plan_upload import ALL, StepUpload
from unikv.engine.scheduler import Batch, BatchKind
from unikv.ids import KernelIds
from unikv.kernels.backend import DecodePlan, ExtendPlan, KernelBackend, RowsPlan
from unikv.kernels.recurrent.fla_prefill import CkptSplit, chunk_indices, ckpt_split, fla_available

if TYPE_CHECKING:
    from unikv.allocator import PoolAllocator


DRAFT_PREFIX = "draft_"  # a speculative draft's sub-pools (``speculative/draft.py``)


@dataclass(frozen=True)
class StepTables:
    """The planner's table buffers, per token sub-pool: ``block_tables[n]``
    (max_seqs, ceil(max_context / page_size)) int32 kernel page entries and
    ``write_ids[n]`` (max_tokens,) int64 kernel ids; ``alloc.decode_step`` and
    the planner write them in place (fixed addresses: CUDA-graph inputs)."""

    block_tables: dict[str, torch.Tensor]
    write_ids: dict[str, torch.Tensor]
    # the same buffers less a speculative draft's sub-pools (None: none): a plain
    # decode step past the batch-size rule, whose draft is lazy, builds and plans
    # the target's tables only
    target_only: StepTables | None = None


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
    draft_slots: (B, k) int64 physical per-draft-position state slots of each request
        in a speculative verify step of a hybrid model (0 = the sink for padded
        lanes), else None.
    ckpt_slots: (R,) int64 physical checkpoint slots of an extend step's requests whose
        prefill chunk ends at a prefix-cache checkpoint (reserved before the step:
        ``alloc.prefix.reserve_checkpoint``): the recurrent ops write each final state
        there too (0 = the sink for the others), so the checkpoint needs no copy;
        None when no request of the step has one.
    ckpt_at: (R,) int64 with ``ckpt_slots``, the row of each lane after which its
        state is the checkpoint's where the checkpoint lies inside its chunk (the
        page-aligned end of a prompt whose last chunk runs on to the prompt's end,
        issue 41), -1 where it is the chunk's end and for the others; None when every
        checkpoint of the step is a chunk's end.
    ckpt_split: with ``ckpt_at`` on a chunked step with fla-core (``state_chunks``),
        the lanes split at those rows for its two calls (``fla_prefill.CkptSplit``),
        made on the host and uploaded in one copy; else None.
    state_indptr, state_chunks: for a chunked step (more than one new token a
        request, no verify slots) of a hybrid model on CUDA with fla-core, q_indptr as
        (B+1,) int64 and fla-core's chunk list of it, (NT, 2) int64
        (``fla_prefill.chunk_indices``), made from the host's q_indptr and copied in one
        asynchronous copy, a new tensor every step; else None. The recurrent layers
        hand them to fla-core: its Gated DeltaNet derives nothing from the device (no
        host sync), and Mamba-2's ``chunk_simple_gla``, which takes no list, memoises
        its own by the identity of ``cu_seqlens``: once a step, not once a layer (the
        plan's q_indptr is the same tensor every step with new contents: a memo keyed
        on it would go stale).
    fresh: host bool, an extend step in which no request has cached tokens (every
        seq_len is its q_len): extend attention may read the step's own K/V rows.
    split: an extend step whose last requests, not all of them, have no cached
        tokens (``FreshSplit``: prompts joining a step of decodes and continued
        chunks): attention runs in two parts, else None.
    extend: per attention sub-pool the ExtendPlan of the step's fresh prompts (a
        fresh step's, or a split step's fresh part: the variant their length takes),
        else None.
    feedback: the planner's (max_seqs,) int64 buffer of the previous step's tokens,
        in the plans of one-row graphs when ``StepPlanner.feed_graphs`` (a model
        that resolves placeholders from it: ``CausalLM.resolves_feedback``), else None.
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
    draft_slots: torch.Tensor | None = None
    ckpt_slots: torch.Tensor | None = None
    ckpt_at: torch.Tensor | None = None
    ckpt_split: CkptSplit | None = None
    state_indptr: torch.Tensor | None = None
    state_chunks: torch.Tensor | None = None
    fresh: bool = False
    split: FreshSplit | None = None
    extend: dict[str, ExtendPlan] | None = None
    feedback: torch.Tensor | None = None
    slots: torch.Tensor | None = None  # (R,) int32 request slots (padded lanes: 0)
    # the row-shaped ops' plans (``backend.plan_rows``): ``rows`` of the step's T token
    # rows (padded lanes included), ``logit_rows`` of its R logits rows (one a request)
    rows: RowsPlan | None = None
    logit_rows: RowsPlan | None = None


class FreshSplit(NamedTuple):
    """Requests ``[first:]`` of an extend step (token rows ``[row:]``) have no cached
    tokens, request ``first - 1`` has: extend attention reads the cached part through
    the block table (``max_q_cached``: its longest q) and the fresh prompts from their
    own K/V rows (``max_q_fresh``; ``q_indptr``: their (B - first + 1,) int32 row
    offsets from ``row``, on the device). Host ints but q_indptr."""

    first: int
    row: int
    max_q_cached: int
    max_q_fresh: int
    q_indptr: torch.Tensor


def fresh_suffix(cached: np.ndarray) -> int:
    """The first of the trailing requests with no cached tokens (len: none)."""
    held = np.flatnonzero(cached)
    return int(held[-1]) + 1 if held.size else 0


class StepPlanner:
    """Builds every StepPlan over buffers it owns.

    Args:
        alloc: the PoolAllocator (decode_step fills ``tables``; translate,
            block_table and mamba_slots fill them otherwise).
        backend: the KernelBackend (its ``plan_decode``).
        max_seqs: requests per step at most; max_tokens: tokens per step at most.
        q_per_kv: query heads per KV head (sizes decode attention's workspace);
            ``q_per_kv_of``: per sub-pool name, where another model's differs (a
            speculative draft model's sub-pools).
        pin: stage host arrays in pinned memory (CUDA), decided once.
        feed_graphs: one-row graph plans carry ``feedback`` (the model resolves
            placeholder tokens from it and writes its greedy tokens there).
    """

    def __init__(
        self,
        alloc: PoolAllocator,
        backend: KernelBackend,
        *,
        max_seqs: int,
        max_tokens: int,
        q_per_kv: int,
        q_per_kv_of: dict[str, int] | None = None,
        pin: bool = False,
        feed_graphs: bool = False,
    ) -> None:
        pool = alloc.pool
        self.alloc, self.backend, self.device = alloc, backend, pool.device
        self.max_seqs, self.max_tokens = max_seqs, max(max_tokens, max_seqs)
        self.max_context = alloc.view.max_context
        subs = [s for s in pool.subpools.values() if s.spec.kind != "mamba"]
        self.subpools, self.has_state = subs, len(subs) < len(pool.subpools)
        self.attention = [s for s in subs if s.spec.kind in ("full", "swa")]
        dev, rows = self.device, max_seqs
        # the sub-pools' write ids: rows of one tensor (host-computed ones: one copy)
        self.write_rows = torch.zeros((len(subs), self.max_tokens), dtype=torch.int64, device=dev)
        drafts = {s.name for s in subs if s.name.startswith(DRAFT_PREFIX)}
        tables = {s.name: torch.zeros((rows, self._pages(s)), dtype=torch.int32, device=dev)
                  for s in subs}  # fmt: skip
        writes = {s.name: self.write_rows[i] for i, s in enumerate(subs)}
        target = None
        if drafts and len(drafts) < len(subs):
            target = StepTables({n: t for n, t in tables.items() if n not in drafts},
                                {n: t for n, t in writes.items() if n not in drafts})  # fmt: skip
        self.tables = StepTables(tables, writes, target)
        self._target_subpools = [s for s in subs if s.name not in drafts]
        self._target_attention = [s for s in self.attention if s.name not in drafts]
        self.state_slots = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.draft_k = alloc.view.draft_k if self.has_state else 0  # verify steps: (B, k) slots
        self.draft_slots = torch.zeros((rows, max(self.draft_k, 1)), dtype=torch.int64, device=dev)
        # one-row graphs read placeholder tokens from here and a greedy one writes its
        # token here, so a steady single request's step needs no token gather
        self.feedback = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.feed_graphs = feed_graphs
        self.upload = StepUpload(
            dev, max_seqs=rows, max_tokens=self.max_tokens, pin=pin, subpools=len(subs)
        )
        self.host_writes = 0  # steps whose write ids came from the host (the tests' spy)
        # chunked steps carry q_indptr in int64 and fla-core's chunk list of it
        # (``StepPlan.state_chunks``): a hybrid on CUDA with fla-core, decided once (a
        # test may set it on the CPU)
        self.state_chunks = self.has_state and dev.type == "cuda" and fla_available()
        self._pin = pin
        windows = [s.spec.sliding_window or 0 for s in subs]
        self.kept_tables = KeptTables(alloc.view.roles.page_size, windows)  # a verify step's
        self._q_per_kv = {s.name: q_per_kv for s in subs} | dict(q_per_kv_of or {})
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
        self,
        batch: Batch,
        prev_tokens: torch.Tensor | None = None,
        *,
        rows: int | None = None,
        prev_fed: bool = False,
        pad_q: int = 1,
        slack: int = 0,
    ) -> StepPlan:
        """The StepPlan of ``batch``; placeholders (``Pending``) in its tokens are
        read from ``prev_tokens`` (B_prev,) int64, the previous step's samples on the
        device. rows: None (eager: B rows, tables as wide as the longest request),
        or R >= B (CUDA graphs: padded to R sink lanes, full-width tables).
        prev_fed: those samples are in ``self.feedback`` (a one-row greedy graph wrote
        them), where a one-row graph reads them itself. pad_q: tokens per padded
        lane (a speculative verify graph's: every lane feeds k + 1). slack: window
        tokens the block tables keep further back (a verify step planned ahead, whose
        rows may move that much lower: ``speculative/derive.py``)."""
        num = len(batch.requests)
        assert num <= (rows or num) <= self.max_seqs, (
            f"step planner invariant: {num} requests in a step of {rows} rows, buffers "
            f"hold {self.max_seqs}"
        )
        target = self.tables.target_only
        target_only = (
            batch.kind is BatchKind.DECODE and target is not None and batch.tables is target
        )
        assert batch.kind is BatchKind.EXTEND or batch.tables is self.tables or target_only, (
            "step planner invariant: a DECODE batch's tables are this planner's buffers "
            "(build the Scheduler with tables=StepPlanner.tables)"
        )
        staged = batch.host_rows  # a verify step's row ids on the host: in this upload
        if staged is not None and staged.on_device:  # (uploaded already: a draft model's)
            staged = None
        row_ids = staged.host if staged is not None else None
        writes = self._host_writes(row_ids) if row_ids is not None and num else None
        dev, host, pending = self.upload.upload(batch, rows or num, pad_q, row_ids, writes)
        if staged is not None:
            staged.put(dev["row_ids"][: len(row_ids)])
        longest = None  # tokens the tables must span (None: the whole context)
        if rows is None:
            rows = num
            longest = int(host["seq_lens"].max()) if num else 1
        feed = self.feed_graphs and rows == 1 and pad_q == 1  # a one-row decode graph
        if prev_tokens is not None and not (feed and pending is ALL and prev_fed):
            # (else the graph resolves the placeholders of its last step's tokens itself)
            self.upload.fill(dev, pending, prev_tokens, num)
        max_q_len = max(batch.num_new, default=pad_q)
        is_decode = batch.is_decode and pad_q == 1
        # requests [first:] have no cached tokens: all of them (fresh) or a split step;
        # a verify graph's plan (pad_q > 1) never: its requests are decoding ones
        first = -1 if is_decode else fresh_suffix(host["seq_lens"][:num] - batch.num_new)
        first = num if pad_q > 1 else first
        verify = self.draft_k > 0 and (pad_q > 1 or batch.drafts is not None)
        split = self._split(batch, dev, host, first) if 0 < first < num == rows else None
        fresh = first == 0 and pad_q == 1  # no cached tokens: the cache holds the new ones
        chunked = self.state_chunks and max_q_len > 1 and not verify and num > 0
        indptr, chunks = self._state_chunks(host, rows) if chunked else (None, None)
        ckpt = self._ckpt_rows(host, num, rows) if self.has_state and num else None
        ckpt_slots, ckpt_at, lanes_split = None, None, None
        if ckpt is not None:
            ckpt_slots, ckpt_at, at_host = ckpt
            if ckpt_at is not None and chunked:
                lanes_split = self._ckpt_split(host, rows, at_host)
        num_tokens = dev["input_ids"].shape[0]  # T rows, padded lanes included: host int
        rows_plan = self.backend.plan_rows(num_tokens)
        logit_rows = rows_plan if num_tokens == rows else self.backend.plan_rows(rows)
        extend = None
        if fresh:
            extend = self._extend_plans(num, max_q_len)
        elif split is not None:
            extend = self._extend_plans(num - split.first, split.max_q_fresh)
        return StepPlan(
            is_decode=is_decode,
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            logits_indices=dev["logits_indices"],
            seq_lens=dev["seq_lens"],
            q_indptr=dev["q_indptr"],
            max_q_len=max_q_len,
            subpools=self._tables(
                batch, dev, host, rows, longest, max_q_len, pad_q, slack, writes, target_only
            ),
            decode=self._decode_plans(rows, longest, target_only) if is_decode else None,
            state_slots=self._state_slots(dev["slots"], num) if self.has_state else None,
            draft_slots=self._draft_slots(dev["slots"], num) if verify else None,
            ckpt_slots=ckpt_slots,
            ckpt_at=ckpt_at,
            ckpt_split=lanes_split,
            state_indptr=indptr,
            state_chunks=chunks,
            fresh=fresh,
            split=split,
            extend=extend,
            feedback=self.feedback if feed else None,
            slots=dev["slots"],
            rows=rows_plan,
            logit_rows=logit_rows,
        )

    def _host_writes(self, row_ids: np.ndarray) -> np.ndarray | None:
        """(S, n) int64 kernel ids of a verify step's rows (host virtual ids) per
        token sub-pool, from the allocator's host page mirror (None: no sub-pool)."""
        if not self.subpools:
            return None
        view, out = self.alloc.view, np.empty((len(self.subpools), len(row_ids)), np.int64)
        for i, sub in enumerate(self.subpools):
            out[i] = view.row_kernel_ids(sub.name, row_ids)
        return out

    @staticmethod
    def _split(batch: Batch, dev: dict, host: dict, first: int) -> FreshSplit:
        """The FreshSplit of an eager extend step whose requests ``[first:]`` (0 < first
        < B) have no cached tokens."""
        num = len(batch.requests)
        row = int(host["q_indptr"][first])
        return FreshSplit(
            first,
            row,
            max(batch.num_new[:first]),
            max(batch.num_new[first:]),
            dev["q_indptr"][first : num + 1] - row,
        )

    def _tables(
        self, batch: Batch, dev: dict, host: dict, rows: int, longest, max_q_len: int, pad_q=1,
        slack=0, writes=None, target_only=False,
    ):  # fmt: skip
        """Per token sub-pool, the write ids and block table of the step: decode_step
        wrote them (DECODE), else translated here; padded rows point at the sink. A
        verify step whose requests' tables are those in the buffers (``plan_tables``)
        writes its write ids only. ``writes``: (S, n) the rows' write ids computed on
        the host (``AllocatorView.row_kernel_ids``) and staged in the step's upload:
        one copy for every sub-pool, no translation. ``target_only``: a DECODE batch
        whose decode_step built the target's tables only (``target_tables``: a lazy
        draft's sub-pools are left out of the step)."""
        num, steps = len(batch.requests), {}
        num_tokens = dev["input_ids"].shape[0]
        real = num_tokens - (rows - num) * pad_q  # tokens of real requests (padded lanes: pad_q)
        virtual_ids = batch.virtual_ids if num and batch.kind is BatchKind.EXTEND else None
        if virtual_ids is None and batch.step is not None:  # pages moved since decode_step?
            batch.step.refresh()
        kept, reuse = self.kept_tables, False
        verify = virtual_ids is not None and batch.drafts is not None and batch.derive is None
        verify = verify and bool(self.subpools)  # (a model of state only: no tables)
        if verify:  # (a verify step: its tables may be the last one's)
            epoch = self.alloc.view.mapping_epoch
            reach = max_q_len - 1 + slack
            bounds = kept.live(host["slots"][:num], host["seq_lens"][:num], reach)
            key = (rows, num_tokens, real, self._pages(self.subpools[0], longest), reach)
            reuse = kept.holds(epoch, key, bounds)
        if writes is not None:  # (the host knew the rows: a verify step's)
            assert virtual_ids is not None and writes.shape[1] == real, (
                "step planner invariant: host write ids are a verify step's, one a row"
            )
            self.write_rows[:, :real].copy_(dev["write_ids"][:, :real])
            self.host_writes += 1
        for sub in self._target_subpools if target_only else self.subpools:
            table = self.tables.block_tables[sub.name][:rows, : self._pages(sub, longest)]
            write = self.tables.write_ids[sub.name][:num_tokens]
            if virtual_ids is not None:
                if not reuse:
                    window = sub.spec.sliding_window or 0
                    window += max_q_len - 1 + slack if window else 0  # a first new token: W back
                    seq_lens, slots = dev["seq_lens"][:num], dev["slots"][:num]
                    self.alloc.block_table(slots, seq_lens, sub.name, table[:num], window=window)
                if writes is None:
                    self.alloc.translate(virtual_ids, sub.name, out=write)
            if num < rows and not reuse:  # (reused: the padded rows are as they were)
                table[num:].zero_()
                write[real:].zero_()
            steps[sub.name] = SubPoolStep(KernelIds(write, sub.name), table)
        if reuse:
            kept.reused += 1
        elif verify:
            kept.keep(epoch, key, bounds)
        else:
            kept.drop()  # (the buffers hold another step's tables now)
        return steps

    def _extend_plans(self, num: int, max_q_len: int) -> dict[str, ExtendPlan]:
        """The fresh prompts' launch plan per attention sub-pool, once per step: ``num``
        prompts, the longest ``max_q_len`` tokens (host ints)."""
        return {
            s.name: self.backend.plan_extend(num, max_q_len=max_q_len, head_dim=s.spec.head_dim)
            for s in self.attention
        }

    def decode_plans(self, rows: int, longest: int | None = None) -> dict[str, DecodePlan]:
        """Decode attention's launch plan per attention sub-pool for ``rows`` one-token
        lanes over tables spanning ``longest`` tokens (None: the whole context, a
        graph's): a draft chain's steps (``speculative/chain.py``), made once per chain."""
        return self._decode_plans(rows, longest)

    def _decode_plans(self, rows: int, longest, target_only=False) -> dict[str, DecodePlan]:
        """Decode attention's launch plan per attention sub-pool, once per step (the
        target's only: ``target_only``, a lazy draft's step)."""
        subs = self._target_attention if target_only else self.attention
        return {s.name: self._decode_plan(s, rows, self.workspace, longest) for s in subs}

    def _decode_plan(self, sub, rows: int, workspace, longest=None) -> DecodePlan:
        spec = sub.spec
        max_len = self._pages(sub, longest) * sub.page_size  # the block table's capacity
        if spec.sliding_window:
            max_len = min(max_len, spec.sliding_window)
        return self.backend.plan_decode(
            rows,
            num_q_heads=spec.num_kv_heads * self._q_per_kv[sub.name],
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            v_head_dim=spec.v_head_dim,
            page_size=sub.page_size,
            max_len=max_len,
            device=self.device,
            workspace=workspace,
        )

    def _draft_slots(self, slots: torch.Tensor, num: int) -> torch.Tensor:
        """(R, k) int64 per-draft-position state slots of a verify step's rows (padded
        rows: 0, the sink), at fixed addresses (verify graphs read them)."""
        out = self.draft_slots[: slots.shape[0]]
        if num:
            out[:num].copy_(self.alloc.mamba_slots(slots[:num], drafts=True).data)
        out[num:].zero_()
        return out

    def _ckpt_rows(self, host: dict, num: int, rows: int):
        """(ckpt_slots, ckpt_at, the rows on the host) of the checkpoints the step's
        chunks reach (``StepPlan.ckpt_slots``, ``ckpt_at``), or None (no reservation: a
        host check only)."""
        return self.alloc.prefix.checkpoint_rows(
            host["slots"][:num], host["seq_lens"][:num], host["q_indptr"][: num + 1], rows
        )

    def _ckpt_split(self, host: dict, rows: int, at: np.ndarray) -> CkptSplit | None:
        """``StepPlan.ckpt_split``: ``fla_prefill.ckpt_split`` of the step's host q_indptr
        and checkpoint rows, uploaded in one asynchronous copy (pinned on CUDA)."""
        arrays = ckpt_split(host["q_indptr"][: rows + 1], at)
        return None if arrays is None else CkptSplit(*self._upload(arrays))

    def _state_chunks(self, host: dict, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_indptr (R+1,) int64, fla-core's chunk list of it (NT, 2) int64) of the
        step's host q_indptr, on the device: one asynchronous copy (pinned on CUDA), no
        sync; views of one new tensor (``StepPlan.state_chunks``)."""
        indptr = host["q_indptr"][: rows + 1].astype(np.int64)
        got, chunks = self._upload([indptr, chunk_indices(indptr)])
        return got, chunks

    def _upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Host int64 arrays on the device in one asynchronous copy (pinned on CUDA), no
        sync: views of one new tensor, in their shapes."""
        both = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))
        if self._pin:
            both = both.pin_memory()
        both = both.to(self.device, non_blocking=True)
        views, at = [], 0
        for a in arrays:  # a few arrays a step, not requests
            views.append(both[at : at + a.size].view(a.shape))
            at += a.size
        return views

    def _state_slots(self, slots: torch.Tensor, num: int) -> torch.Tensor:
        """(R,) int64 physical state slots of the rows (padded rows: 0, the sink),
        translated once per step, outside any graph."""
        state = self.state_slots[: slots.shape[0]]
        if num:
            state[:num].copy_(self.alloc.mamba_slots(slots[:num]).data)
        state[num:].zero_()
        return state
