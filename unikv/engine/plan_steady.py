"""A steady verify step's host arrays, advanced in place from the last one's.

In steady speculative decoding a verify step feeds the same requests as the last
one, in the same order, from the same request slots, with the same rows per
request (``num_new``; a verify graph's lanes all feed k + 1), each request moved on
by the rows it kept (``delta_b = accepted_b + 1``, 1 .. num_new_b). The packed
arrays of ``plan_upload.StepUpload`` then differ from the last step's only by

    positions[t]  += delta_{owner(t)}        (real rows; padded lanes unchanged)
    seq_lens[b]   += delta_b
    input_ids      = each request's pending token at its first row, its drafts after

while ``logits_indices``, ``q_indptr``, ``slots`` and the padded lanes stay (``lanes``
is read only by one-token steps: a verify step never reads it). ``SteadyVerify``
keeps the last verify step's arrays in a host buffer of its own (the two staging
slots alternate) and advances them with these few vectorised ops; the caller copies
them into the staging slot and uploads them in its one copy. Anything else (another
batch, a request finished, admitted or preempted, a rollback, other draft counts, a
verify step planned ahead whose rows the device moves) is not steady: the full build
runs and is kept for the next step. Steps between two verify steps (a draft model's
chain, a plain decode step) leave the kept arrays as they are: they are a function
of the requests' starts, slots, rows and tokens only, so a successor checked as
above is advanced exactly whatever ran between. The arrays hold no page: a step
crossing a page end is steady here (its pages are the block table's, kept while
the allocator's page mapping holds: ``plan_tables.KeptTables``, and the write
ids', translated every step from the rows' virtual ids, which travel in the
step's upload: ``row_ids``).
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

_NUM_CACHED, _SLOT = attrgetter("num_cached"), attrgetter("slot")


class SteadyVerify:
    """The last verify step's packed host arrays and what they were built for.

    Args:
        nbytes: the largest packed step (``StepUpload``'s staging size).
        views: ``(buffer, rows, num_tokens) -> (typed views, bytes)``, the layout.
    """

    def __init__(self, nbytes: int, views) -> None:
        self.buffer = np.zeros(nbytes, np.uint8)
        self._views = views
        self.key = None  # (rows, pad_q, num_tokens) of the kept arrays, None: none kept
        self.advanced = 0  # verify steps whose arrays were advanced here (the tests' spy)

    def keep(self, batch, rows: int, pad_q: int, staged: np.ndarray, nbytes: int) -> None:
        """Keep a fully built verify step's packed bytes (``staged[:nbytes]``)."""
        reqs, num_new = batch.requests, batch.num_new
        num = len(reqs)
        self.buffer[:nbytes] = staged[:nbytes]
        counts = np.asarray(num_new, np.int64)
        real = int(counts.sum())
        v, self.nbytes = self._views(self.buffer, rows, real + (rows - num) * pad_q)
        self.views, self.real = v, real
        self.key = (rows, pad_q, v["input_ids"].shape[0])
        self.requests, self.num_new, self.counts = list(reqs), list(num_new), counts
        self.starts = np.fromiter(map(_NUM_CACHED, reqs), np.int64, num)
        self.slots = list(map(_SLOT, reqs))
        self.seq_lens = v["seq_lens"][:num]
        width = num_new[0]
        if num_new.count(width) == num:  # every request feeds ``width`` rows: (B, width) views
            self.positions = v["positions"][:real].reshape(num, width)
            self.ids = v["input_ids"][:real].reshape(num, width)
            self.owner = self.first = self.draft_rows = None
            return
        self.positions, self.ids = v["positions"][:real], v["input_ids"][:real]
        self.owner = np.repeat(np.arange(num), counts)  # each real row's request
        self.first = np.cumsum(counts) - counts  # each request's first row (its pending token)
        drafts = np.ones(real, bool)
        drafts[self.first] = False
        self.draft_rows = np.flatnonzero(drafts)

    def advance(self, batch, rows: int, pad_q: int) -> tuple[dict, int] | None:
        """The kept arrays advanced to ``batch`` (typed views of the kept buffer, its
        bytes), or None where ``batch`` is not the steady successor of the kept step
        (nothing changed)."""
        if self.key is None or batch.drafts is None or batch.derive is not None:
            return None
        reqs = batch.requests
        if (rows, pad_q) != self.key[:2] or batch.num_new != self.num_new or reqs != self.requests:
            return None  # (list compares: identity first, element by element in C)
        num = len(reqs)
        starts = np.fromiter(map(_NUM_CACHED, reqs), np.int64, num)
        delta = starts - self.starts
        if not ((delta >= 1) & (delta <= self.counts)).all():
            return None  # a rollback, a preemption's recompute: not the last step's successor
        if list(map(_SLOT, reqs)) != self.slots:
            return None  # (readmitted elsewhere)
        pending = [_pending(r, s) for r, s in zip(reqs, starts.tolist())]
        self.seq_lens += delta
        if self.owner is None:  # (B, width) views
            self.positions += delta[:, None]
            self.ids[:, 0] = pending
            if self.ids.shape[1] > 1:
                self.ids[:, 1:] = batch.drafts
        else:
            self.positions += delta[self.owner]
            self.ids[self.first] = pending
            if self.draft_rows.size:
                self.ids[self.draft_rows] = np.concatenate(batch.drafts)
        self.starts = starts
        self.advanced += 1
        return self.views, self.nbytes


def _pending(r, start: int) -> int:
    """The token at row ``start`` of ``r`` (its pending token: the last it holds)."""
    n = len(r.prompt_ids)
    return r.prompt_ids[start] if start < n else r.output_ids[start - n]
