"""A steady verify step's block tables, kept from the last verify step's build.

A block table's row b is a function of request b's slot, its ``seq_len`` (which
columns are live: ``[lo_b, hi_b)``, ``hi_b = ceil(seq_len_b / ps)``, ``lo_b`` the
first column a windowed sub-pool's queries still see) and the allocator's page
mapping (``req_to_token`` and ``v2p``). Between two steady verify steps
(``plan_steady.SteadyVerify``: the same requests, slots and rows) the mapping
changes only where a verb changed it: a row crossing into a page it allocates, a
cut, a free, compaction's moves. Every such verb moves the allocator's
``view.mapping_epoch`` on. So when the epoch is the one the kept tables were
built at, no other plan wrote the planner's table buffers since (``drop``), and
every request's live columns are the kept ones, the tables in the buffers are
already the step's: the planner reuses them (no launch). A request's rows held to
the end of their page (``speculative/headroom.VerifyRows``) keep the live columns
until a row passes that page end, which allocates (a new epoch): the tables are
then built again, once. The write ids are written every step: computed on the
host from the allocator's page mirror and staged in the step's upload (one copy
for every sub-pool), or translated from the rows' ids on the device where those
are not on the host (``plan.StepPlanner._tables``).
"""

from __future__ import annotations

import numpy as np


class KeptTables:
    """What the block tables in the planner's buffers were built for (a verify
    step's), or nothing (``epoch`` None).

    Args:
        page_size: the token sub-pools' page size; windows: per token sub-pool
            (in the planner's order), its sliding window (0: none).
    """

    def __init__(self, page_size: int, windows: list[int]) -> None:
        self.page_size, self.windows = page_size, windows
        self.epoch: int | None = None
        self.key: tuple | None = None
        self.bounds: np.ndarray | None = None
        self.reused = 0  # verify steps whose tables were reused (the tests' spy)

    def live(self, slots: np.ndarray, seq_lens: np.ndarray, reach: int) -> np.ndarray:
        """(1 + 2S, B): the requests' ``slots`` (B,), then each sub-pool's live
        columns ``lo``, ``hi`` per request for host ``seq_lens`` (B,), a windowed
        sub-pool's queries reaching ``reach`` rows further back than its window
        (``plan._tables``' window arithmetic)."""
        ps, seq = self.page_size, seq_lens.astype(np.int64)
        out = np.empty((1 + 2 * len(self.windows), len(seq)), np.int64)
        out[0] = slots
        hi = -(-seq // ps)
        for i, window in enumerate(self.windows):
            out[1 + 2 * i] = np.maximum((seq - window - reach) // ps, 0) if window else 0
            out[2 + 2 * i] = hi
        return out

    def holds(self, epoch: int, key: tuple, bounds: np.ndarray) -> bool:
        """Whether the buffers hold the tables of a step at ``epoch`` with ``key``
        (rows, tokens, real tokens, columns, reach) and ``bounds`` (its requests' slots and live columns:
        ``live``)."""
        if self.epoch is None or epoch != self.epoch or key != self.key:
            return False
        assert self.bounds is not None, "kept tables invariant: bounds kept with the epoch"
        return self.bounds.shape == bounds.shape and bool((self.bounds == bounds).all())

    def keep(self, epoch: int, key: tuple, bounds: np.ndarray) -> None:
        """The buffers now hold a verify step's tables built at ``epoch``."""
        if epoch < 0:  # (an allocator that counts no epoch: never reused)
            self.drop()
            return
        self.epoch, self.key, self.bounds = epoch, key, bounds

    def drop(self) -> None:
        """The buffers were written for another step (nothing kept)."""
        self.epoch = self.key = self.bounds = None
