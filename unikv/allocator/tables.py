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

    def pack(self) -> tuple[list[np.ndarray], list[int], int]:
        """(header and parts for the uploader, offset of each part, max count)."""
        sizes = [len(a) for a in self.parts]
        offsets = list(accumulate(sizes[:-1], initial=HEADER * len(self.segments)))
        header: list[int] = []
        for table, index, value in self.segments:
            header += (table, offsets[index], offsets[value] if value >= 0 else -1, sizes[index])
        max_count = max((sizes[i] for _, i, _ in self.segments), default=0)
        return [np.array(header, np.int32), *self.parts], offsets, max_count


class Written:
    """The uploaded packed array of a patch; ``written[part]`` is part's (n,) int32
    device slice (no copy)."""

    __slots__ = ("offsets", "packed", "sizes")

    def __init__(self, packed: torch.Tensor, offsets: list[int], sizes: list[int]) -> None:
        self.packed, self.offsets, self.sizes = packed, offsets, sizes

    def __getitem__(self, part: Part) -> torch.Tensor:
        start = self.offsets[part]
        return self.packed[start : start + self.sizes[part]]


class TableWriter:
    """The allocator's device tables and the one way they are written.

    tables: ``req_to_token`` (flat) first, then ``v2p``, ``p2v`` of each token
    sub-pool (ids from ``v2p_id``/``p2v_id``); other tables (Mamba) are written
    through ``write(patch, tables=...)``."""

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
        self.tables = [req_to_token.view(-1)]
        self.v2p_id: dict[str, int] = {}
        self.p2v_id: dict[str, int] = {}
        for book in books:
            self.v2p_id[book.name], self.p2v_id[book.name] = len(self.tables), len(self.tables) + 1
            self.tables += [book.v2p, book.p2v]

    def write(self, patch: TablePatch, tables: Sequence[torch.Tensor] | None = None) -> Written:
        """Upload ``patch`` once and apply its writes in one launch (no host sync)."""
        parts, offsets, max_count = patch.pack()
        packed = self.upload(parts)
        self._update(
            self.tables if tables is None else tables, packed, len(patch.segments), max_count
        )
        return Written(packed, offsets, [len(a) for a in patch.parts])

    def bind(self, book: PageBook, vpages: np.ndarray, ppages: np.ndarray) -> torch.Tensor:
        """Device half of ``book.bind_host``; returns ``ppages`` on the device."""
        patch = TablePatch()
        v, p = patch.part(vpages), patch.part(ppages)
        patch.add(0, v, p)
        patch.add(1, p, v)
        return self.write(patch, (book.v2p, book.p2v))[p]

    def unbind(self, book: PageBook, vpages: np.ndarray, ppages: np.ndarray) -> None:
        """Device half of ``book.unbind_host``: tombstone v2p[vpages] and p2v[ppages]."""
        if len(ppages):
            patch = TablePatch()
            patch.add_tombstones(0, vpages)
            patch.add_tombstones(1, ppages)
            self.write(patch, (book.v2p, book.p2v))

    def move(self, book: PageBook, vpages: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        """Device half of ``book.apply_moves``: v2p[vpages] = dst, p2v[dst] = vpages,
        p2v[src] = -1 (src and dst are disjoint: dst were holes). Counts in ``moves``."""
        self.moves += 1
        patch = TablePatch()
        v, d = patch.part(vpages), patch.part(dst)
        patch.add(0, v, d)
        patch.add(1, d, v)
        patch.add_tombstones(1, src)
        self.write(patch, (book.v2p, book.p2v))
