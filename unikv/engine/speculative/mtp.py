"""Drafts from a head over the target's hidden states: ``method: "mtp"`` (the
checkpoint's own MTP layer, ``models/mtp.py``) and ``method: "eagle3"`` (an EAGLE-3
head, ``models/eagle3.py``; its input is ``fc`` of three target hidden states, its
tokens mapped from a draft vocabulary). Below, "the layer" is either head.

The layer's K/V live in ``draft_*`` sub-pools of the one pool (as a draft model's,
``draft.py``), so allocation, rollback, preemption, swap and prefix caching cover
them. Its row at position p reads the target's final hidden state ``h_p`` and the
token ``t_{p+1}`` after it, so it is written once that token is known:

- after every target step (``forward_plan``): over the step's own rows, each row's
  next token the row after it, a request's last row's the token sampled in the step
  (or the next prompt token, a prefill chunk that is not the last); ``h`` from the
  target's ``hidden_out`` (every row's exported hidden states, ``DecoderLM.export_hidden``),
  through the head's ``project``;
- after a verify step (``forward_verify``): over its ``1 + k`` rows per request,
  the last kept row's next token the target's emitted one (on the device); rows
  past it are rejected and trimmed with the target's.

The layer runs under the step's row plan (``kernels.backend.stepping``), as the
target's layers do under ``DecoderLM.forward``: its rows (and ``project``'s) under the
plan's ``rows`` (a padded verify plan's: its captured size's), the greedy head over
the requests' rows under ``logit_rows`` where it plans as many rows, else under one
plan of that count made once for the step; no op derives a variant from a shape.

The layer's output at a request's last kept row gives the first draft of its next
step, kept per request slot on the device (``first`` tokens, ``hidden`` states).
``propose`` chains the layer from there: draft j + 1 from the row at position
``L + j - 1`` (L: the request's cached tokens; rows the verify step allocated),
its hidden state the previous row's output: where every drafting request drafts k,
as one unit (``chain.DraftChain``: one plan, on CUDA one graph per lane count), else
one planned step at a time (``propose_steps``). The verify step rewrites those rows
with the target's hidden states (after a verify graph, a graph of their own:
``capture_verify_rows``). A request whose first draft is not kept (its last step
ran elsewhere: a swap moved its slot) drafts nothing for a step.

Past the batch-size rule the layer is lazy (``enable_lazy``) and does no work: a
plain decode step runs no layer; its rows' exported hidden states go into the stash
(``stash.HiddenStash``, a ring per request slot, ``window`` positions deep: 16 to 64,
``stash.lazy_window``) from inside the step itself (the decode graphs on CUDA), and
``defer`` adds each row's next token (the step's sample: one ``index_copy_``). The
stash is never flushed past the rule. Before the request's next proposal or its next
step that runs the layer (``catch_up``), its last ``window`` lagging rows are written
in one extend and the older ones are holes, zeroed (``holes.HeadHoles``: outputs stay
exact, a hole costs acceptance only). A request that leaves lagging runs nothing: its
lagging rows are zeroed where its pages stay (finish with prefix caching, the first
page holding one recorded; a later hit on it is counted), except a preempted one,
which writes its stashed rows first (its slot's ring is lost).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from unikv.engine.attention import DecodeAttention, ExtendAttention
from unikv.engine.request import Batch, Pending
from unikv.engine.runner import DRAFT_PREFIX
from unikv.engine.speculative.draft import (
    _row,
    _Span,
    free_grow,
    mark_lags,
    packed,
    request_major,
    to_device,
)
from unikv.engine.speculative.holes import HeadHoles
from unikv.kernels.backend import RowsPlan, stepping
from unikv.kernels.linear.ref import resolve_feedback


def eagle3_subpool_configs(head, target_configs, page_size: int, dtype) -> list:
    """An EAGLE-3 head's one full-attention layer as a ``draft_full`` sub-pool, on
    the band direction the target's leave free."""
    from unikv.hf_config import specs_from_hf_config

    (config,) = specs_from_hf_config(head.hf_config, page_size=page_size, dtype=dtype)
    grow = free_grow(target_configs)
    return [replace(config, name=DRAFT_PREFIX + config.name, grow=grow)]


def mtp_subpool_configs(target_configs, kind: str) -> list:
    """The MTP layer's sub-pool: the target's sub-pool config of ``kind`` (DeepSeek's
    "mla", MiMo's sliding "swa", Qwen3.5's / Qwen3-Next's "full") for one layer, renamed ``draft_*``, on the band
    direction the target's leave free."""
    same = [c for c in target_configs if c.name == kind]
    if len(same) != 1:
        raise ValueError(
            f"speculative_config: the MTP layer caches like the target's {kind!r} sub-pool; "
            f"the target's sub-pools are {[c.name for c in target_configs]}"
        )
    spec = replace(same[0].spec, num_layers=1)
    grow = free_grow(target_configs)
    return [replace(same[0], name=DRAFT_PREFIX + kind, spec=spec, layers=(0,), grow=grow)]


class HiddenDraft:
    """The MTP layer over its sub-pools (module docstring).

    Args:
        target: the target ``DecoderLM`` (its embedding, LM head and ``hidden_out``);
        layer: the draft head, ``models.mtp.MTPLayer`` or ``models.eagle3.Eagle3Head``
        (``project`` the target's exported rows, ``forward``, ``tokens``); caches: its LayerCache list (the
        ``draft_*`` sub-pools); planner: the target runner's StepPlanner; backend:
        the kernel ops; sm_scale: the target's; max_slots: request slots.
    """

    def __init__(self, target, layer, caches, planner, backend, sm_scale, max_slots) -> None:
        self.target, self.layer, self.caches, self.planner = target, layer, caches, planner
        self.backend, self.sm_scale = backend, sm_scale
        param = next(target.parameters())
        hidden, dev = target.config.hidden_size, param.device
        assert target.hidden_out is not None and len(target.hidden_out) >= planner.max_tokens, (
            "draft invariant: the target copies every row's hidden states (hidden_out, "
            "set before its graphs are captured: DecoderLM.export_hidden)"
        )
        # per slot: d_1 and its hidden state; row ``max_slots`` takes a padded lane's
        # (a verify graph's rows past its requests: written, never read)
        self.first = torch.zeros(max_slots + 1, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(max_slots + 1, hidden, dtype=param.dtype, device=dev)
        self.scratch = max_slots
        self.verify_rows = None  # the rows after a verify graph, graphed (``capture_verify_rows``)
        self.kept: dict[int, tuple[int, int]] = {}  # slot -> (request id, its num_cached)
        self.states = [None] * len(caches)

        self.rule = None  # ``Speculator.within_rule`` once lazy (``enable_lazy``)
        self.holes: HeadHoles | None = None  # the hole rows' zeroing, once lazy
        self.lagging: dict = {}  # id -> request, of those whose rows lag (``Request.draft_lag``)
        self.marked = None  # the decoding set whose lags are marked (``draft.mark_lags``)
        self.lazy_ok = True  # build.py: False where the prefix cache shares decode pages
        self.chain = None  # chains of k drafts as one unit (``enable_chain``)

    # -- past the batch-size rule: lazy (module docstring) ----------------------------

    def enable_lazy(self, rule, stash, window: int | None = None, counters=None) -> None:
        """Past ``rule`` (``Speculator.within_rule``) plain decode steps stash the
        target's exported rows (``stash``, a ``HiddenStash`` the runner writes from
        its decode steps, one slot per request slot and a scratch slot) and their next
        tokens, and the layer does no work (module docstring). ``window``: the stash
        resized (tests; before any decode graph is captured); ``counters``: the
        speculation counters the holes are counted in (None: those it has)."""
        assert stash.slots == self.first.shape[0], (
            "lazy head invariant: a stash slot a request slot"
        )
        if window is not None:
            stash.resize(window)
        self.rule, self.stash = rule, stash
        if counters is None and self.holes is not None:
            counters = self.holes.counters
        self.holes = HeadHoles(self.caches, self.planner.alloc.view, counters)

    def lazy(self, batch_size: int) -> bool:
        """Whether a plain decode step of ``batch_size`` requests stashes the layer's
        input instead of running it (past the batch-size rule, once enabled)."""
        return self.rule is not None and self.lazy_ok and not self.rule(batch_size)

    def defer(self, plan, batch, tokens: torch.Tensor) -> None:
        """A lazy decode step: its rows' next tokens (its samples) into the stash, on
        the device (their hidden states: the step's own write); nothing runs."""
        self.stash.tokens(len(batch.requests), tokens)
        mark_lags(self, batch)  # (once per decoding set: no Python per request)

    def prepare(self, batch) -> bool:
        """Before a step that runs the layer (planned after this): the stashed rows of
        its lagging requests, which its rows attend to. True when it planned (the step
        planner's buffers then hold the catch-up's tables)."""
        if not self.lagging:
            return False
        return self.catch_up([r for r in batch.requests if r.draft_lag is not None]) > 0

    def opened(self, r) -> None:
        """``r`` was admitted: a prefix hit over a page holding a hole (``holes.record``)
        is counted (``head_hole_hits``); it drafts over the zeroed rows."""
        if self.holes is not None:
            self.holes.hit(r)

    def release(self, r, write: bool, preempted: bool = False) -> None:
        """``r`` leaves (finishes or is preempted; ``write``: its pages are shared or
        kept). No layer runs for a finish: where its pages stay, its lagging rows are
        zeroed (``left``) and the first page holding one recorded (``holes``). A preempted
        request writes its stashed rows first (its slot's ring does not come back
        with it), the older ones zeroed."""
        if r.draft_lag is None:
            return
        if write and preempted:
            self.catch_up([r])
            return
        if write:  # zeroed with the others leaving in the same step (``left``)
            self.holes.leaving.append((r.slot, r.draft_lag, r.num_cached - r.draft_lag))
            self.holes.record(r, r.draft_lag)
        r.draft_lag = None
        self.lagging.pop(r.request_id, None)

    def left(self) -> None:
        """The requests a step ended have shared their pages (before they are freed):
        the rows they left lagging are zeroed, all in one go."""
        if self.holes is not None:
            self.holes.zero_leaving()

    @torch.inference_mode()
    def catch_up(self, requests) -> int:
        """The layer over each lagging request's last stashed rows: ``[max(draft_lag,
        num_cached - window), num_cached)``, their first draft kept; the rows before
        them (their inputs overwritten in the ring) zeroed, holes. Returns the
        extends run."""
        assert not self.holes.leaving, (
            "lazy head invariant: the rows requests left lagging are zeroed as they leave "
            "(Speculator.left, before their pages are freed)"
        )
        spans, holes = [], []
        self.marked = None  # (lags cleared: the next lazy step marks again)
        for r in requests:
            lag = r.draft_lag
            if lag is None:
                continue
            r.draft_lag = None
            self.lagging.pop(r.request_id, None)
            end = r.num_cached
            if end <= lag:  # a prefill from the lag on rewrote the rows itself
                continue
            start = max(lag, end - self.stash.window)
            if start > lag:
                holes.append((r.slot, lag, start - lag))
            spans.append((r, start, end - start))
        if holes:
            self.holes.zero(*(np.asarray(c, np.int64) for c in zip(*holes)))
        runs = packed(spans, self.planner.max_tokens, self.planner.max_seqs)
        for batch in runs:
            self._extend(batch)
        return len(runs)

    def _extend(self, spans) -> None:
        slots = np.asarray([r.slot for r, _, _ in spans], np.int64)
        starts = np.asarray([s for _, s, _ in spans], np.int64)
        counts = np.asarray([n for _, _, n in spans], np.int64)
        vids = self.planner.alloc.view.token_vids(slots, starts, counts)
        rows = [_Span(r.slot, s, [0] * (s + n)) for r, s, n in spans]
        plan = self.planner.plan(Batch(rows, counts.tolist(), [vids]))
        at = self.stash.rows(slots, counts, plan.positions)
        g = self._run(plan, self.stash.t[at], exported=self.stash.h[at])
        num = len(spans)
        self._keep(plan, num, g.index_select(0, plan.logits_indices[:num]))
        for r, s, n in spans:
            self.kept[r.slot] = (r.request_id, s + n)

    # -- writing the layer's rows after target steps ----------------------------------

    def _run(
        self,
        plan,
        ids: torch.Tensor,
        hidden: torch.Tensor | None = None,
        exported: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer over ``plan``'s T rows (``ids``: each row's next token; ``hidden``:
        each row's previous hidden state, or ``exported``: the target's T exported rows,
        through ``project``) -> its outputs g (T, hidden), under the plan's ``rows``."""
        kind = DecodeAttention if plan.is_decode else ExtendAttention
        attn = kind(self.caches, plan, self.backend, self.sm_scale, self.states)
        with stepping(plan.rows):
            if hidden is None:
                hidden = self.layer.project(exported)
            embeds = self.target.stack.embed(ids)
            return self.layer(embeds, hidden, plan.positions, attn)

    def _tokens(self, plan, g: torch.Tensor) -> torch.Tensor:
        """(N,) greedy drafts of outputs g (N, hidden), the head under the step's plan
        of N rows: ``plan.logit_rows`` where it plans N rows (an eager step: one a
        request), else one made here, once for the step (a padded plan's requests)."""
        head: RowsPlan | None = plan.logit_rows
        if head is None or head.rows != g.shape[0]:  # host ints
            head = self.backend.plan_rows(g.shape[0])
        with stepping(head):
            return self.layer.tokens(g, self.target, self.backend)

    def _keep(self, plan, num: int, g_last: torch.Tensor, padded: int = 0) -> None:
        """The first draft of each of the step's ``num`` requests and its hidden
        state, into their slots (device only). ``padded``: a verify graph's plan of
        ``num`` lanes, q = ``padded`` rows each: a lane whose seq_len is q (no cached
        token: a padded lane) writes the scratch row instead (no host count read)."""
        slots = plan.slots[:num].long()
        if padded:
            slots = torch.where(plan.seq_lens[:num] > padded, slots, self.scratch)
        self.first.index_copy_(0, slots, self._tokens(plan, g_last))
        self.hidden.index_copy_(0, slots, g_last)

    @torch.inference_mode()
    def forward_plan(self, plan, batch, tokens: torch.Tensor) -> None:
        """After a target step (not a verify step): the layer's rows of its tokens;
        ``tokens``: (B,) int64 its samples on the device."""
        reqs, num = batch.requests, len(batch.requests)
        ids = resolve_feedback(plan.input_ids, plan.feedback)
        nxt = torch.roll(ids, -1)  # each row's next token: the row after it ...
        ends = [r.num_cached + n for r, n in zip(reqs, batch.num_new)]
        known = [e < r.seq_len for r, e in zip(reqs, ends)]  # ... a prompt chunk's next
        last = plan.logits_indices[:num]
        if any(known):
            host = [r.token_slice(e, e + 1)[0] if k else 0 for r, e, k in zip(reqs, ends, known)]
            mask = to_device(np.asarray(known, np.int64), ids.device).bool()
            given = to_device(np.asarray(host, np.int64), ids.device)
            next_last = torch.where(mask, given, tokens[:num])
        else:
            next_last = tokens[:num]
        nxt.index_copy_(0, last, next_last)
        g = self._run(plan, nxt, exported=self.target.hidden_out[: nxt.shape[0]])
        self._keep(plan, num, g.index_select(0, last))
        for r, e in zip(reqs, ends):
            self.kept[r.slot] = (r.request_id, e)

    @torch.inference_mode()
    def forward_verify(self, plan, batch, tokens, accepted, rows: int | None = None) -> None:
        """After a verify step (before its readback): the layer's rows of its ``1 +
        k`` rows per request; tokens (B, K+1), accepted (B,) int64 on the device.
        ``rows``: the verify graph's padded size that ran it (None: eager), whose
        rows replay a graph of their own where captured (``capture_verify_rows``)."""
        if rows is not None and self.verify_rows is not None:
            self.verify_rows.run(plan, rows, tokens, accepted)
        else:
            self.write_verify_rows(plan, len(batch.requests), tokens, accepted)

    def write_verify_rows(self, plan, num: int, tokens, accepted, padded: int = 0) -> None:
        """``forward_verify`` over ``num`` lanes of ``plan`` (``padded``: q, a verify
        graph's padded plan, its padded lanes' outputs sent to the scratch row)."""
        ids = plan.input_ids
        last = plan.q_indptr[:num].long() + accepted  # each request's last kept row
        nxt = torch.roll(ids, -1)
        nxt.index_copy_(0, last, tokens.gather(1, accepted[:, None])[:, 0])
        g = self._run(plan, nxt, exported=self.target.hidden_out[: nxt.shape[0]])
        self._keep(plan, num, g.index_select(0, last), padded)

    def capture_verify_rows(self, verify_graphs, capture: bool = True) -> None:
        """The rows after each verify graph as a graph of their own, over the same
        padded plans (``chain.VerifyRowGraphs``; ``capture=False``: run eagerly)."""
        from unikv.engine.speculative.chain import VerifyRowGraphs

        self.verify_rows = VerifyRowGraphs(self, verify_graphs.sizes, verify_graphs.q, capture)

    def settled(self, batch, accepted: list[int]) -> None:
        """A verify step's accepted counts, on the host: the kept drafts' owners."""
        for r, a in zip(batch.requests, accepted):
            self.kept[r.slot] = (r.request_id, r.num_cached + a + 1)

    # -- proposing -------------------------------------------------------------------

    def limit(self, requests, rooms: np.ndarray) -> np.ndarray:
        """``rooms`` with 0 for each request whose first draft is not kept (a lagging
        request's rows are written first: ``catch_up``)."""
        if self.lagging:
            self.catch_up(requests)
        ready = [self.kept.get(r.slot) == (r.request_id, r.num_cached) for r in requests]
        return np.where(ready, rooms, 0)

    def enable_chain(self, k: int, max_rows: int = 0, capture: bool = False) -> None:
        """Chains of k drafts as one unit (``chain.DraftChain``: one plan, a graph per
        lane count up to ``max_rows`` when ``capture``); not where a draft sub-pool
        has a window (its decode tables are planned by the window)."""
        from unikv.engine.speculative.chain import DraftChain

        if k >= 2 and not any(getattr(c, "window", 0) for c in self.caches if c is not None):
            self.chain = DraftChain(self, k, max_rows, capture)

    def step(self, plan, ids: torch.Tensor, hidden: torch.Tensor):
        """One chained step over ``plan``'s rows (a decode plan, one row per lane):
        (outputs g, their greedy drafts), from each row's token and previous hidden state."""
        g = self._run(plan, ids, hidden)
        return g, self._tokens(plan, g)

    @torch.inference_mode()
    def propose(self, requests, counts: np.ndarray, virtual_ids: torch.Tensor) -> torch.Tensor:
        """``counts[b]`` greedy drafts per decoding request b (its pending token at
        position L_b = num_cached), on the device, request-major (``draft.request_major``,
        no host read); ``virtual_ids``: the verify step's ids. Where every drafting
        request drafts k, the chain is one unit (``chain.DraftChain``), else one plan a
        step (``propose_steps``)."""
        starts = np.zeros(len(requests), np.int64)
        np.cumsum(1 + counts[:-1], out=starts[1:])
        chain, live = self.chain, np.flatnonzero(counts > 0)
        if (
            chain is not None
            and live.size
            and (counts[live] == chain.k).all()
            and chain.fits(live.size)
        ):
            lanes = [requests[b] for b in live.tolist()]
            return chain.run(lanes, virtual_ids, starts[live]).reshape(-1)
        return self.propose_steps(requests, counts, virtual_ids, starts)

    def propose_steps(self, requests, counts, virtual_ids, starts) -> torch.Tensor:
        """``propose`` one planned step at a time (lanes drafting unequal counts)."""
        steps, lanes_of = [], []
        live = np.flatnonzero(counts > 0)
        if live.size:
            slots = to_device([requests[b].slot for b in live.tolist()], self.first.device)
            steps.append(self.first.index_select(0, slots))
            hidden = self.hidden.index_select(0, slots)
            lanes_of.append(live)
        for j in range(1, int(counts.max(initial=0))):
            now = np.flatnonzero(counts > j)
            prev = lanes_of[-1]
            keep = np.searchsorted(prev, now)  # lanes of the previous step
            if now.size != prev.size:
                index = to_device(keep, hidden.device)
                hidden = hidden.index_select(0, index)
            rows = [
                _row(requests[b].slot, requests[b].num_cached + j - 1, Pending.of(int(lane)))
                for b, lane in zip(now.tolist(), keep.tolist())
            ]
            index = to_device(starts[now] + j - 1, virtual_ids.device)
            batch = Batch(rows, [1] * len(rows), [virtual_ids.index_select(0, index)])
            plan = self.planner.plan(batch, steps[-1])
            hidden = self._run(plan, plan.input_ids, hidden)
            token = self._tokens(plan, hidden)
            steps.append(token)
            lanes_of.append(now)
        return request_major(steps, lanes_of, counts, virtual_ids.device)
