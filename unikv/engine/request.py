"""One generation request and its host-side state; a step's batch of requests.

    all_ids = prompt_ids + output_ids
              |<----- num_cached ----->|<-- not yet in the cache -->|

A running request's next step feeds ``all_ids[num_cached : num_cached + n]``;
when that reaches the end of ``all_ids`` the step samples one new token. A
fresh prefill, a chunk of it, a decode and the recompute after preemption are
all this one rule. Lengths live on the host (the scheduler never reads the
device to plan a step).

Placeholder tokens (``Pending``): with one step in flight, the next is planned
before its samples reach the host, so an output not yet known is the placeholder
``-(1 + lane)``, "lane ``lane`` of the step in flight":

    step N launched -> Scheduler.complete_ahead: output_ids += [Pending.of(lane)]
    step N+1 planned -> StepPlanner.plan: input_ids[i] = tokens_N[lane] on the device
                        (Pending.fill; sampling's penalties read them the same way)
    step N settled   -> Scheduler.resolve -> Request.resolve: the value replaces it

Only the step in flight leaves placeholders, each the last output of its request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from unikv.engine.sampling import SamplingParams
from unikv.ids import VirtualTokenIds

if TYPE_CHECKING:
    from unikv.allocator import DecodeStep
    from unikv.engine.plan import StepTables


class Pending:
    """The placeholder protocol: ``-(1 + lane)`` stands for the sample of lane
    ``lane`` of the step in flight (see the module docstring)."""

    @staticmethod
    def of(lane: int) -> int:
        """The placeholder of lane ``lane``'s sample."""
        return -(1 + lane)

    @staticmethod
    def lane(token: int) -> int | None:
        """The lane a placeholder stands for, None for a known token."""
        return -token - 1 if token < 0 else None

    @staticmethod
    def fill(ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """``ids`` (T,) int64 on the device with every placeholder replaced, in
        place, by its lane of ``prev_tokens`` (B_prev,) int64. No host sync."""
        lanes = (-ids - 1).clamp_(min=0)  # known tokens read lane 0, then are kept
        return torch.where(ids < 0, prev_tokens[lanes], ids, out=ids)


class Status(enum.Enum):
    WAITING = "waiting"  # no slot, nothing cached (new, or preempted)
    RUNNING = "running"  # holds a slot and pages
    FINISHED = "finished"


@dataclass
class Request:
    """A request's tokens, sampling parameters and progress.

    ``slot`` is the allocator's request slot (a row of ``req_to_token``) while
    running, else None. ``stop_ids`` = the params' stop tokens plus EOS ids.
    ``track``: the engine loop's output state of the request (streaming,
    detokenization, stop strings), or None.
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    max_len: int  # the engine's max context: generation stops there
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    num_cached: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    finish_reason: str | None = None
    track: Any = None
    cache_salt: str | None = None  # prefix-cache salt: requests of other salts share no page
    grammar: Any = None  # structured outputs: [xgrammar matcher, output tokens it accepted]
    draft_ids: list[int] = field(default_factory=list)  # speculative drafts a verify step feeds
    # a lazy draft's first row left unwritten (past the batch-size rule), or None
    draft_lag: int | None = None

    @property
    def max_new_tokens(self) -> int:
        """Output tokens at most: ``max_tokens``, capped by the context's end."""
        room = self.max_len - len(self.prompt_ids)
        limit = self.params.max_tokens
        return room if limit is None else min(limit, room)

    @property
    def plain_greedy(self) -> bool:
        """The next sample is a bare argmax (greedy; no penalty, logprobs, prompt
        logprobs or min-tokens mask applies any more)."""
        p = self.params
        return p.plain_greedy or (
            p.temperature == 0
            and not p.has_penalties
            and p.logprobs is None
            and len(self.output_ids) >= p.min_tokens
            and (p.prompt_logprobs is None or self.num_cached >= len(self.prompt_ids))
            and p.structured is None
        )

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (>= 1 while running)."""
        return self.seq_len - self.num_cached

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids; past the end, the draft
        tokens a verify step feeds after them (``draft_ids``)."""
        if stop > self.seq_len and self.draft_ids:
            end = self.seq_len
            return self.token_slice(start, end) + self.draft_ids[max(start - end, 0) : stop - end]
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        if start >= n:
            return self.output_ids[start - n : stop - n]
        return self.prompt_ids[start:] + self.output_ids[: stop - n]

    def append(self, token: int) -> None:
        """Record a sampled token and finish the request if a stop rule fires. A
        negative token is a ``Pending`` placeholder for one still on the device:
        only the length rules apply until ``resolve`` writes its value."""
        self.output_ids.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"

    def resolve(self, index: int, token: int) -> bool:
        """Write the value of placeholder ``output_ids[index]``; True when it is a
        stop token of a request that had not finished yet (then the outputs end
        there)."""
        assert self.output_ids[index] < 0, "placeholder invariant: resolve writes a placeholder"
        self.output_ids[index] = token
        if token not in self.stop_ids:
            return False
        stopped_now = self.finish_reason is None
        self.finish_reason = "stop"
        del self.output_ids[index + 1 :]
        return stopped_now


class BatchKind(enum.Enum):
    """Who built a batch's block tables and write ids."""

    DECODE = "decode"  # decode_step, for every request (into the scheduler's ``tables``)
    EXTEND = "extend"  # nobody yet: the step planner translates (prefill chunks joined)


@dataclass
class Batch:
    """A scheduled step: ``requests[i]`` feeds ``num_new[i]`` tokens whose
    virtual ids are ``virtual_ids`` (all requests, batch order). ``kind``: see
    ``BatchKind``; a DECODE batch's out-of-window pages are already freed and
    ``tables`` are the buffers decode_step wrote (the step planner's; None when
    the scheduler has none, then decode_step made its own)."""

    requests: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    pieces: list[torch.Tensor] = field(default_factory=list)
    kind: BatchKind = BatchKind.EXTEND
    tables: StepTables | None = None
    all_greedy: bool | None = None  # every sample a bare argmax (None: not known)
    lazy: bool = False  # a DECODE batch whose draft is lazy (past the rule: ``_tables_for``)
    epoch: int = -1  # the scheduler's finish count when it was built
    step: DecodeStep | None = None  # decode_step's result (its tables may need a refresh)
    decodes: Any = None  # a DECODE batch's ``DecodeSet`` (kept while it stays valid)
    drafts: list | None = None  # a verify step: per request its (k_i,) int64 draft tokens
    # a draft model's / head's drafts on the device, (sum k_i,) int64 request-major;
    # ``drafts`` then holds placeholders -(1 + i) of their indices (never read back)
    draft_tokens: torch.Tensor | None = None
    # a verify step planned ahead: its inputs derived on the device from the step
    # before's acceptance (``speculative.derive.Derivation``)
    derive: Any = None
    # a verify step's rows' virtual ids known on the host (``headroom.HostRows``): the
    # batch's only ids, uploaded with the step's arrays (or on their own where read first)
    host_rows: Any = None

    @property
    def is_decode(self) -> bool:
        """One new token per request: the decode kernels (and CUDA graphs) apply."""
        return self.num_new.count(1) == len(self.num_new)

    @property
    def virtual_ids(self) -> VirtualTokenIds:
        if self.host_rows is not None:
            return VirtualTokenIds(self.host_rows.data)
        return VirtualTokenIds(torch.cat(self.pieces) if len(self.pieces) > 1 else self.pieces[0])

    def add(self, request: Request, n: int, ids: VirtualTokenIds) -> None:
        self.add_many([request], [n], ids)

    def add_many(self, requests: list[Request], num_new: list[int], ids: Any) -> None:
        """Requests whose new tokens' virtual ids are ``ids`` (sum(num_new),), in order
        (``headroom.HostRows``: a verify step's, the batch's only ids)."""
        if not isinstance(ids, VirtualTokenIds):  # host rows: not uploaded yet
            assert not self.requests and self.host_rows is None, (
                "batch invariant: host rows are the only ids of their batch"
            )
            self.host_rows = ids
        else:
            assert self.host_rows is None, "batch invariant: host rows are the batch's only ids"
            self.pieces.append(ids.data)
        self.requests.extend(requests)
        self.num_new.extend(num_new)


class DecodeSet:
    """The running requests split into (decoding, prefilling), in admission order,
    with the decoding ones' slots and lengths (B,) int64 host arrays for
    ``decode_step``. ``running``: the running list it was built from (a copy)."""

    def __init__(self, running: list[Request], decoding: list[Request], prefilling) -> None:
        self.running, self.decoding, self.prefilling = running, decoding, prefilling
        self.slots = np.fromiter((r.slot for r in decoding), np.int64, len(decoding))
        self.lens = np.fromiter((r.num_cached for r in decoding), np.int64, len(decoding))
        self.ones = [1] * len(decoding)
        self.advanced = False  # a DECODE step advanced every decoding request by one
        self._greedy = False

    @classmethod
    def of(cls, running: list[Request]) -> DecodeSet:
        decoding, prefilling = [], []
        for r in running:  # running requests: decoding iff one token is pending
            if r.num_cached + 1 == len(r.prompt_ids) + len(r.output_ids):
                decoding.append(r)
            else:
                prefilling.append(r)
        return cls(list(running), decoding, prefilling)

    def advance(self, num_requests: int) -> None:
        """``complete`` of the DECODE step built from this set: one token each."""
        if num_requests == len(self.decoding):
            self.lens += 1
            self.advanced = True

    def greedy(self) -> bool:
        """Every decoding request samples by argmax (once true, it stays true:
        ``Request.plain_greedy`` only turns on as outputs grow)."""
        if not self._greedy:
            self._greedy = all(r.plain_greedy for r in self.decoding)
        return self._greedy
