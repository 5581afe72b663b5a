"""Per-request output state of the engine loop: what a request's stream has been
sent, its text, logprobs and stop strings.

After every settled step the loop calls ``Track.advance`` for each request of
that step: the request's new token ids (at most one per step) are appended to
its detokenizer, stop strings are searched, and a ``Delta`` is made for its
stream. While a request runs, the last ``longest stop - 1`` characters are held
back (a stop string may still begin there), so the deltas a stream receives
always concatenate to the final text.

A passive track (no stream, no stop strings, no logprobs: a plain ``generate``)
is skipped until the end, when ``completion`` decodes its text in one go.
"""

from __future__ import annotations

from dataclasses import dataclass

from unikv.engine.detokenize import find_stop, make_detokenizer
from unikv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from unikv.engine.request import Request, Status


@dataclass
class Delta:
    """What completion ``index`` of a request group gained in one step.

    logprobs: per new token (token id, logprob, rank, [(id, logprob, text)] of
    the top k, token text), or None; finish_reason: None while running; error: set when the
    engine failed (the stream ends); cached_tokens: on the finishing delta, the prompt
    tokens the request's first admission found in the prefix cache; prompt_logprobs:
    on the first delta of a request that asked (``SamplingParams.prompt_logprobs``),
    None then one entry (as ``logprobs``') per prompt token after the first."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    cached_tokens: int | None = None
    prompt_logprobs: list | None = None  # on a request's first delta, when it asked


class Track:
    """The loop's output state of one request (``Request.track``)."""

    def __init__(self, group: RequestGroup, index: int, request: Request, tokenizer) -> None:
        p = request.params
        self.group, self.index, self.request = group, index, request
        self.tokenizer = tokenizer
        self.detok = (  # the Rust DecodeStream or the decode fallback, chosen here once
            make_detokenizer(tokenizer, request.prompt_ids, p.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.stops = p.stop if tokenizer is not None else ()
        self.include = p.include_stop_str_in_output
        self.hold = 0 if self.include else max(map(len, self.stops), default=1) - 1
        self.passive = (
            group.sink is None
            and not self.stops
            and p.logprobs is None
            and p.prompt_logprobs is None
        )
        self.num_sent = 0  # output tokens processed
        self.text_sent = 0  # characters of the text delivered
        self.text_end: int | None = None  # the cut of a stop string
        self.stop_reason: int | str | None = None
        self.logprobs: list | None = [] if p.logprobs is not None else None
        # prompt position p's entry at [p - 1] (filled as prefill chunks settle)
        self.prompt_logprobs: list | None = [] if p.prompt_logprobs is not None else None
        self.prompt_sent = False
        self.done = False
        # the engine process's id of this completion (``unikv serve``); a token-only
        # track (no text, no logprobs) sends its one-token rows as ids and tokens
        # (``EngineLoop.publish_ids``)
        self.wire: int | None = None
        self.token_only = (
            self.detok is None and self.logprobs is None and self.prompt_logprobs is None
        )
        self.bare = False  # token-only with a wire id: set with ``wire`` (the engine process)

    @property
    def text(self) -> str | None:
        if self.detok is None:
            return None
        return self.detok.text[: self.text_end]

    def _add_prompt(self, span) -> None:
        """Record the prompt positions of one step (a recompute's are known)."""
        first, rows = span
        ids, have = self.request.prompt_ids, len(self.prompt_logprobs)
        for p, row in enumerate(rows, start=first):
            if p == have + 1:
                self.prompt_logprobs.append(self._logprob_entry(ids[p], row))
                have += 1

    def _logprob_entry(self, token: int, row) -> tuple:
        """(token, logprob, rank, [(id, logprob, text)] of the top k, text) of one
        sampled token (texts None without a tokenizer)."""
        chosen, rank, top = row
        tok = self.tokenizer

        def text(i: int) -> str | None:
            return tok.decode([i], skip_special_tokens=False) if tok is not None else None

        return token, chosen, rank, [(i, lp, text(i)) for i, lp in top], text(token)

    def advance(
        self, lane: int, step_logprobs: dict | None, finish, prompt_logprobs=None
    ) -> Delta | None:
        """Process the request's newest tokens (it sat in ``lane`` of the settled
        step); ``finish(request, reason)`` ends it early (a stop string);
        ``prompt_logprobs``: the step's ``Launched.prompt_logprobs``. Returns the
        delta for its stream, or None when there is nothing to send."""
        r = self.request
        if prompt_logprobs and lane in prompt_logprobs and self.prompt_logprobs is not None:
            self._add_prompt(prompt_logprobs[lane])
        new = r.output_ids[self.num_sent :]
        self.num_sent = len(r.output_ids)
        entries = None
        if self.logprobs is not None and new and step_logprobs and lane in step_logprobs:
            entries = [self._logprob_entry(new[-1], step_logprobs[lane])]
            self.logprobs.extend(entries)
        finished = r.status is Status.FINISHED
        rest = new  # the tokens still to detokenize
        if len(new) > 1 and self.stops and self.text_end is None and self.detok is not None:
            new, rest, finished = self._stop_within(new, finish, finished)
        if self.detok is not None and (not self.passive or finished):
            added = self.detok.update(rest) if rest else ""
            if finished:
                added += self.detok.flush()
            if self.stops and self.text_end is None and len(r.output_ids) >= r.params.min_tokens:
                hit = find_stop(self.detok.text, len(added), self.stops, self.include)
                if hit is not None:
                    self.text_end, self.stop_reason = hit
                    finish(r, "stop")
                    finished = True
        if finished:
            self.done = True
            if self.stop_reason is None and r.finish_reason == "stop" and r.output_ids:
                last = r.output_ids[-1]
                self.stop_reason = last if last in r.params.stop_token_ids else None
        return self._delta(new, entries, finished)

    def _stop_within(self, new: list[int], finish, finished: bool):
        """Several new tokens at once (a speculative verify step): a stop string that
        one of them completes ends the outputs at that token, as it would one token
        at a time. Detokenizes all but the last (``advance`` does the rest); returns
        (the new tokens kept, those left to detokenize, finished)."""
        r, min_tokens = self.request, self.request.params.min_tokens
        first = len(r.output_ids) - len(new)  # the index of new[0] in the outputs
        for i, token in enumerate(new[:-1]):
            added = self.detok.update([token])
            if first + i + 1 < min_tokens:
                continue
            hit = find_stop(self.detok.text, len(added), self.stops, self.include)
            if hit is not None:
                self.text_end, self.stop_reason = hit
                del r.output_ids[first + i + 1 :]
                self.num_sent = len(r.output_ids)
                finish(r, "stop")
                return new[: i + 1], [], True
        return new, new[-1:], finished

    def _delta(self, new: list[int], entries, finished: bool) -> Delta | None:
        text = ""
        if self.detok is not None:
            size = len(self.detok.text) if self.text_end is None else self.text_end  # no copy
            end = size if finished else max(self.text_sent, size - self.hold)
            text = self.detok.text[self.text_sent : end]
            self.text_sent = end
        if not (new or text or finished):
            return None
        reason = self.request.finish_reason if finished else None
        stop = self.stop_reason if finished else None
        cached = self.request.num_cached_tokens if finished else None
        prompt = None
        if self.prompt_logprobs is not None and not self.prompt_sent:
            self.prompt_sent = True
            prompt = [None, *self.prompt_logprobs]
        return Delta(
            self.index,
            new,
            text,
            entries,
            reason,
            stop,
            cached_tokens=cached,
            prompt_logprobs=prompt,
        )

    def prompt_logprob_dicts(self) -> list | None:
        """vLLM's ``RequestOutput.prompt_logprobs``: None for the first prompt token,
        then {token id: Logprob} per prompt token; None when not asked."""
        if self.prompt_logprobs is None:
            return None
        return [None, *map(logprob_dict, self.prompt_logprobs)]

    def completion(self) -> CompletionOutput:
        """The final CompletionOutput (a passive track decodes its text now)."""
        r = self.request
        if self.passive and self.detok is not None and self.num_sent < len(r.output_ids):
            self.detok.update(r.output_ids[self.num_sent :])
            self.detok.flush()
            self.num_sent = len(r.output_ids)
        logprobs = None
        if self.logprobs is not None:
            logprobs = list(map(logprob_dict, self.logprobs))
        return CompletionOutput(
            self.index,
            self.text,
            list(r.output_ids),
            r.finish_reason,
            self.stop_reason,
            logprobs,
            r.num_preemptions,
        )


def logprob_dict(entry) -> dict[int, Logprob]:
    """{token id: Logprob} of one entry: the token first, then the top k."""
    tok, lp, rank, top, text = entry
    return {tok: Logprob(lp, rank, text)} | {
        i: Logprob(v, k + 1, s) for k, (i, v, s) in enumerate(top) if i != tok
    }


class RequestGroup:
    """One submitted prompt and its ``n`` requests (completions).

    sink: where the loop delivers each completion's Deltas (see
    ``EngineLoop.publish``), or None; ``done`` is set when every completion ended."""

    def __init__(self, requests: list[Request], prompt: str | None, sink, tokenizer) -> None:
        self.requests, self.prompt, self.sink = requests, prompt, sink
        self.request_id = requests[0].request_id
        self.tracks = [Track(self, i, r, tokenizer) for i, r in enumerate(requests)]
        for r, t in zip(requests, self.tracks):
            r.track = t
        self.num_done = 0
        self.watched = False  # set by the loop: some track is not passive
        self.on_done = None  # called (engine thread) when the last completion ends

    @property
    def done(self) -> bool:
        return self.num_done == len(self.tracks)

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.requests[0].prompt_ids),
            [t.completion() for t in self.tracks],
            self.requests[0].num_cached_tokens,
            self.tracks[0].prompt_logprob_dicts(),
        )
