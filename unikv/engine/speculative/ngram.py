"""Prompt-lookup (n-gram) proposals, on the host, from a request's token history.

For n from ``n_max`` down to ``n_min``: the last n tokens of the history are looked
for earlier in it (every earlier window compared at once, numpy), and the tokens
that followed the most recent earlier occurrence are the draft (up to k of them).
The first n with a match wins; no match gives no draft.
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
