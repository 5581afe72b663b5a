"""``RequestMaker``: validated ``Request``s and ``RequestGroup``s of one engine,
with their ids (one counter per engine) and their seeds (the engine's ``seed``
seeds requests whose SamplingParams give none)."""

from __future__ import annotations

import random

from unikv.engine.options import derived_seed
from unikv.engine.prompts import PromptMaker
from unikv.engine.request import Request
from unikv.engine.sampling import SamplingParams
from unikv.engine.tracks import RequestGroup


class RequestMaker:
    """Requests for an engine (``build.Engine``): its vocabulary, EOS ids, context
    and tokenizer; ``prompts`` validates and tokenizes what callers give."""

    def __init__(self, engine, prompts: PromptMaker, seed: int) -> None:
        self.engine, self.prompts = engine, prompts
        self._rng = random.Random(seed)
        self._next_id = 0

    @property
    def next_id(self) -> int:
        """The id the next request will get."""
        return self._next_id

    def take_id(self) -> int:
        """A fresh request id (ids are unique within the engine)."""
        request_id, self._next_id = self._next_id, self._next_id + 1
        return request_id

    def request(
        self, ids: list[int], params: SamplingParams, seed: int, cache_salt: str | None = None
    ) -> Request:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= set(self.engine.eos_token_ids)
        request = Request(self.take_id(), ids, params, seed, frozenset(stop),
                          self.engine.max_model_len)  # fmt: skip
        request.cache_salt = cache_salt
        return request

    def make_groups(self, prompts, sampling_params=None, *, sink=None) -> list[RequestGroup]:
        """One RequestGroup per prompt (``generate``'s arguments, all validated
        before any is made); ``sink`` receives their deltas (``EngineLoop``)."""
        items = self.prompts.normalize(prompts, sampling_params)
        return [self.make_group(ids, sp, text=text, sink=sink) for ids, text, sp in items]

    def make_group(
        self,
        ids: list[int],
        params: SamplingParams,
        *,
        text=None,
        sink=None,
        cache_salt=None,
        detokenize: bool = True,
    ) -> RequestGroup:
        """A RequestGroup of ``params.n`` requests sharing the (validated) prompt ids.
        Completion i > 0 of a seeded prompt gets a seed derived from (seed, i).
        ``cache_salt`` (a non-empty str or None, vLLM's): the prefix cache shares
        pages only between requests of the same salt. ``detokenize`` False: the
        group's tracks carry token ids alone (no text, no stop strings: the API
        process of ``unikv serve`` does those)."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty str or None, got {cache_salt!r:.40}")
        vocab = self.engine.model_config.vocab_size
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            bad = [t for t in params.stop_token_ids if t >= vocab]
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[:4]}")
        base = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seeds = [base] + [derived_seed(base, i) for i in range(1, params.n)]
        requests = [self.request(list(ids), params, seed, cache_salt) for seed in seeds]
        tokenizer = self.engine.tokenizer if detokenize else None
        return RequestGroup(requests, text, sink, tokenizer)
