"""``method: "draft_model"``: a small model's K/V as more sub-pools of the same pool.

The draft's sub-pools (``draft_`` + its own names; full attention only) join the
target's in the one UnifiedPool, placed on the band direction the target leaves
free (``draft_subpool_configs``): they bind the owner's virtual pages like any
other token sub-pool, so every allocation, rollback (``truncate``), preemption,
swap and prefix-cache page covers the draft's rows too, and the step planner
builds their tables in every plan.

Invariant: the draft holds K/V for every token the target has cached
(``num_cached``). The runner keeps it: after each target forward the draft runs
over the same plan (``forward_plan``; a verify step's rows included, so the kept
rows after a rollback are the true tokens'). Proposing (``propose``) then feeds
each request's pending token and its drafts one position at a time (positions
``L .. L + c - 1``, inside the rows the verify step allocated), argmax on the
device, the next step's token read from the previous step's lane (``Pending``).
The drafts stay on the device (``request_major``): the verify step's rows read
them as placeholders through the step planner and its acceptance compares them
there, so proposing reads nothing back (the verify step's readback is the step's
one host sync).

Past the batch-size rule the draft is lazy (``lazy``): a plain decode step then
runs no draft forward at all, and only marks each request's first unwritten row
(``Request.draft_lag``, ``defer``; once per decoding set, so the rule's steady steps
touch no request). The invariant is restored by one extend over the missed rows
(``catch_up``, their tokens all on the host by then) before the request's next
proposal, and only then: a request that leaves lagging (finish, preemption) runs
nothing. Where its pages stay (prefix caching, swap) the first full page holding an
unwritten row is remembered as stale (``stale``, a chain key of the page's tokens
and salt); a request that later opens with a hit on it lags from that page
(``opened``), so it catches up before its own first proposal, if it ever makes one.
A swapped request keeps its lag. A stale draft row could only cost acceptance,
never tokens (verification decides). A prefill chunk from at or before the lag
rewrites the rows itself.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from unikv.engine.attention import DecodeAttention, ExtendAttention
from unikv.engine.request import Batch, BatchKind, Pending
from unikv.engine.runner import DRAFT_PREFIX as PREFIX
from unikv.placement import Grow, default_grow

STALE_KEYS = 1 << 16  # stale cached pages a lazy draft model remembers (``DraftModel.stale``)


def draft_subpool_configs(draft_dir: str, target_configs, page_size: int, dtype) -> list:
    """The draft checkpoint's sub-pool configs renamed ``draft_*``, on the band
    direction the target's sub-pools leave free; ValueError when the draft keeps
    anything but full attention or no direction is free."""
    from unikv.hf_config import specs_from_hf_config

    configs = specs_from_hf_config(draft_dir, page_size=page_size, dtype=dtype)
    kinds = sorted({c.spec.kind for c in configs})
    if kinds != ["full"]:
        raise ValueError(
            f"speculative_config: a draft model must be full attention only (one sub-pool); "
            f"{draft_dir} keeps {kinds}"
        )
    grow = free_grow(target_configs)
    return [replace(c, name=PREFIX + c.name, grow=grow) for c in configs]


def free_grow(target_configs) -> Grow:
    """The band direction the target's sub-pools leave free for a draft's (one
    sub-pool); ValueError when none is."""
    used = set(default_grow(target_configs))
    free = [g for g in (Grow.UP, Grow.DOWN) if g not in used]
    free += [Grow.FLOAT] if not free and Grow.FLOAT not in used else []
    if not free or len(target_configs) > 2:
        raise ValueError(
            "speculative_config: the pool holds at most three sub-pools; the target has "
            f"{[c.name for c in target_configs]}, no room for a draft's"
        )
    return free[0]


def packed(spans: list, budget: int, max_seqs: int) -> list[list]:
    """``spans`` (each ending in its token count) in order, cut into extends of at most
    ``budget`` tokens and ``max_seqs`` rows each."""
    runs, batch = [], []
    for span in spans:
        if batch and (len(batch) == max_seqs or sum(b[-1] for b in batch) + span[-1] > budget):
            runs, batch = [*runs, batch], []
        batch.append(span)
    return [*runs, batch] if batch else runs


class DraftModel:
    """The draft model over its sub-pools, run through the target's step planner.

    Args:
        model: the loaded draft (a ``DecoderLM``); caches: its ``LayerCache`` list
            (``runner.layer_caches`` over the draft sub-pools); planner: the target
            runner's ``StepPlanner``; backend: the kernel ops; sm_scale: the draft's.
    """

    def __init__(self, model, caches, planner, backend, sm_scale) -> None:
        self.model, self.caches, self.planner = model, caches, planner
        self.backend, self.sm_scale = backend, sm_scale
        self.states = [None] * len(caches)
        self.rule = None  # ``Speculator.within_rule`` (build.py): None, never lazy
        self.lazy_ok = True  # build.py: False where the prefix cache shares decode pages
        self.marked = None  # the decoding set whose lags are marked (``defer``)
        # cached pages whose draft rows a lagging request left unwritten (``release``);
        # a hit on one lags from there (``opened``)
        self.stale = StalePages()

    def lazy(self, batch_size: int) -> bool:
        """Whether a plain decode step of ``batch_size`` requests leaves the draft's
        rows unwritten (past the batch-size rule; ``catch_up`` writes them later)."""
        return self.lazy_ok and self.rule is not None and not self.rule(batch_size)

    def defer(self, plan, batch, tokens=None) -> None:
        """A plain decode step past the rule: no forward; each request's first row
        the draft lacks is remembered (``Request.draft_lag``), once per decoding set
        (``Batch.decodes``: the scheduler keeps it while every request decodes, so
        the rule's steady steps touch no request here)."""
        mark_lags(self, batch)

    def prepare(self, batch) -> bool:
        """Before a step that runs the draft: nothing (a lagging request's rows are
        caught up before its next proposal or as its pages are shared)."""
        return False

    def release(self, r, write: bool, preempted: bool = False) -> None:
        """``r`` leaves (finishes or is ``preempted``; ``write``: its pages are shared or
        kept). Nothing runs: where its pages stay, the first page holding a row it
        left out is remembered as stale (``stale``: a later hit lags from there,
        ``opened``), and ``draft_lag`` stays for a swap (the rows come back as they
        left); else the lag is forgotten."""
        if write and r.draft_lag is not None:
            self.stale.remember(r, r.draft_lag, self.planner.alloc.view.roles.page_size)
        if not write:
            r.draft_lag = None

    def opened(self, r) -> None:
        """``r`` was admitted with ``r.num_cached`` tokens of a prefix hit: it lags from
        the first hit page a lagging request shared unwritten (``release``), else from
        nowhere (a recompute's old lag is void: its rows are the hit's or prefilled)."""
        ps = self.planner.alloc.view.roles.page_size
        page = self.stale.first_hit(r, ps)
        r.draft_lag = None if page is None else page * ps

    @torch.inference_mode()
    def forward_plan(self, plan, batch=None, tokens=None) -> None:
        """Write the draft's K/V of every row of a target plan (its logits unused)."""
        kind = DecodeAttention if plan.is_decode else ExtendAttention
        attn = kind(self.caches, plan, self.backend, self.sm_scale, self.states)
        rows = None if plan.is_decode else plan.logits_indices
        self.model(plan.input_ids, plan.positions, attn, rows)
        if batch is not None and batch.kind is BatchKind.EXTEND:  # a chunk from the lag on
            for r in batch.requests:  # rewrote every missed row: nothing left to catch up
                if r.draft_lag is not None and r.num_cached <= r.draft_lag:
                    r.draft_lag = None

    @torch.inference_mode()
    def catch_up(self, requests) -> int:
        """Write the rows the lazy steps left out, ``[draft_lag, num_cached)`` of each
        of ``requests`` that lags, in extends of at most the planner's token budget
        (a long gap in pieces, each in a later extend than the one before it).
        Returns the extends run."""
        spans, budget = [], self.planner.max_tokens
        self.marked = None  # (lags cleared: the next lazy step marks again)
        for r in requests:
            lag, end = r.draft_lag, r.num_cached
            if lag is None:
                continue
            r.draft_lag = None
            self.stale.forget(r, lag, end, self.planner.alloc.view.roles.page_size)
            ids = r.token_slice(0, end)
            assert min(ids[lag:end], default=0) >= 0, (
                "lazy draft invariant: the tokens it catches up on are on the host"
            )
            spans += [
                (_Span(r.slot, s, ids), min(end - s, budget)) for s in range(lag, end, budget)
            ]
        runs = packed(spans, budget, self.planner.max_seqs)
        for batch in runs:
            self._extend(batch)
        return len(runs)

    def _extend(self, spans) -> None:
        rows, counts = [s for s, _ in spans], [n for _, n in spans]
        view = self.planner.alloc.view
        vids = view.token_vids([s.slot for s in rows], [s.num_cached for s in rows], counts)
        self.forward_plan(self.planner.plan(Batch(rows, counts, [vids])))

    def forward_verify(self, plan, batch, tokens, accepted, rows=None) -> None:
        """After a verify step: its rows' K/V (the kept rows are the true tokens')."""
        self.forward_plan(plan)

    def settled(self, batch, accepted) -> None:
        """A verify step's accepted counts on the host (nothing to keep here)."""

    @torch.inference_mode()
    def propose(self, requests, counts: np.ndarray, virtual_ids: torch.Tensor) -> torch.Tensor:
        """``counts[b]`` greedy draft tokens for each decoding request b (its pending
        token at position L_b = num_cached), on the device ((sum(counts),) int64,
        request-major: ``request_major``; no host read); ``virtual_ids``: the verify
        step's (sum(1 + counts),) ids, request b's ``1 + counts[b]`` in order."""
        self.catch_up(requests)  # the rows the rule's plain steps left out, if any
        starts = np.zeros(len(requests), np.int64)
        np.cumsum(1 + counts[:-1], out=starts[1:])
        steps, lanes_of, prev, prev_lane = [], [], None, {}
        for j in range(int(counts.max())):
            live = np.flatnonzero(counts > j)
            rows = []
            for b in live.tolist():  # the host rows of this step (lanes of the previous)
                r = requests[b]
                token = r.output_ids[-1] if j == 0 else Pending.of(prev_lane[b])
                rows.append(_row(r.slot, r.num_cached + j, token))
            index = to_device(starts[live] + j, virtual_ids.device)
            batch = Batch(rows, [1] * len(rows), [virtual_ids.index_select(0, index)])
            plan = self.planner.plan(batch, prev)
            attn = DecodeAttention(self.caches, plan, self.backend, self.sm_scale, self.states)
            prev = self.backend.argmax(self.model(plan.input_ids, plan.positions, attn, None))
            steps.append(prev)
            lanes_of.append(live)
            prev_lane = {b: lane for lane, b in enumerate(live.tolist())}
        return request_major(steps, lanes_of, counts, virtual_ids.device)


def mark_lags(draft, batch) -> None:
    """Each of ``batch``'s requests without a lag lags from its cached tokens (a lazy
    step's rows are left out), once per decoding set ``batch.decodes`` (O(1) while the
    scheduler keeps the set; ``draft.marked``, cleared by a catch-up)."""
    decodes = batch.decodes
    if decodes is not None and decodes is draft.marked:
        return
    for r in batch.requests:
        if r.draft_lag is None:
            r.draft_lag = r.num_cached
            lagging = getattr(draft, "lagging", None)  # a head's: id -> request
            if lagging is not None:
                lagging[r.request_id] = r
    draft.marked = decodes


class StalePages:
    """Chain keys (``page_keys``) of cached full pages holding draft rows a lazy draft
    left unwritten (a draft model's stale rows, a head's zeroed holes), in insertion
    order, at most ``STALE_KEYS``: the oldest is forgotten first (a hit on a forgotten
    one drafts from those rows, which costs acceptance, never tokens)."""

    def __init__(self) -> None:
        self.keys: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def remember(self, r, row: int, page_size: int) -> None:
        """The first full page of ``r`` holding position ``row`` (none if that page
        is not full: the prefix cache does not take it)."""
        first = row // page_size
        if first < r.num_cached // page_size:
            self.keys[_page_key(r, (first + 1) * page_size, page_size)] = None
            if len(self.keys) > STALE_KEYS:
                del self.keys[next(iter(self.keys))]

    def forget(self, r, row: int, end: int, page_size: int) -> None:
        """The page of ``r`` starting at position ``row`` gets its rows written up to
        ``end``: when they cover it whole it is fresh again (nothing if ``row`` starts
        no page)."""
        if self.keys and row % page_size == 0 and row + page_size <= end:
            self.keys.pop(_page_key(r, row + page_size, page_size), None)

    def first_hit(self, r, page_size: int) -> int | None:
        """The index of the first page of ``r``'s prefix hit (``r.num_cached`` tokens)
        remembered here, else None."""
        if not self.keys or r.num_cached == 0:
            return None
        keys = page_keys(r.token_slice(0, r.num_cached), r.cache_salt, page_size)
        return next((j for j, key in enumerate(keys) if key in self.keys), None)


def _page_key(r, end: int, page_size: int) -> int:
    """The chain key of ``r``'s full page ending at position ``end``."""
    return page_keys(r.token_slice(0, end), r.cache_salt, page_size)[-1]


def page_keys(tokens, salt, page_size: int) -> list[int]:
    """Chain keys of the full pages of ``tokens`` under ``salt``: key j names the
    prefix of ``(j + 1) * page_size`` tokens (host ints)."""
    keys, key = [], hash(("draft-stale", salt))
    for start in range(0, len(tokens) - page_size + 1, page_size):
        key = hash((key, tuple(tokens[start : start + page_size])))
        keys.append(key)
    return keys


def request_major(steps: list, lanes_of: list, counts: np.ndarray, device) -> torch.Tensor:
    """(sum(counts),) int64 on ``device``: request b's ``counts[b]`` drafts in order,
    requests in batch order, from per-step tokens (``steps[j]``: one per lane of
    ``lanes_of[j]``, the requests drafting a (j + 1)-th token), one gather (no sync)."""
    if not steps:
        return torch.zeros(0, dtype=torch.int64, device=device)
    offsets = np.cumsum([0] + [lanes.size for lanes in lanes_of[:-1]])
    owner = np.repeat(np.arange(counts.size), counts)
    column = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    lane = np.empty(owner.size, np.int64)
    for j, lanes in enumerate(lanes_of):  # lane of request b in step j: its rank there
        rank = np.cumsum(np.isin(np.arange(counts.size), lanes)) - 1
        at = column == j
        lane[at] = offsets[j] + rank[owner[at]]
    return torch.cat(steps).index_select(0, to_device(lane, device))


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host int64 array on ``device`` without a stream sync (pinned on CUDA: a
    copy from pageable memory would wait for the queued work)."""
    host = torch.as_tensor(np.ascontiguousarray(values, np.int64))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _row(slot: int, position: int, token: int):
    """A one-token row of a draft step, shaped as the step upload reads a request:
    ``slot``, ``num_cached`` (the position fed) and the token there."""
    return SimpleNamespace(
        slot=slot, num_cached=position, prompt_ids=(), output_ids=_At(position, token)
    )


class _Span:
    """A catch-up row group: request ``slot``'s tokens ``ids`` (its whole history) fed
    from position ``num_cached`` on, shaped as the step upload reads a request."""

    def __init__(self, slot: int, start: int, ids: list[int]) -> None:
        self.slot, self.num_cached, self.prompt_ids, self.output_ids = slot, start, ids, ()

    def token_slice(self, start: int, stop: int) -> list[int]:
        return self.prompt_ids[start:stop]


class _At:
    """``output_ids`` of a draft row: the one token at its position."""

    def __init__(self, position: int, token: int) -> None:
        self.position, self.token = position, token

    def __getitem__(self, index: int) -> int:
        assert index == self.position, "draft row invariant: only its own position is read"
        return self.token
