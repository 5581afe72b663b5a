"""Device table writes: a typed patch, packed into one upload, applied in one launch.

    packed = [ header: S rows of HEADER ints | part 0 | part 1 | ... ]
    row s  = (table, offset of its index part, offset of its value part or -1, count)

A ``TablePatch`` collects host arrays (parts) and the writes between them
(``add``: ``tables[table][index] = values``; ``add_tombstones``: ``= -1``). A
part may be both an index and a value (``v2p[vpages] = ppages`` and
``p2v[ppages] = vpages`` share two parts) or neither (data the caller wants on
the device, e.g. the new tokens' virtual ids). ``TableWriter.write`` uploads the
packed array once and applies every write with one fused launch
(``KernelBackend.update_tables``); ``Written[part]`` is that part on the device.
The indices one patch writes into one table must be distinct. Values are never
Python scalars sent to the device (docs/lessons.md bug 6).

One write per step (issue 41): inside ``TableWriter.batch()`` a verb's v2p/p2v writes
(evictions, checkpoint drops, frees: ``stage``) are not sent on their own; their
indices are marked and go out with the next ``write`` (a decode step's, a checkpoint
flush's) or in one write when the outermost scope closes, each with the value the
host mirror holds then (the truth, so an index staged twice, or also written by that
patch, is written once, correctly). Nothing on the device reads those entries
before the scope's verbs end. A ``batch(hold=True)`` scope (a preemption's free)
leaves them for the next write, the step's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import torch

from unikv.allocator.device import Uploader
from unikv.allocator.pages import PageBook
from unikv.kernels.backend import KernelBackend
from unikv.kernels.tables.ref import HEADER

Part = int  # a handle of one host array of a patch


class TablePatch:
    """Writes of one verb into a writer's tables (table ids index ``TableWriter.tables``
    or the list given to ``TableWriter.write``)."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.segments: list[tuple[int, Part, Part]] = []  # (table, index part, value part | -1)

    def part(self, values: np.ndarray) -> Part:
        """Add a host integer array (cast to int32 on upload); returns its handle."""
        self.parts.append(values)
        return len(self.parts) - 1

    def _as_part(self, values: np.ndarray | Part) -> Part:
        return values if isinstance(values, Part) else self.part(values)

    def add(self, table: int, index: np.ndarray | Part, values: np.ndarray | Part) -> None:
        """``tables[table][index] = values`` (arrays or part handles of equal length)."""
        self.segments.append((table, self._as_part(index), self._as_part(values)))

    def add_tombstones(self, table: int, index: np.ndarray | Part) -> None:
        """``tables[table][index] = -1``."""
        self.segments.append((table, self._as_part(index), -1))

    def __bool__(self) -> bool:
        return bool(self.segments)

    def pack(self) -> tuple[list[np.ndarray], list[int], list[int], int]:
        """(header and parts for the uploader, offset and size of each part, max count)."""
        sizes = [len(a) for a in self.parts]
        offsets = list(accumulate(sizes[:-1], initial=HEADER * len(self.segments)))
        header: list[int] = []
        for table, index, value in self.segments:
            header += (table, offsets[index], offsets[value] if value >= 0 else -1, sizes[index])
        max_count = max((sizes[i] for _, i, _ in self.segments), default=0)
        return [np.array(header, np.int32), *self.parts], offsets, sizes, max_count


class Written:
    """The uploaded packed array of a patch; ``written[part]`` is part's (n,) int32
    device slice (no copy)."""

    __slots__ = ("offsets", "packed", "sizes")

    def __init__(self, packed: torch.Tensor, offsets: list[int], sizes: list[int]) -> None:
        self.packed, self.offsets, self.sizes = packed, offsets, sizes

    def __getitem__(self, part: Part) -> torch.Tensor:
        start = self.offsets[part]
        return self.packed[start : start + self.sizes[part]]


class _Scope:
    """``TableWriter.batch``'s context manager (a class: no generator per entry)."""

    __slots__ = ("hold", "writer")

    def __init__(self, writer: TableWriter, hold: bool) -> None:
        self.writer, self.hold = writer, hold

    def __enter__(self) -> None:
        self.writer.enter_batch()

    def __exit__(self, *exc: object) -> None:  # an error settles too: state stays whole
        self.writer.exit_batch(self.hold)


class TableWriter:
    """The allocator's device tables and the one way they are written.

    tables: ``req_to_token`` (flat) first, then ``v2p``, ``p2v`` of each book (the
    token sub-pools', then the Mamba sub-pool's; ids from ``v2p_id``/``p2v_id``);
    other tables are written through ``write(patch, tables=...)``."""

    REQ_TO_TOKEN = 0

    def __init__(
        self,
        req_to_token: torch.Tensor,
        books: Sequence[PageBook],
        upload: Uploader,
        backend: KernelBackend,
    ) -> None:
        self.upload = upload
        self._update = backend.update_tables
        self.moves = 0  # page-move writes so far: tables built before one are stale
        # table changes so far (writes, staged writes, grid changes): a block table or
        # write id built at one epoch is still right at the same epoch (``epoch``)
        self.epoch = 0
        self.tables = [req_to_token.view(-1)]
        self.v2p_id: dict[str, int] = {}
        self.p2v_id: dict[str, int] = {}
        self.mirrors: dict[int, np.ndarray] = {}  # table id -> its host mirror (the truth)
        for book in books:
            self.v2p_id[book.name], self.p2v_id[book.name] = len(self.tables), len(self.tables) + 1
            self.tables += [book.v2p, book.p2v]
            self.follow(book)
        self.staged: dict[int, list[np.ndarray]] = {}  # table id -> indices to write
        self._num_staged = 0  # arrays in ``staged``
        self._held = 0  # of them, left by a ``hold`` scope before the open one
        self._depth = 0  # open ``batch`` scopes
        self.writes = 0  # uploads (each with its launch) so far
        self._scopes = (_Scope(self, hold=False), _Scope(self, hold=True))

    def follow(self, book: PageBook) -> None:
        """Point at ``book``'s current tables and host mirrors (after its grid changed)."""
        v, p = self.v2p_id[book.name], self.p2v_id[book.name]
        self.epoch += 1
        self.tables[p] = book.p2v
        self.mirrors[v], self.mirrors[p] = book.v2p_host, book.p2v_host

    def batch(self, hold: bool = False) -> _Scope:
        """A scope (``with writer.batch():``) whose verbs' ``stage``-d writes go out with
        the next ``write``, or in one write when the outermost scope closes (module
        docstring). ``hold``: not even then; they wait for the next ``write`` (a
        preemption's frees go with the step's decode or extend write), so the caller
        makes sure one comes before anything on the device reads those entries (the
        debug-mode ``check_integrity`` settles them first). A scope that stages nothing
        itself leaves held entries waiting too (a decode step that failed for want of
        room). The two scopes are made once: a decode step's verbs enter one each."""
        return self._scopes[hold]

    def enter_batch(self) -> None:
        """A ``batch`` scope opens (its context manager calls this)."""
        if not self._depth:
            self._held = self._num_staged  # what an earlier ``hold`` scope left
        self._depth += 1

    def exit_batch(self, hold: bool) -> None:
        """A ``batch`` scope closes: the outermost one settles what it staged (not ``hold``)."""
        self._depth -= 1
        if not self._depth and not hold and self._num_staged > self._held:
            self.settle()

    def settle(self) -> None:
        """Write the staged entries now (one upload and launch; none staged: nothing)."""
        if self.staged:
            self.write(TablePatch())

    def stage(self, patch: TablePatch) -> None:
        """``write(patch)`` when it is not empty, unless inside ``batch()`` and it
        writes only v2p/p2v entries (their values are the host mirrors'): then its
        indices are marked and written, with the mirrors' values then, by the next
        write."""
        if not patch:
            return
        self.epoch += 1  # (the host mirrors changed already)
        if not self._depth or any(t not in self.mirrors for t, _, _ in patch.segments):
            self.write(patch)
            return
        for table, index, _ in patch.segments:
            self.staged.setdefault(table, []).append(patch.parts[index])
        self._num_staged += len(patch.segments)

    def _merge(self, patch: TablePatch) -> None:
        """Add the staged entries to ``patch``: each index once, those ``patch``
        writes itself left out (its values are the mirrors' too), values read now."""
        staged, self.staged = self.staged, {}
        self._num_staged = self._held = 0
        own: dict[int, list[np.ndarray]] = {}
        for table, index, _ in patch.segments:
            own.setdefault(table, []).append(patch.parts[index])
        for table, arrays in staged.items():
            rows = np.unique(np.concatenate(arrays))
            if table in own:
                rows = rows[~np.isin(rows, np.concatenate(own[table]))]
            if len(rows):
                patch.add(table, rows, self.mirrors[table][rows])

    def write(self, patch: TablePatch, tables: Sequence[torch.Tensor] | None = None) -> Written:
        """Upload ``patch`` (with the staged entries, writing this writer's tables)
        once and apply its writes in one launch (no host sync)."""
        if self.staged and tables is None:
            self._merge(patch)
        self.writes += 1
        self.epoch += 1
        parts, offsets, sizes, max_count = patch.pack()
        packed = self.upload(parts)
        self._update(
            self.tables if tables is None else tables, packed, len(patch.segments), max_count
        )
        return Written(packed, offsets, sizes)

    def bind(self, book: PageBook, vpages: np.ndarray, ppages: np.ndarray) -> torch.Tensor:
        """Device half of ``book.bind_host``; returns ``ppages`` on the device."""
        patch = TablePatch()
        v, p = patch.part(vpages), patch.part(ppages)
        patch.add(self.v2p_id[book.name], v, p)
        patch.add(self.p2v_id[book.name], p, v)
        return self.write(patch)[p]

    def unbind(self, book: PageBook, vpages: np.ndarray, ppages: np.ndarray) -> None:
        """Device half of ``book.unbind_host``: tombstone v2p[vpages] and p2v[ppages]
        (``stage``-d: inside ``batch()`` it goes out with the step's write)."""
        if len(ppages):
            patch = TablePatch()
            patch.add_tombstones(self.v2p_id[book.name], vpages)
            patch.add_tombstones(self.p2v_id[book.name], ppages)
            self.stage(patch)

    def move(self, book: PageBook, vpages: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        """Device half of ``book.apply_moves``: v2p[vpages] = dst, p2v[dst] = vpages,
        p2v[src] = -1 (src and dst are disjoint: dst were holes). Counts in ``moves``."""
        self.moves += 1
        patch = TablePatch()
        v, d = patch.part(vpages), patch.part(dst)
        vid, pid = self.v2p_id[book.name], self.p2v_id[book.name]
        patch.add(vid, v, d)
        patch.add(pid, d, v)
        patch.add_tombstones(pid, src)
        self.write(patch)
