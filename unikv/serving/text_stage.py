"""The API process's half of a completion's output (process mode): its text.

The engine process sends token ids, logprob rows without texts and finish
reasons (``engine_core``). ``TextStage`` turns each such raw delta into the
``Delta`` the in-process engine's ``Track`` would have made: the tokens are
detokenized incrementally, logprob entries get their token texts, stop strings
are searched (from ``min_tokens`` on) and the last ``longest stop - 1``
characters are held back while the completion runs, so the streamed text
concatenates to the final one. A stop string ends the completion here
(``finish_reason`` "stop", its text cut) and ``hit_stop`` tells the caller to
abort it in the engine; later raw deltas of it are dropped.
"""

from __future__ import annotations

from unikv.engine.detokenize import find_stop, make_detokenizer
from unikv.engine.tracks import Delta


class TextStage:
    """One completion's text. ``tokenizer`` None: token ids only (no text)."""

    def __init__(self, index: int, prompt_ids: list[int], params, tokenizer, lock) -> None:
        self.index, self.tokenizer, self.lock = index, tokenizer, lock
        self.detok = (
            make_detokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.stops = tuple(params.stop or ()) if tokenizer is not None else ()
        self.include = params.include_stop_str_in_output
        self.hold = 0 if self.include else max(map(len, self.stops), default=1) - 1
        self.min_tokens = params.min_tokens
        self.num_out = 0
        self.text_sent = 0
        self.text_end: int | None = None
        self.done = False
        self.hit_stop = False  # ended here by a stop string: abort it in the engine
        self.plain = self.detok is not None and not self.stops  # ``advance``'s fast path

    def _text(self, i: int) -> str | None:
        tok = self.tokenizer
        return tok.decode([i], skip_special_tokens=False) if tok is not None else None

    def _entry(self, row) -> tuple:
        tok, chosen, rank, top, _ = row
        return tok, chosen, rank, [(i, lp, self._text(i)) for i, lp, _ in top], self._text(tok)

    def token(self, token: int) -> Delta:
        """``advance``'s common row, one token of a running ``plain`` completion
        (no stop strings, no logprobs, not ended here), in one call: the
        ``Delta`` that ``advance(([token], None, None, None, None, None, None))``
        gives."""
        self.num_out += 1
        with self.lock:
            self.detok.update([token])
        text = self.detok.text[self.text_sent :]
        self.text_sent += len(text)
        return Delta(self.index, [token], text)

    def advance(self, raw) -> Delta | None:
        """The Delta of one raw engine row ``(token_ids, logprobs, finish_reason,
        stop_reason, error, cached_tokens, prompt_logprobs)``; None when there is
        nothing to send (or the completion already ended here)."""
        new, logprobs, reason, stop, error, cached, prompt = raw
        if self.done:
            return None
        if self.plain and reason is None and logprobs is None and prompt is None and new:
            # the common row (tokens of a running completion, no stop strings, no
            # logprobs): what the general path below gives it, without its checks
            self.num_out += len(new)
            with self.lock:
                self.detok.update(new)
            text = self.detok.text[self.text_sent :]
            self.text_sent += len(text)
            return Delta(self.index, new, text, error=error)
        first = self.num_out  # the index of new[0] in the outputs
        self.num_out += len(new)
        with self.lock:
            entries = None if logprobs is None else [self._entry(r) for r in logprobs]
            if prompt is not None:
                prompt = [None] + [self._entry(r) for r in prompt[1:]]
            finished = reason is not None
            rest = new  # the tokens still to detokenize
            if len(new) > 1 and self.stops and self.text_end is None and self.detok is not None:
                new, rest, hit = self._stop_within(new, first)
                if hit is not None:
                    self.text_end, stop = hit
                    reason, finished, error = "stop", True, None
            if self.detok is not None and (rest or finished):
                added = self.detok.update(rest) if rest else ""
                if finished:
                    added += self.detok.flush()
                if self.stops and self.text_end is None and self.num_out >= self.min_tokens:
                    hit = find_stop(self.detok.text, len(added), self.stops, self.include)
                    if hit is not None:
                        self.text_end, stop = hit
                        reason, finished, error = "stop", True, None
            self.hit_stop = self.text_end is not None and not self.done
        text = ""
        if self.detok is not None:
            size = len(self.detok.text) if self.text_end is None else self.text_end
            end = size if finished else max(self.text_sent, size - self.hold)
            text = self.detok.text[self.text_sent : end]
            self.text_sent = end
        if finished:
            self.done = True
        if not (new or text or finished or prompt is not None):
            return None
        return Delta(
            self.index,
            list(new),
            text,
            entries,
            reason,
            stop if finished else None,
            error=error,
            cached_tokens=cached if finished else None,
            prompt_logprobs=prompt,
        )

    def _stop_within(self, new: list[int], first: int):
        """Several tokens at once (a speculative verify step): a stop string one of
        them completes ends the outputs at that token, as one token at a time
        (``Track._stop_within``). Detokenizes all but the last; returns (the tokens
        kept, those left to detokenize, the hit or None)."""
        for i, token in enumerate(new[:-1]):
            added = self.detok.update([token])
            if first + i + 1 < self.min_tokens:
                continue
            hit = find_stop(self.detok.text, len(added), self.stops, self.include)
            if hit is not None:
                self.num_out = first + i + 1
                return new[: i + 1], [], hit
        return new, new[-1:], None

    def failed(self, message: str) -> Delta | None:
        """The engine died: this completion's last delta (None if it had ended)."""
        if self.done:
            return None
        self.done = True
        return Delta(self.index, [], "", None, "abort", error=message)
