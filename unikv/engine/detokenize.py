"""Incremental detokenization and stop strings.

A request's text grows token by token without decoding all its outputs again:
each update decodes a short window that starts a few tokens before the text
already emitted (``prefix_offset``) and emits what the window adds beyond that
prefix's own text (vLLM's scheme). A window whose text ends in U+FFFD (an
unfinished UTF-8 sequence of a byte-level tokenizer) emits nothing until a later
token completes it; ``flush`` emits the rest when the request ends. The window
starts inside the prompt, so the first output token's leading space (SentencePiece)
is kept, as in the full text.

    ids = prompt tail + outputs:   [ ...prefix... | ...read... | new tokens ]
                                   ^prefix_offset ^read_offset

Stop strings: after each update, the text from ``len(text) - len(new) -
longest stop + 1`` on is searched, so a stop string split over two updates is
found; the text is cut before it (or after it, ``include_stop_str_in_output``).
"""

from __future__ import annotations

PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token


class IncrementalDetokenizer:
    """The text of one request's outputs, updated as tokens arrive.

    Args:
        tokenizer: a transformers tokenizer (``decode(ids, skip_special_tokens=)``).
        prompt_ids: the request's prompt token ids (its tail seeds the window).
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.read_offset = len(self.ids)
        self.prefix_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def update(self, new_ids: list[int]) -> str:
        """Append ``new_ids``; returns the text they add (maybe "" for now)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing visible yet, or an unfinished character
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text of tokens held back (an unfinished character at the end)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        delta = self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop(
    text: str, num_new: int, stops: tuple[str, ...], include: bool
) -> tuple[int, str] | None:
    """(where to cut ``text``, the stop string) when one of ``stops`` ends inside
    its last ``num_new`` characters (the earliest such stop wins), else None. The
    cut keeps the stop string when ``include``."""
    if not stops or not num_new:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, len(text) - num_new - longest + 1)
    best = None
    for stop in stops:
        at = text.find(stop, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return None
    at, stop = best
    return (at + len(stop) if include else at), stop
