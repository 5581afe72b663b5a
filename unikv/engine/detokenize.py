"""Incremental detokenization and stop strings.

A request's text grows token by token without decoding all its outputs again:
each update decodes a short window that starts a few tokens before the text
already emitted (``prefix_offset``) and emits what the window adds beyond that
prefix's own text (vLLM's scheme). A window whose text ends in U+FFFD (an
unfinished UTF-8 sequence of a byte-level tokenizer) emits nothing until a later
token completes it; ``flush`` emits the rest when the request ends. The window
starts inside the prompt, so the first output token's leading space (SentencePiece)
is kept, as in the full text.

    ids = window:   [ ...prefix... | ...read... | new tokens ]
                    ^prefix_offset ^read_offset

The text of the outputs is ``decode(tail + outputs)[len(head):]``, ``tail`` the
prompt's last ``PROMPT_CONTEXT`` tokens (up to ``SEED_BACK`` more when its text
would begin inside a character) and ``head`` the text of ``tail`` less any
U+FFFD it ends with: a character the prompt leaves unfinished belongs to the
output that finishes it. For byte-level and Metaspace decoders that is the full
decode, ``decode(prompt + outputs)[len(head of the prompt):]``.

Two implementations, chosen once per request by ``make_detokenizer``:

- ``StreamDetokenizer``, for fast tokenizers whose ``decode`` is the Rust
  tokenizer's: ``tokenizers.decoders.DecodeStream`` keeps the window in Rust
  (one ``step`` per update, a few us). It needs no ``tokenizer_lock``: ``step``
  holds the GIL throughout and only a shared borrow of the Rust tokenizer, which
  concurrent ``encode`` calls share (transformers mutates the Rust tokenizer
  only to change truncation/padding, also under the GIL). The engine still
  takes the lock once per step (``EngineLoop._settle``) for the fallback and
  the logprob texts; uncontended, that costs well under a microsecond a step.
- ``IncrementalDetokenizer``, for every other tokenizer: the same windows, each
  update two ``tokenizer.decode`` calls (13-44 us per token).

Stop strings: after each update, the text from ``len(text) - len(new) -
longest stop + 1`` on is searched, so a stop string split over two updates is
found; the text is cut before it (or after it, ``include_stop_str_in_output``).
"""

from __future__ import annotations

import functools
import weakref

PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token
SEED_BACK = 3  # more, when the window would start inside a character (UTF-8: <= 3 bytes)
_CLEANUP_PROBE = "a . b , c ! d ? e n't f 'm g 's h 've i 're j"  # text transformers' cleanup edits


class IncrementalDetokenizer:
    """The text of one request's outputs, updated as tokens arrive.

    Args:
        tokenizer: a transformers tokenizer (``decode(ids, skip_special_tokens=)``).
        prompt_ids: the request's prompt token ids (its tail seeds the window).
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-PROMPT_CONTEXT - SEED_BACK :])  # the window (token ids)
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self._prefix_len: int | None = None  # chars of the prefix's text, None: not decoded
        self._head = True  # the prefix is the prompt's tail (nothing emitted yet)
        self._seeded = False  # the tail's start is chosen
        self._unfinished = False  # the tail's text ends inside a character
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _seed(self) -> None:
        """Start the window at the prompt's last ``PROMPT_CONTEXT`` tokens, or up to
        ``SEED_BACK`` earlier while its text would begin inside a character (a
        byte-fallback run decodes to U+FFFDs as a whole when it starts mid-way)."""
        n, start = self.read_offset, max(0, self.read_offset - PROMPT_CONTEXT)
        for s in range(start, max(0, start - SEED_BACK) - 1, -1):
            if not self._decode(self.ids[s:n]).startswith("\ufffd"):
                start = s
                break
        del self.ids[:start]
        self.read_offset -= start
        self._seeded = True

    def _prefix(self) -> int:
        """Characters of the window's text that are already emitted (or the prompt's)."""
        if self._prefix_len is None:
            if not self._seeded:
                self._seed()
            text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            if self._head:  # a character the prompt leaves unfinished is the outputs'
                self._unfinished = text.endswith("\ufffd")
                text = text.rstrip("\ufffd")
            self._prefix_len = len(text)
        return self._prefix_len

    def _emitted(self, delta: str) -> str:
        """Record ``delta`` as the text of the window's tokens; the next window
        starts at the old ``read_offset`` (a character boundary: tokens before it
        are dropped), or stays at the prompt's tail when that ends inside a
        character."""
        start = 0 if self._head and self._unfinished else self.read_offset
        del self.ids[:start]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self._prefix_len, self._head = None, False
        self.text += delta
        return delta

    def update(self, new_ids: list[int]) -> str:
        """Append ``new_ids``; returns the text they add (maybe "" for now)."""
        self.ids.extend(new_ids)
        return self._advance()

    def _advance(self) -> str:
        prefix = self._prefix()
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= prefix or full.endswith("\ufffd"):
            return ""  # nothing visible yet, or an unfinished character
        return self._emitted(full[prefix:])

    def flush(self) -> str:
        """The text of tokens held back (an unfinished character at the end)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._prefix()
        delta = self._decode(self.ids[self.prefix_offset :])[prefix:]
        self.read_offset = len(self.ids)
        return self._emitted(delta)


class StreamDetokenizer(IncrementalDetokenizer):
    """``IncrementalDetokenizer`` on the Rust ``tokenizers.decoders.DecodeStream``
    of a fast tokenizer (``tokenizer.backend_tokenizer``): one Rust ``step`` per update.

    The stream is seeded with the prompt's tail (its text discarded), so it emits
    what the outputs add to it. When the tail's text is empty or ends in an
    unfinished character the stream keeps no prefix and its first chunk is the
    whole window's text: the head's characters are cut from it. The window ids
    are kept here too, for ``flush`` and for the fallback: if the stream fails
    (``DecodeStream`` raises when a decoder's text of a window does not start
    with its prefix's), this request continues on the ``tokenizer.decode`` path.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        super().__init__(tokenizer, prompt_ids, skip_special_tokens)
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizer
        self._seed()
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._cut_head = self._stream.step(self._backend, self.ids) is None

    def _decode(self, ids: list[int]) -> str:  # == tokenizer.decode (make_detokenizer's test)
        return self._backend.decode(ids, skip_special_tokens=self.skip)

    def update(self, new_ids: list[int]) -> str:
        """Append ``new_ids``; returns the text they add (maybe "" for now)."""
        self.ids.extend(new_ids)
        try:  # one id as an int: a list costs the binding a failed int conversion first
            step = new_ids[0] if len(new_ids) == 1 else new_ids
            chunk = self._stream.step(self._backend, step)
        except Exception:  # noqa: BLE001  (tokenizers raises bare Exceptions: invalid prefix)
            self.update = functools.partial(IncrementalDetokenizer.update, self)
            return self._advance()
        if chunk is None:
            return ""
        if self._cut_head:
            chunk, self._cut_head = chunk[self._prefix() :], False
        return self._emitted(chunk)


def make_detokenizer(
    tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
) -> IncrementalDetokenizer:
    """The detokenizer of one request: a ``StreamDetokenizer`` when the tokenizer's
    ``decode`` is its Rust tokenizer's and ``DecodeStream`` is usable, else an
    ``IncrementalDetokenizer``. Both give the same text."""
    cls = StreamDetokenizer if decodes_in_rust(tokenizer) else IncrementalDetokenizer
    return cls(tokenizer, prompt_ids, skip_special_tokens)


_RUST_DECODE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decodes_in_rust(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` is exactly its Rust tokenizer's decode (a fast
    transformers tokenizer whose class overrides no decode method and whose
    ``clean_up_tokenization_spaces`` edits nothing) and the installed
    ``tokenizers`` has a ``DecodeStream`` that steps lists of ids. Cached per
    tokenizer."""
    try:
        return _RUST_DECODE[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not hashable / weakly referable: decide without caching
        return _decodes_in_rust(tokenizer)
    _RUST_DECODE[tokenizer] = found = _decodes_in_rust(tokenizer)
    return found


def _decodes_in_rust(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return False
    try:
        from tokenizers.decoders import DecodeStream
        from transformers import PreTrainedTokenizerFast as Fast

        DecodeStream(skip_special_tokens=False).step(backend, [])  # list steps (>= 0.22)
    except (ImportError, TypeError):  # no DecodeStream, an older one, or no transformers
        return False
    cls = type(tokenizer)
    if cls.decode is not Fast.decode or cls._decode is not Fast._decode:
        return False  # a model's tokenizer with its own decoding (Whisper, Marian, ...)
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return True
    ids = backend.encode(_CLEANUP_PROBE, add_special_tokens=False).ids
    return tokenizer.decode(ids) == backend.decode(ids)  # transformers 5 skips it for BPE


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
