"""The scheduler's prefix-caching hooks, chosen once at construction
(``prefix_policy``): ``NoPrefixCache`` with caching off, ``PrefixCaching`` with it on.

Prefix caching (within a request's ``cache_salt``): a waiting request opens with
the allocator's longest cached run of whole pages of its tokens (all but the
last) and prefills from there
(``open``); its full pages are shared (``alloc.prefix.insert``) when its
prompt is in, and again when it finishes or is preempted (``share``), so a
recompute hits. With sliding windows every prefill chunk is shared once it is
in, before ``free_out_of_window`` runs, so the cached prefixes keep their window
pages (a hit needs the pages its first query reads; ``allocator/prefix.py``).

With recurrent state a hit also needs a state checkpoint at its last block. A
request takes one (its pages shared, its state slot copied: ``prefix.checkpoint``;
policy and cost: ``allocator/checkpoints.py``) at each of its checkpoint points
(``points``, tokens):

- the end of the cached page run it matched, if longer than its hit (a junction:
  two prompts share the prefix there and diverge; ``junction=True``, so under
  pressure it and the pages of its chain go after every per-request checkpoint and
  page, ``StateCheckpoints.shared``, as does any checkpoint a hit restored);
- its last whole page before its last token;
- while it decodes, the page boundaries it completes where the cost rule says a
  checkpoint pays (``engine/checkpoint_rule.py``: the chance it is the turn end x the
  tokens since its previous checkpoint, against the copy and the bytes held, weighed
  by the pool fractions the checkpoints and the running requests hold:
  ``pool_fractions``; always at the last boundary its ``max_tokens`` reaches),
  rolling: each one drops the
  request's previous decode checkpoint and takes its slot, so it evicts
  no other conversation's while that one holds a slot (or, once taken, demotes its
  prompt-end one: ``prefix.checkpoint(supersedes=...)``), so a request holds at most
  one and the next turn of a chat hits prompt and answer up to it. With ``supersede_turns`` (off by default:
  it lost hit rate at 2x in ``sim_prefix_hybrid_chat``), a request that opened with a
  hit at a previous turn's end demotes that checkpoint once it takes one of its own;
  a junction or prompt-end checkpoint is never demoted for that.

A prefill chunk runs on past a point (``chunk``: it ends at one only when a second
lies inside it too: one checkpoint a lane a step); ``before_step`` reserves, for each
chunk of more than one token that reaches one, at its end or inside it, the checkpoint
slot the chunk writes the state after that row into as well
(``alloc.prefix.reserve_checkpoint``; the plan's ``ckpt_slots`` and ``ckpt_at``), and
``after_step`` takes the checkpoints (adopting those slots: no copy) and shares pages
once a step's tokens are in. Issue 41: a prompt's last chunk no longer stops at its last
whole page, so the prompt's last tokens take no extend step of their own. ``alloc_mamba``
restores a hit's checkpoint. A request added to the waiting queue marks the
checkpoint its prompt would restore now (``expect``: evicted after every other, its
chain's pages after every other page) until it opens or is aborted (``forget``).
"""

from __future__ import annotations

from contextlib import nullcontext
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

from unikv.engine.checkpoint_rule import CheckpointRule
from unikv.engine.request import BatchKind
from unikv.placement import worst_case_pages

if TYPE_CHECKING:
    from unikv.allocator import PoolAllocator
    from unikv.engine.request import Batch, DecodeSet, Request

_NONE = np.zeros(0, np.int64)  # no tokens known yet


class NoPrefixCache:
    """Caching off: a plain slot per admission, whole chunks, nothing shared."""

    enabled = False

    def __init__(self, alloc: PoolAllocator) -> None:
        self.alloc = alloc
        self.hits_first = False  # (nothing is cached: arrival order)
        self.points: dict[int, list[int]] = {}  # request slot -> its checkpoint points

    def open(self, r: Request):
        """A request slot for ``r`` (``r.slot``); returns the prefix hit (none here)."""
        r.slot = self.alloc.new_request()

    def chunk(self, r: Request, budget: int) -> int:
        """The tokens of ``r`` to prefill now, within ``budget``."""
        return min(budget, r.num_pending)

    def expect(self, r: Request) -> None:
        """``r`` joins the waiting queue (nothing to note here)."""

    def pick(self, waiting, limit: int) -> int:
        """The index in ``waiting`` of the request to admit next: the head (FIFO)."""
        return 0

    def forget(self, r: Request) -> None:
        """``r`` left the waiting queue without opening (an abort)."""

    def before_step(self, batch: Batch, first: int = 0) -> None:
        """A step with prefill chunks (requests ``[first:]`` of ``batch``) is scheduled
        (nothing to prepare here)."""

    def after_step(self, batch: Batch, verify: bool = False) -> None:
        """After a step's tokens are in (``num_cached`` advanced); ``verify``: a
        speculative verify step (``num_new``: the rows each request kept)."""

    def share(self, r: Request) -> None:
        """Share the full pages holding ``r``'s computed tokens."""

    def window_demand(self, r: Request, demand: dict, subpools, chunk: int) -> dict:
        """``demand`` (new pages per sub-pool for ``r``'s pending tokens) as is."""
        return demand


class PrefixCaching(NoPrefixCache):
    """Caching on (the module docstring); ``has_state``: the pool has a Mamba
    sub-pool (checkpoints), ``has_window``: a sliding-window one."""

    enabled = True

    def __init__(
        self,
        alloc: PoolAllocator,
        has_state: bool,
        has_window: bool,
        rule: CheckpointRule | None = None,
    ) -> None:
        super().__init__(alloc)
        self.prefix = alloc.prefix
        self.has_state, self.has_window = has_state, has_window
        # the step's checkpoints in one copy (issue 41); none to batch without state
        self._step_scope = (lambda: self.prefix.batched()) if has_state else nullcontext
        self.rule = CheckpointRule() if rule is None else rule
        # request slot -> tokens of its latest prompt-end or decode checkpoint (the
        # next decode checkpoint of the slot demotes it)
        self.latest: dict[int, int] = {}
        # request slot -> tokens of its latest checkpoint of any kind, or of its hit
        self.since: dict[int, int] = {}
        # request slot -> tokens of its hit when that ended at a previous turn's end
        # (demoted once the request takes a checkpoint of its own: superseded)
        self.extends: dict[int, int] = {}
        # request slot -> tokens of its junction point: the end of the cached run its
        # prompt matched, past its hit (two prompts share the prefix there, then
        # diverge); its checkpoint is a shared junction, kept after per-request ones
        self.junction: dict[int, int] = {}
        # demote a previous turn's end once the next turn takes its own: off (in the
        # simulation it cost hit rate at 2x the working set; not understood yet)
        self.supersede_turns = False
        self.page_size = alloc.view.roles.page_size
        # request id -> the checkpoint node its waiting prompt would restore
        # (``expect``): evicted after the others until it opens (issue 41)
        self.expected: dict[int, int] = {}
        # hits first (``pick``): the waiting requests whose prompt hit the cache when
        # added, and per waiting head the admissions that jumped it
        self.hits_first = True
        self.hits: set[int] = set()
        self.jumped: dict[int, int] = {}
        # a DECODE batch's set (``_due``): its prompt lengths, and (set, the tokens its
        # first request holds at the next step with work) while no step has work before
        self._set: DecodeSet | None = None
        self._prompts = np.zeros(0, np.int64)
        self._next: tuple[DecodeSet, int] | None = None
        # request slot -> (request, its first tokens known so far, host int64): ``share``
        # converts only the tokens since its last call (issue 41)
        self._ids: dict[int, tuple[Request, np.ndarray]] = {}

    def expect(self, r: Request) -> None:
        """``r`` joins the waiting queue: the state checkpoint its prompt would
        restore now is evicted after every checkpoint no waiting request expects, so
        admitting one conversation's turn does not evict the turn end the next
        waiting turn of another would hit (issue 41); a prompt that hits is noted for
        ``pick`` (without state: its first page cached). One lookup per added request."""
        if r.params.prompt_logprobs is not None:
            return  # it takes no hit
        if self.has_state:
            node = self.prefix.expect(r.token_slice(0, r.seq_len - 1), r.cache_salt)
            if node:
                self.expected[r.request_id] = node
                self.hits.add(r.request_id)
        elif self.hits_first:  # its first page cached: one block's lookup
            first = r.token_slice(0, min(self.page_size, r.seq_len - 1))
            if self.prefix.match(first, r.cache_salt).num_tokens:
                self.hits.add(r.request_id)

    def pick(self, waiting, limit: int) -> int:
        """The index in ``waiting`` of the request to admit next: the first of its
        first ``limit`` whose prompt hit the cache when it was added, ahead of
        misses (its prefill is cheap, and its checkpoint and pages may be evicted by
        the misses' prefill while it waits: issue 41), else the head. A preempted head
        goes first (its recompute or its swapped pages), and so does a head that
        ``limit`` picks have jumped already (no starvation)."""
        head = waiting[0]
        if not (self.hits_first and self.hits) or head.request_id in self.hits:
            return 0
        if head.num_preemptions:
            return 0
        if self.jumped.get(head.request_id, 0) >= limit:
            return 0
        for i, r in enumerate(islice(waiting, 1, limit)):
            if r.request_id in self.hits:
                self.jumped[head.request_id] = self.jumped.get(head.request_id, 0) + 1
                return i + 1
        return 0

    def forget(self, r: Request) -> None:
        """``r`` opens or leaves the waiting queue: its ``expect`` is undone."""
        self.hits.discard(r.request_id)
        self.jumped.pop(r.request_id, None)
        node = self.expected.pop(r.request_id, 0)
        if node:
            self.prefix.unexpect(node)

    def open(self, r: Request):
        """A request slot holding the cached pages of ``r``'s longest cached prefix
        (its host part reloaded), ``r.num_cached`` counting them; returns the hit."""
        self.forget(r)
        prefix = self.prefix
        # prompt logprobs need every prompt row computed: such a request takes no hit
        end = r.seq_len - 1 if r.params.prompt_logprobs is None else 0
        hit = prefix.reload(prefix.match(r.token_slice(0, end), r.cache_salt))
        r.slot = self.alloc.new_request(prefix=hit)
        r.num_cached = hit.num_tokens
        self.points.pop(r.slot, None)
        self._ids.pop(r.slot, None)
        if self.has_state:
            ps = self.page_size
            ends = {hit.num_page_tokens, (r.seq_len - 1) // ps * ps}
            ends = [n for n in sorted(ends) if n > hit.num_tokens]
            if ends:
                self.points[r.slot] = ends
            if hit.num_page_tokens > hit.num_tokens:
                self.junction[r.slot] = hit.num_page_tokens
            else:
                self.junction.pop(r.slot, None)
            self.latest.pop(r.slot, None)
            self.since[r.slot] = hit.num_tokens
            if self.supersede_turns and prefix.ends_turn(hit):
                self.extends[r.slot] = hit.num_tokens
            else:
                self.extends.pop(r.slot, None)
        return hit

    def chunk(self, r: Request, budget: int) -> int:
        """Within ``budget``; a chunk reaches one checkpoint point at most (its state is
        written at that row inside the chunk: ``before_step``), so it ends at ``r``'s
        next point when a second one lies inside it too, or when the slot the state
        inside it needs cannot be reserved now (no room: the point is then the chunk's
        end, whose state the take copies from the request's slot). A request being
        admitted holds no state slot yet: its chunk runs on, and ``before_step``
        reserves (in ``sim_prefix_hybrid_chat`` at 1.25x, 4 of 194 such points found
        no room there and were passed; reserving before the admission's pages instead
        cost 12 points of hit rate)."""
        n = min(budget, r.num_pending)
        ends = self.points.get(r.slot)
        if not ends or not r.num_cached < ends[0] < r.num_cached + n:
            return n
        if n > 1 and (len(ends) < 2 or ends[1] >= r.num_cached + n):
            if not self.prefix.holds_state(r.slot):  # (being admitted: no state slot yet;
                return n  # ``before_step`` reserves once it has one, else the point passes)
            if self.prefix.reserve_checkpoint(r.slot, ends[0]):
                return n
        return ends[0] - r.num_cached

    def before_step(self, batch: Batch, first: int = 0) -> None:
        """Reserve the checkpoint slot of each prefill chunk of ``batch`` (its requests
        ``[first:]``; the decodes come first) that reaches its request's next
        checkpoint point, at its end or inside it (the plan's ``ckpt_at``: the ops
        write the state after that row; host ints; a loop over the step's prefill
        chunks only when some request has points left). A one-token chunk takes the
        copy instead: its step may run as a decode (graphs, no second destination).
        The step's reservations (and what their room evicted) bind in one table write
        (``alloc.prefix.batched``), not one each."""
        if not self.points:
            return
        with self._step_scope():
            for r, n in zip(batch.requests[first:], batch.num_new[first:]):
                ends = self.points.get(r.slot)
                if n > 1 and ends and r.num_cached < ends[0] <= r.num_cached + n:
                    self.prefix.reserve_checkpoint(r.slot, ends[0])

    def after_step(self, batch: Batch, verify: bool = False) -> None:
        """Checkpoints at the points the step reached; pages shared where a prompt
        is now in (later requests may hit it) or, with windows, each prompt chunk
        (before its pages leave the window). ``verify``: a speculative verify step,
        whose kept rows (``num_new``) may complete a page before the last: its state
        is in the per-draft-position slot of that row (``allocator/mamba.py``).

        A plain decode step (``BatchKind.DECODE``, its ``DecodeSet``) costs no loop over
        its requests (issue 41): every request moved on by one token, so the step where
        the next one completes a page (with state) or its prompt is known from the
        set's lengths; the steps before it return at once (``_due``), and that step
        visits only the requests due there."""
        decodes = getattr(batch, "decodes", None)  # (a bare batch of requests: none)
        if not verify and decodes is not None and batch.kind is BatchKind.DECODE:
            due = self._due(batch)
            if due is None:
                return
            requests = batch.requests
            with self._step_scope():
                for i in due.tolist():
                    r = requests[i]
                    assert r.num_cached == int(batch.decodes.lens[i]) + 1, (
                        "prefix policy invariant: a DECODE batch's set holds its lengths"
                    )
                    self._after_one(r, 1, False)
            return
        with self._step_scope():
            for r, n in zip(batch.requests, batch.num_new):
                self._after_one(r, n, verify)

    def _due(self, batch: Batch) -> np.ndarray | None:
        """Indices of the requests of DECODE ``batch`` that ``_after_one`` has work for
        (a point, the prompt's end, a page completed with state), or None when none
        has; host ints, no loop over the requests but when its ``DecodeSet`` is new.
        Between page boundaries a step costs two int compares (``_next``: the step
        where the set's first request holds that many tokens when the next is due)."""
        d = batch.decodes
        if self._next is not None and self._next[0] is d and d.lens[0] + 1 < self._next[1]:
            return None  # (lens: before this step; ``complete`` advances them after)
        if d is not self._set:
            self._set = d
            count = len(d.decoding)
            self._prompts = np.fromiter((len(r.prompt_ids) for r in d.decoding), np.int64, count)
        new, ps = d.lens + 1, self.page_size  # tokens each holds after this step
        points = self.points and not self.points.keys().isdisjoint(d.slots.tolist())
        if points or len(batch.requests) != len(new):
            self._next = None
            return np.arange(len(batch.requests))  # (not a plain set: every request)
        due = new == self._prompts
        if self.has_state:
            due |= (new % ps == 0) & (new > self._prompts)
            gap = int((ps - new % ps).min())  # steps to the next page completed
        else:
            gap = 1 << 62  # a prompt ends in a decode step only as it starts
        self._next = (d, int(new[0]) + gap)
        found = np.flatnonzero(due)
        return found if len(found) else None

    def _after_one(self, r: Request, n: int, verify: bool) -> None:
        """``after_step`` for request ``r``, which fed ``n`` tokens in the step."""
        window, state, ps = self.has_window, self.has_state, self.page_size
        if self.points:
            self._checkpoint(r)
        prompt = len(r.prompt_ids)
        # the last page boundary a decode (one row, or a verify step's kept rows) reached
        at = r.num_cached // ps * ps if verify else r.num_cached
        if r.num_cached - n < prompt <= r.num_cached or (window and r.num_cached < prompt):
            self.share(r)
        elif (  # a decode completed a page where the cost rule says it pays
            state and (n == 1 or verify) and at > max(prompt, r.num_cached - n) and at % ps == 0
        ) and self._pays(r, at):
            row = at - (r.num_cached - n) - 1  # the kept row after which it holds
            source = None if row == n - 1 else self._draft_vid(r.slot, row)
            self._take(r, rolling=True, at=at, source=source)

    def _draft_vid(self, slot: int, row: int) -> int:
        """The Mamba virtual id of request ``slot``'s draft slot ``row``."""
        return int(self.alloc.view.draft_vids(np.array([slot]))[0, row])

    def _pays(self, r: Request, at: int) -> bool:
        """The cost rule at the decode boundary ``at`` tokens (host ints only)."""
        ps, prefix = self.page_size, self.prefix
        end = len(r.prompt_ids) + r.max_new_tokens - 1  # tokens it computes at most
        reuse = CheckpointRule.reuse_at(at, end, ps)
        tokens = at - self.since.get(r.slot, 0)
        pressure = 1.0 if prefix.evicted else 0.0
        held = r.slot not in self.latest
        if not (held and pressure):
            return self.rule.take(reuse, tokens, held, pressure)
        return self.rule.take(reuse, tokens, held, pressure, *self.pool_fractions())

    def pool_fractions(self) -> tuple[float, float]:
        """(checkpoints, batch): the fractions of the pool's bytes the cache's state
        checkpoints and the running requests hold (``PrefixVerbs.pool_fractions``)."""
        return self.prefix.pool_fractions()

    def _checkpoint(self, r: Request) -> None:
        """The checkpoint at ``r``'s next point once its prefill reached it: at its
        chunk's end (the live state), or inside the chunk when the chunk wrote the
        state after that row into the slot ``before_step`` reserved (else there is no
        state to take there, and the point is passed)."""
        ends = self.points.get(r.slot)
        if not ends or ends[0] > r.num_cached:
            return
        at = ends.pop(0)
        if not ends:
            del self.points[r.slot]
        if at < r.num_cached and self.prefix.reserved_checkpoint(r.slot) != at:
            return  # inside the chunk, but no slot held its state: nothing to copy
        self._take(r, rolling=not ends, at=at)  # the last point is the prompt's end

    def _take(
        self, r: Request, rolling: bool, at: int | None = None, source: int | None = None
    ) -> None:
        """Share ``r``'s pages and checkpoint its state at ``at`` tokens (default
        ``r.num_cached``; ``source``: the Mamba virtual id holding that state when not
        its live slot); ``rolling`` (its prompt-end or a decode checkpoint): the
        request's previous such checkpoint, superseded, is dropped (a decode one) or
        demoted (the prompt-end one: a repeat of the prompt still hits it) and this
        one is its latest."""
        ids = self._known(r)  # its known tokens, converted once for the whole take
        at = r.num_cached if at is None else at
        turn_end = at > len(r.prompt_ids)
        first = lambda n: ids[:n] if n <= len(ids) else r.token_slice(0, n)
        previous = self.latest.get(r.slot) if rolling else None
        if previous == at:  # (one point taken twice: keep it)
            previous = None
        # the superseded one goes first, before the take's room evicts another's
        drop = bool(previous) and previous > len(r.prompt_ids)
        junction = self.junction.get(r.slot) == at
        if at <= len(ids):  # shared and taken in one chain walk (issue 41)
            taken = self.prefix.share_checkpoint(
                r.slot, ids, at, r.cache_salt, turn_end, source, previous or 0, drop, junction
            )
        else:
            self.prefix.insert(r.slot, ids, r.cache_salt)
            old = first(previous) if previous else None
            taken = self.prefix.checkpoint(
                r.slot, first(at), r.cache_salt, turn_end, source, supersedes=old, drop=drop,
                junction=junction,
            )  # fmt: skip
        if taken:
            self.since[r.slot] = at
            extended = self.extends.pop(r.slot, None)
            if extended:  # the previous turn's end: this conversation has moved on
                self.prefix.demote_checkpoint(first(extended), salt=r.cache_salt, slot=r.slot)
        if taken and rolling:
            self.latest[r.slot] = at

    def window_demand(self, r: Request, demand: dict, subpools, chunk: int) -> dict:
        """``demand`` with each windowed sub-pool's capped by ``r``'s worst case over
        all its tokens less the cached window pages its hit holds already (bound, not
        evictable): a hit's window is part of the window a lone request may hold, so a
        request that runs alone also runs alone with a hit (issue 41)."""
        if r.slot is None or not r.num_cached:
            return demand
        out, ps = dict(demand), self.page_size
        for s in subpools:
            if s.spec.sliding_window is None or s.spec.kind == "mamba":
                continue
            held = -(-r.num_cached // ps) - self.alloc.view.window_lo(r.slot, s.name)
            whole = worst_case_pages(s.spec, ps, r.num_cached + r.num_pending, chunk)
            out[s.name] = min(out[s.name], max(whole - held, 0))
        return out

    def share(self, r: Request) -> np.ndarray:
        """Share the full pages holding ``r``'s computed tokens (known ones: a
        ``Pending`` placeholder and what follows it stay out); returns those known
        tokens (host int64)."""
        known = self._known(r)
        self.prefix.insert(r.slot, known, r.cache_salt)
        return known

    def _known(self, r: Request) -> np.ndarray:
        """``r``'s first ``num_cached`` tokens up to the first unknown one (host int64),
        converted from the token lists only past what the last call kept (known tokens
        never change while the request holds its slot)."""
        held = self._ids.get(r.slot)
        ids = held[1] if held is not None and held[0] is r else _NONE
        n = r.num_cached
        if len(ids) >= n:
            return ids[:n]
        more = np.asarray(r.token_slice(len(ids), n), np.int64)
        unknown = np.flatnonzero(more < 0)
        ids = np.concatenate([ids, more[: unknown[0]] if len(unknown) else more])
        self._ids[r.slot] = (r, ids)
        return ids


def prefix_policy(
    alloc: PoolAllocator,
    caching: bool,
    has_state: bool,
    has_window: bool,
    rule: CheckpointRule | None = None,
):
    """``PrefixCaching`` (with the decode-checkpoint ``rule``, default
    ``CheckpointRule()``) when ``caching``, else ``NoPrefixCache``."""
    if caching:
        return PrefixCaching(alloc, has_state, has_window, rule)
    return NoPrefixCache(alloc)
