"""The verify rows' pages, held ahead: a request in steady speculative decode keeps
the rows up to the end of the page its last verify step reached (``VerifyRows``).

A verify step of request b feeds rows ``[L_b, L_b + 1 + k_b)``. Allocating them
(``alloc_extend``) mints the pages that range needs, the last maybe part full; the
rest of that last page costs nothing more, so the request holds its rows up to
the page's end (``held_b``). The next verify step allocates only where its rows
pass ``held_b`` (a page boundary crossed). The rows' virtual ids are read from
the host mirror of the requests' pages (``row_vids``: no allocator write, no
device work) and travel in the step's one upload (``HostRows``). After a
step the rejected rows are cut back to the end of the page the kept ones end in
(``trim_after``): the pages freed are the ones cutting to the kept rows frees, so
the pool holds no page more than without this, under pressure too.

``held_b`` is the allocator's length of the request (``alloc.view.allocated_lens``:
nothing is kept here), >= ``num_cached``: rows past ``num_cached`` are a rejected
draft's or unwritten, never read (attention reads ``seq_len`` rows) and rewritten by
the next step's. Before the request's next step that is not a verify step (a plain
decode step, whose allocator verb wants its length at ``num_cached``) the rows are
cut to ``num_cached`` (``trim``, after a verify step: ``pending``); a request that
leaves (finish, preemption) frees every page anyway. Steps planned ahead
(``ahead.py``) allocate past the step in flight themselves: with ``pipeline`` on,
nothing is held ahead.
"""

from __future__ import annotations

import numpy as np
import torch


class HostRows:
    """A verify step's rows' virtual ids, known on the host (``host``: (n,) int64).
    The step planner stages them in the step's one upload and hands the device
    view over (``put``); read before that (``data``: a draft model proposing from
    them), they are uploaded on their own. The device view lies in the step
    buffer, which the next step's upload rewrites: it is the step's only."""

    __slots__ = ("_data", "_view", "host")

    def __init__(self, host: np.ndarray, view) -> None:
        self.host, self._view = host, view
        self._data: torch.Tensor | None = None

    @property
    def on_device(self) -> bool:
        return self._data is not None

    @property
    def data(self) -> torch.Tensor:
        """(n,) int32/int64 virtual ids on the device (uploaded now if not staged)."""
        if self._data is None:
            self._data = self._view.upload_ids(self.host.copy())
        return self._data

    def put(self, data: torch.Tensor) -> None:
        """The ids as the step's upload staged them (a device view)."""
        assert data.shape[0] == self.host.shape[0], "host rows invariant: one id a row"
        self._data = data


class VerifyRows:
    """The verify rows each request holds past ``num_cached`` (the allocator's length
    of it, read through ``alloc.view``): minted a page at a time, cut after a step's
    rejections and before a plain step."""

    def __init__(self, alloc) -> None:
        self.alloc = alloc
        self.view = alloc.view
        self.page_size = self.view.roles.page_size
        self.max_context = self.view.max_context
        self.extends = 0  # allocator extends run for verify rows (the tests' spy)
        self.pending = False  # a verify step allocated since the last ``trim``

    def _page_end(self, rows: np.ndarray) -> np.ndarray:
        ps = self.page_size
        return np.minimum(-(-rows // ps) * ps, self.max_context)

    def allocate(self, slots: np.ndarray, lens: np.ndarray, num_new: np.ndarray):
        """The virtual ids of rows ``[lens_b, lens_b + num_new_b)`` of each request
        ``slots_b`` (a verify step's, request by request: ``HostRows``), pages minted
        only where they pass the rows held; None when the pool cannot hold them
        (nothing changed)."""
        view = self.view
        have = view.allocated_lens(slots)
        need = lens + num_new
        short = need > have
        if short.any():
            target = self._page_end(need)
            grown = self.alloc.alloc_extend(slots[short], have[short], (target - have)[short])
            if grown is None:
                return None
            self.extends += 1
        self.pending = True
        return HostRows(view.row_vids(slots, lens, num_new), view)

    def trim_after(self, slots: np.ndarray, keep: np.ndarray, state_rows=None) -> None:
        """After a verify step: requests ``slots`` kept ``keep`` rows and rejected some;
        their rows are cut to the end of the page the kept ones end in (the pages a
        cut to ``keep`` frees; ``state_rows``: ``alloc.truncate``'s)."""
        lens = np.minimum(self._page_end(keep), self.view.allocated_lens(slots))
        self.alloc.truncate(slots, lens, state_rows=state_rows)

    def trim(self, requests) -> None:
        """Before a step that is not a verify step: the held rows of ``requests`` cut to
        ``num_cached`` (a page freed only where ``num_cached`` is a page end: the
        step's own token then takes a new one, as without held rows)."""
        self.pending = False
        slots = np.fromiter((r.slot for r in requests), np.int64, len(requests))
        cached = np.fromiter((r.num_cached for r in requests), np.int64, len(requests))
        over = self.view.allocated_lens(slots) > cached
        if over.any():
            self.alloc.truncate(slots[over], cached[over])
