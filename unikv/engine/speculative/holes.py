"""A lazy draft head's holes (``mtp.HiddenDraft`` past the batch-size rule).

Past the rule the head does no work at all: its rows are neither run nor flushed.
The stash (``stash.HiddenStash``) keeps each request's last ``window`` rows' inputs,
so when the request drafts again those rows are written exactly (one extend); a row
older than that has lost its target hidden state and is a hole in the head's K/V.
Outputs stay exact (verification is exact); a hole costs acceptance only.

A hole is never left as whatever bytes the page held (a fresh pool's are
uninitialised, maybe NaN; a reused page's are another request's): its K/V rows are
zeroed (``zero``), in every draft cache of the head, before any step reads them.
Where the pages of a request with a hole stay (prefix caching), the first full page
holding one is remembered (``record``: a chain key of the page's tokens and salt, as
``DraftModel.stale``); a later request whose prefix hit covers it drafts over the
zeroed rows, counted (``hit``), not silently. Both counts are the speculation
counters' (``llm.stats.spec_head_hole_rows``, ``spec_head_hole_hits``).
"""

from __future__ import annotations

import numpy as np
import torch

from unikv.engine.speculative.draft import StalePages, to_device
from unikv.engine.speculative.engine import SpecCounters


class HeadHoles:
    """The zeroing of a head's hole rows and the record of cached pages holding one;
    ``counters``: the speculation counters it adds to (``head_hole_rows``: rows
    zeroed, ``head_hole_hits``: admissions whose prefix hit covers a recorded page)."""

    def __init__(self, caches, view, counters: SpecCounters | None = None) -> None:
        self.caches, self.view = caches, view
        self.counters = SpecCounters() if counters is None else counters
        self.stale = StalePages()
        self.leaving: list[tuple[int, int, int]] = []  # (slot, start, count): ``zero_leaving``

    def zero(self, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        """Zero the head's K/V at ``counts[i]`` rows of request slot ``slots[i]`` from
        position ``starts[i]`` (rows it holds), in every draft cache: one host id
        translation (the allocator's mirror: no device read), one upload and one fill
        per cache tensor."""
        keep = counts > 0
        if not keep.any():
            return
        slots, starts, counts = slots[keep], starts[keep], counts[keep]
        vids = self.view.row_vids(slots, starts, counts)
        ids: dict[str, torch.Tensor] = {}
        for cache in self.caches:
            if cache is None:
                continue
            at = ids.get(cache.subpool)
            if at is None:
                rows = self.view.row_kernel_ids(cache.subpool, vids)
                device = getattr(cache, "store_k", getattr(cache, "latent", None)).device
                at = ids[cache.subpool] = to_device(rows, device)
            for name in ("store_k", "store_v", "latent"):  # MHA's K and V, MLA's latent
                t = getattr(cache, name, None)
                if t is not None:
                    t.index_fill_(0, at, 0)
        self.counters.head_hole_rows += int(counts.sum())

    def zero_leaving(self) -> None:
        """``zero`` the rows queued in ``leaving`` (requests ending in one step, while
        they still hold their pages), in one call."""
        if self.leaving:
            slots, starts, counts = (np.asarray(c, np.int64) for c in zip(*self.leaving))
            self.leaving.clear()
            self.zero(slots, starts, counts)

    def record(self, r, hole: int) -> None:
        """``r`` leaves with its pages kept and a hole from position ``hole`` on: the
        first full page holding it is remembered (a later hit on it is counted)."""
        self.stale.remember(r, hole, self.view.roles.page_size)

    def hit(self, r) -> bool:
        """Whether ``r``, admitted with ``r.num_cached`` tokens of a prefix hit, holds a
        recorded page (counted: ``head_hole_hits``). A key is a prefix of tokens, not a page:
        pages of the same tokens written since by a full prefill count too (an
        over-count, never a miss)."""
        if self.stale.first_hit(r, self.view.roles.page_size) is None:
            return False
        self.counters.head_hole_hits += 1
        return True
