"""Prompt-lookup (n-gram) proposals, on the host, from a request's token history.

For n from ``n_max`` down to ``n_min``: the last n tokens of the history are looked
for earlier in it (every earlier window compared at once, numpy), and the tokens
that followed the most recent earlier occurrence are the draft (up to k of them).
The first n with a match wins; no match gives no draft. ``propose_ngram_ends`` does
the lookups of several prefixes of one history at once; ``NgramIndex.propose_ends``
gives the same for a kept index followed by a few more tokens (a verify step
planned ahead: the drafts of the step in flight), without a scan of the history.
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


class NgramIndex:
    """One request's prompt lookup, kept across steps: per n-gram size, the latest end
    of every n-gram of its history (``last``) and the (n - 1)-token heads of them all
    (``heads``), keyed by the n-gram's int64 bytes (not GC-tracked: a long prompt's
    index is built from numpy windows at C speed). Appending token p looks its
    n-grams up before recording them, so the most recent earlier occurrence of the
    current suffix (``match``) costs one dict read per size, not a scan of the
    history: ``propose(room)`` equals ``propose_ngram(tokens, room, n_min, n_max)``.
    ``may_match_next`` says, before the next token is known, whether its lookup can
    find anything (some earlier n-gram starts with the last n - 1 tokens)."""

    BULK = 32  # more new tokens than this at once: the dicts built from numpy windows

    def __init__(self, n_min: int, n_max: int) -> None:
        self.sizes = range(n_max, n_min - 1, -1)  # longest first: the first match wins
        self.tokens: list[int] = []
        self.last: dict[int, dict[bytes, int]] = {n: {} for n in self.sizes}
        self.heads: dict[int, set[bytes]] = {n: set() for n in self.sizes}
        self.match: dict[int, int | None] = {n: None for n in self.sizes}

    def extend(self, new: list[int]) -> None:
        """Append ``new`` tokens (all known) to the history."""
        if len(new) > self.BULK:
            self._bulk(new[:-1])
            new = new[-1:]
        tokens = self.tokens
        for token in new:
            tokens.append(token)
            p = len(tokens)
            tail = np.asarray(tokens[-self.sizes[0] :], np.int64).tobytes()
            for n in self.sizes:
                if n > p:
                    self.match[n] = None
                    continue
                gram = tail[len(tail) - 8 * n :]
                self.match[n] = self.last[n].get(gram)
                self.last[n][gram] = p - 1
                self.heads[n].add(gram[:-8])

    def _bulk(self, new: list[int]) -> None:
        """Record ``new``'s n-grams at once (no match kept: a later token's is)."""
        start = len(self.tokens)
        self.tokens.extend(new)
        arr = np.asarray(self.tokens, np.int64)
        for n in self.sizes:
            first = max(start - n + 1, 0)  # grams ending in ``new``
            if arr.shape[0] - first < n:
                continue
            windows = np.ascontiguousarray(sliding_window_view(arr[first:], n))
            grams = windows.view(f"V{8 * n}").ravel().tolist()  # bytes, one per gram
            self.last[n].update(zip(grams, range(first + n - 1, arr.shape[0])))
            heads = np.ascontiguousarray(windows[:, :-1]).view(f"V{8 * (n - 1)}") if n > 1 else None
            self.heads[n].update(heads.ravel().tolist() if heads is not None else [b""])

    def propose(self, room: int) -> list[int]:
        """Up to ``room`` tokens that followed the latest earlier occurrence of the
        longest suffix found (empty: none)."""
        for n in self.sizes:
            end = self.match[n]
            if end is not None:
                return self.tokens[end + 1 : end + 1 + room]
        return []

    def propose_ends(self, extra: list[int], k: int) -> list[list[int]]:
        """For a = 0 .. len(extra): the lookup of the history followed by ``extra[:a]``
        (up to ``k`` tokens, none past that history's end), as
        ``propose_ngram_ends(tokens + extra, ends, k, n_min, n_max)`` gives it, without
        a scan of the history: an earlier occurrence ending inside ``extra`` is found
        by comparing the few grams there, else the index's latest end (``match`` at
        a = 0, where the suffix itself is the last gram recorded)."""
        tokens, base = self.tokens, len(self.tokens)
        tail = tokens[max(base - self.sizes[0], 0) :] + list(extra)  # every gram the scan reads
        off = base - (len(tail) - len(extra))  # tokens[off + i] == tail[i]
        out = []
        for a in range(len(extra) + 1):
            end = base + a  # the looked-up history is (tokens + extra)[:end]
            hit = None
            for n in self.sizes:
                if n > end - 1:
                    continue
                gram = tail[end - n - off : end - off]
                # an earlier gram ending in extra's part (at t >= base), the newest first
                hit = next(
                    (t for t in range(end - 2, max(base, n - 1) - 1, -1)
                     if tail[t - n + 1 - off : t + 1 - off] == gram),
                    None,
                )  # fmt: skip
                if hit is None:  # else the newest one of the history's (the index)
                    key = np.asarray(gram, np.int64).tobytes()
                    hit = self.match[n] if a == 0 else self.last[n].get(key)
                if hit is not None:
                    break
            if hit is None:
                out.append([])
                continue
            stop = min(hit + 1 + k, end)
            out.append(
                (tokens[hit + 1 : min(stop, base)] if hit + 1 < base else [])
                + list(extra[max(hit + 1 - base, 0) : max(stop - base, 0)])
            )
        return out

    def found(self) -> bool:
        """Whether the lookup of the history as it is finds a draft."""
        return any(end is not None for end in self.match.values())

    def may_match_next(self) -> bool:
        """Whether the lookup after one more (unknown) token can find a draft."""
        tokens = self.tokens
        if not tokens:
            return False
        tail = np.asarray(tokens[-self.sizes[0] :], np.int64).tobytes()
        return any(
            tail[len(tail) - 8 * (n - 1) :] in self.heads[n]
            for n in self.sizes
            if n - 1 <= len(tokens)
        )
