"""A decode step's result and output buffers. ``PoolAllocator.decode_step`` is one
call per step: allocate, free out-of-window pages, build the block tables and
translate the write ids of every token sub-pool.

``decode_step(slots, seq_lens)`` equals, in effect,

    ids = alloc_decode(slots, seq_lens)
    free_out_of_window(slots, seq_lens + 1)
    for each token sub-pool n (window W_n, 0 for none):
        block_table(slots, seq_lens + 1, n, table_n, window=W_n)
        translate(ids, n, out=loc_n)

but costs one upload and two launches (``update_tables``, then
``kernels.tables.step_tables``) instead of three uploads and six launches, and its host
bookkeeping is shared. Allocation runs before the frees, so no physical page is
both freed and taken in one step (the fused table write needs distinct indices).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from unikv.allocator.pages import PageBook
from unikv.allocator.translate import check_block_table
from unikv.ids import KernelIds, KernelPageIds, VirtualTokenIds
from unikv.kernels.tables.ref import StepTarget

# KernelBackend.prepare_step: (req_to_token, page_size, targets) -> run(req_slots, seq_lens)
PrepareStep = Callable[..., Callable[[torch.Tensor, torch.Tensor], None]]


@dataclass
class DecodeStep:
    """What ``decode_step`` wrote, all on the device.

    virtual_ids: (B,) the new tokens' virtual ids; req_slots, seq_lens: (B,)
    int32 (lengths include the new token); block_tables[n]: (B, C) kernel page
    entries of sub-pool n; write_ids[n]: (B,) kernel ids where n stores the new
    token (views of the caller's buffers when given). moves: the allocator's page
    moves when the tables were built (``TableWriter.moves``, read by ``count_moves``);
    rebuild: the launch that builds them again from the allocator's tables
    (``refresh`` runs it once pages moved since)."""

    virtual_ids: VirtualTokenIds
    req_slots: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: dict[str, KernelPageIds]
    write_ids: dict[str, KernelIds]
    moves: int = 0
    rebuild: Callable[[], None] | None = None
    count_moves: Callable[[], int] | None = None

    def refresh(self) -> bool:
        """Rebuild the tables and write ids if pages moved since they were built
        (compaction after ``decode_step``: a reserve for a prefix reload or a swap-in
        that then did not admit); one launch, no host sync. True if it rebuilt. Call
        it right before the forward that reads them (the step planner does)."""
        if self.count_moves is None or self.rebuild is None or self.count_moves() == self.moves:
            return False
        self.rebuild()
        self.moves = self.count_moves()
        return True


@dataclass
class _Checked:
    """Caller-owned buffers checked once: the rows and columns they hold, their
    StepTargets, and the prepared step-tables launch over them."""

    rows: int
    cols: int
    targets: list[StepTarget]
    run: Callable[[torch.Tensor, torch.Tensor], None]
    books: list[PageBook]  # the sub-pools of ``targets``, in order


class StepBuffers:
    """The output buffers of ``decode_step`` per token sub-pool (checked, or new)
    and the prepared ``KernelBackend.prepare_step`` launch over them. Caller-owned
    buffers are checked once and reused while the same tensors come back with
    room for the step. A step may build the tables of some token sub-pools only
    (buffers given for those: a lazy speculative draft's sub-pools are left out past
    the batch-size rule); each set of names keeps its own checked buffers."""

    def __init__(
        self,
        req_to_token: torch.Tensor,
        books: Sequence[PageBook],
        windows: Mapping[str, int],
        page_size: int,
        prepare_step: PrepareStep,
    ) -> None:
        self.req_to_token, self.books, self.windows = req_to_token, list(books), windows
        self.page_size, self.prepare_step = page_size, prepare_step
        self.names = [b.name for b in self.books]
        self._checked: dict[tuple[str, ...], _Checked] = {}

    def get(
        self,
        bsz: int,
        longest: int,
        block_tables: Mapping[str, torch.Tensor] | None,
        write_ids: Mapping[str, torch.Tensor] | None,
    ) -> tuple[list[StepTarget], Callable[[torch.Tensor, torch.Tensor], None], list[PageBook]]:
        """StepTargets for a step of ``bsz`` requests, the longest ``longest``
        tokens (the new one included), the launch that fills them, and their books.

        block_tables: None, or per token sub-pool (every one, or those whose tables
        the step builds) an int32 (>= B, C) tensor with unit column stride and C *
        page_size >= longest (all of one shape); write_ids: None, or per the same
        sub-pools a 1-D int32/int64 tensor of >= B entries; none may alias another.
        Given buffers are written in place (stable ``data_ptr`` for CUDA graphs);
        None gives buffers of its own, for every sub-pool."""
        cols = -(-longest // self.page_size)
        key = tuple(block_tables) if block_tables is not None else ()
        checked = self._checked.get(key)
        if (  # the hot path: the buffers checked before (no extra test on it)
            checked is not None
            and block_tables is not None
            and write_ids is not None
            and bsz <= checked.rows
            and cols <= checked.cols
            and len(write_ids) == len(checked.targets)
            and all(
                block_tables[b.name] is t.table and write_ids.get(b.name) is t.loc
                for b, t in zip(checked.books, checked.targets)
            )
        ):  # the very tensors checked before, under the same names
            return checked.targets, checked.run, checked.books
        books = self._books(block_tables, write_ids)
        targets = self._check(bsz, cols, books, block_tables, write_ids)
        run = self.prepare_step(self.req_to_token, self.page_size, targets)
        if block_tables is not None and write_ids is not None:
            rows = min(min(t.table.shape[0], t.loc.shape[0]) for t in targets)
            self._checked[key] = _Checked(rows, targets[0].table.shape[1], targets, run, books)
        return targets, run, books

    def _books(
        self,
        block_tables: Mapping[str, torch.Tensor] | None,
        write_ids: Mapping[str, torch.Tensor] | None,
    ) -> list[PageBook]:
        """The books of the sub-pools the given buffers name (all: none given)."""
        for what, given in (("block_tables", block_tables), ("write_ids", write_ids)):
            if given is not None and (not given or not set(given) <= set(self.names)):
                raise ValueError(
                    f"decode_step: {what} must name token sub-pools of {self.names} (all of "
                    f"them, or those the step builds), got {sorted(given)}"
                )
        if (
            block_tables is not None
            and write_ids is not None
            and set(block_tables) != set(write_ids)
        ):
            raise ValueError(
                f"decode_step: block_tables and write_ids must name the same sub-pools, got "
                f"{sorted(block_tables)} and {sorted(write_ids)}"
            )
        given = block_tables if block_tables is not None else write_ids
        return [b for b in self.books if given is None or b.name in given]

    def builder(
        self,
        run: Callable[[torch.Tensor, torch.Tensor], None],
        targets: list[StepTarget],
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        debug: bool,
        books: list[PageBook],
    ) -> Callable[[], None]:
        """The launch that builds a step's tables from ``req_to_token`` and ``v2p`` as
        they are when it runs (debug: then checks them)."""

        def build() -> None:
            run(req_slots, seq_lens)
            if debug:
                self.check(targets, req_slots, seq_lens, books)

        return build

    def check(
        self,
        targets: list[StepTarget],
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        books: list[PageBook],
    ) -> None:
        """Debug mode: no live block-table page of the step maps to a tombstone."""
        bsz = req_slots.shape[0]
        for book, t in zip(books, targets, strict=True):
            check_block_table(t.table[:bsz], self.req_to_token, req_slots, seq_lens, t.v2p,
                              self.page_size, t.window, book.name)  # fmt: skip

    def result(
        self,
        virtual_ids: VirtualTokenIds,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        targets: list[StepTarget],
        books: list[PageBook],
    ) -> DecodeStep:
        """The DecodeStep over ``targets`` (of ``books``; views only when buffers are
        larger)."""
        bsz = req_slots.shape[0]
        tables, locs = {}, {}
        for book, t in zip(books, targets, strict=True):
            table = t.table if t.table.shape[0] == bsz else t.table[:bsz]
            tables[book.name] = KernelPageIds(table, book.name)
            locs[book.name] = KernelIds(t.loc if t.loc.shape[0] == bsz else t.loc[:bsz], book.name)
        return DecodeStep(virtual_ids, req_slots, seq_lens, tables, locs)

    def _check(
        self,
        bsz: int,
        cols: int,
        books: list[PageBook],
        block_tables: Mapping[str, torch.Tensor] | None,
        write_ids: Mapping[str, torch.Tensor] | None,
    ) -> list[StepTarget]:
        """Checked (or new) output buffers of ``books``' sub-pools, as StepTargets."""
        dev = self.req_to_token.device
        targets, shape = [], None
        for book in books:
            name = book.name
            if block_tables is None:
                table = torch.empty((bsz, cols), dtype=torch.int32, device=dev)
            elif (
                (table := block_tables[name]).dtype != torch.int32
                or table.dim() != 2
                or table.shape[0] < bsz
                or table.shape[1] < cols
                or table.stride(1) != 1
                or table.device != dev
                or shape not in (None, (table.shape, table.stride()))
            ):
                raise ValueError(
                    f"decode_step: block_tables[{name!r}] must be an int32 ({bsz}+, {cols}+) "
                    f"tensor on {dev} with unit column stride, every table of one "
                    f"shape; got {table.dtype} {tuple(table.shape)} stride {table.stride()} "
                    f"on {table.device}"
                )
            shape = table.shape, table.stride()
            if write_ids is None:
                loc = torch.empty(bsz, dtype=torch.int32, device=dev)
            elif (
                (loc := write_ids[name]).dim() != 1
                or loc.shape[0] < bsz
                or loc.dtype not in (torch.int32, torch.int64)
                or not loc.is_contiguous()
                or loc.device != dev
            ):
                raise ValueError(
                    f"decode_step: write_ids[{name!r}] must be a contiguous 1-D int32/int64 "
                    f"tensor of >= {bsz} entries on {dev}; got {loc.dtype} "
                    f"{tuple(loc.shape)} on {loc.device}"
                )
            window = self.windows.get(name, 0)
            targets.append(StepTarget(book.v2p, book.blocks_per_page, window, table, loc))
        if block_tables is not None or write_ids is not None:
            names = [b.name for b in books]
            outputs = {f"block_tables[{n!r}]": t.table for n, t in zip(names, targets)}
            outputs |= {f"write_ids[{n!r}]": t.loc for n, t in zip(names, targets)}
            inputs = {f"v2p of {b.name!r}": b.v2p for b in self.books}
            check_disjoint(outputs, {"req_to_token": self.req_to_token, **inputs})
        return targets


def _row_spans(tensor: torch.Tensor) -> np.ndarray:
    """Byte ranges ``[start, end)`` (R, 2) holding the elements of a 1-D tensor or of
    a 2-D tensor with unit column stride (one range per row). Metadata only."""
    size = tensor.element_size()
    if tensor.numel() == 0:
        return np.zeros((0, 2), np.int64)
    if tensor.dim() == 1:
        return np.array([[0, tensor.shape[0] * size]], np.int64) + tensor.data_ptr()
    rows = np.arange(tensor.shape[0], dtype=np.int64) * tensor.stride(0) * size
    starts = rows + tensor.data_ptr()
    return np.stack([starts, starts + tensor.shape[1] * size], axis=1)


def check_disjoint(outputs: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless no two output elements share memory and no output overlaps
    an input (outputs: 1-D, or 2-D with unit column stride; inputs: contiguous).
    Host work on tensor metadata only (no device access); slow path."""
    spans = [(what, _row_spans(t)) for what, t in outputs.items()]
    spans += [(what, _row_spans(t.view(-1))) for what, t in inputs.items()]
    owner = np.concatenate([np.full(len(r), i) for i, (_, r) in enumerate(spans)])
    ranges = np.concatenate([r for _, r in spans])
    order = np.argsort(ranges[:, 0], kind="stable")
    ranges, owner = ranges[order], owner[order]
    ends = np.maximum.accumulate(ranges[:, 1])
    clash = np.flatnonzero(ranges[1:, 0] < ends[:-1])  # a range starts before an earlier ends
    for k in clash + 1:
        for j in np.flatnonzero(ranges[:k, 1] > ranges[k, 0]):  # earlier ranges it enters
            a, b = spans[owner[j]][0], spans[owner[k]][0]
            if a in inputs and b in inputs:
                continue  # inputs may share memory with each other
            what = f"{a} overlaps itself" if a == b else f"{a} and {b} overlap"
            raise ValueError(
                f"decode_step: {what} in memory; every block table and write-id buffer "
                "needs memory of its own (none may alias another or the allocator's "
                "tables), or one sub-pool's values overwrite another's"
            )
