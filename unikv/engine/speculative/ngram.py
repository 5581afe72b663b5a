"""Prompt-lookup (n-gram) proposals, on the host, from a request's token history.

For n from ``n_max`` down to ``n_min``: the last n tokens of the history are looked
for earlier in it (every earlier window compared at once, numpy), and the tokens
that followed the most recent earlier occurrence are the draft (up to k of them).
The first n with a match wins; no match gives no draft. ``propose_ngram_ends`` does
the lookups of several prefixes of one history at once.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(history: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to ``k`` draft tokens continuing ``history`` ((N,) int64), or an empty array."""
    size = history.shape[0]
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # windows starting at 0 .. size - n - 1: every one but the suffix itself
        windows = sliding_window_view(history[:-1], n)
        hits = np.flatnonzero((windows == history[size - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return history[start : start + k]
    return history[:0]


def propose_ngram_ends(
    history: np.ndarray, ends: list[int], k: int, n_min: int, n_max: int
) -> list[np.ndarray]:
    """``propose_ngram(history[:e], k, n_min, n_max)`` for each ``e`` in ``ends``, with
    one comparison per n-gram size for all of them (a verify step planned ahead looks
    up the history after each acceptance of the step before: ``ahead.py``)."""
    out: list[np.ndarray | None] = [None] * len(ends)
    longest = max(ends)
    for n in range(min(n_max, longest - 1), n_min - 1, -1):
        todo = [i for i, e in enumerate(ends) if out[i] is None and e - 1 >= n]
        if not todo:
            continue
        windows = sliding_window_view(history[: longest - 1], n)  # starts 0 .. longest - n - 1
        suffixes = np.stack([history[ends[i] - n : ends[i]] for i in todo])  # (m, n)
        equal = (windows[None, :, :] == suffixes[:, None, :]).all(axis=2)  # (m, windows)
        for row, i in enumerate(todo):
            hits = np.flatnonzero(equal[row, : ends[i] - n])  # every earlier window
            if hits.size:
                start = int(hits[-1]) + n
                out[i] = history[start : min(start + k, ends[i])]
    return [history[:0] if o is None else o for o in out]
