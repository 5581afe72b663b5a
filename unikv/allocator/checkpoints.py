"""Recurrent-state checkpoints of the prefix cache (hybrid models, issue 17).

A Mamba / Gated DeltaNet request's state after ``k`` whole pages is what a
prefix hit of ``k`` pages needs; one state slot (page size 1) is the conv and
temporal state of every linear layer in ONE contiguous envelope, so a
checkpoint is one envelope copy (``UnifiedPool.move_pages``, as compaction does;
no host sync, no loop over layers).

    Mamba virtual ids:  0 sink | 1..R request slots (slot + 1) | R+1.. checkpoints
    checkpoint = (node id of the hash-chain node of block k-1, virtual id)

Policy and cost: at most three times per admission: when a request's prefill
reaches (a) the end of the cached page run it matched, if that run is longer
than its hit (the point where it diverges from an earlier prompt: a shared
system prompt), and (b) the last whole page before its last token (``k =
(seq_len - 1) // ps``, the longest hit a repeat of its tokens can take), the
scheduler ends a prefill chunk there; and (c) when its decode completes a page and
the cost rule says it pays (``engine/checkpoint_rule.py``; always at the last page
``max_tokens`` reaches), rolling: the new one drops the request's previous decode
checkpoint, so the next turn of a chat, which repeats prompt and answer, hits both up
to the last one taken (a turn end, ``turn_ends``; the next turn demotes it once it
takes its own). Each records the tokens it was taken after (``position``). There the
request's state slot is copied into a spare slot keyed by that block's node: ``spec.entry_bytes``
bytes and one Mamba slot per checkpoint, the copies of one step in one launch
(``PrefixVerbs.batched`` queues them, ``flush`` binds and copies them together),
at most one extra prefill chunk per
boundary (none for (c)). A hit restores
it into the new request's slot with one copy (``MambaSlots.alloc``; the slot is not
zeroed first: the copy writes its whole envelope) and prefills only the rest. A hit needs a checkpoint at its last block
(``PrefixCache.match`` falls back to the longest such prefix, or a miss).

A checkpoint is never read by a running request (a hit copies it), so it is
evictable unless a request opened with a hit still waits for its restore
(``pending``: pinned until ``alloc_mamba`` or ``free_request``). Evictable
ones are LRU; the node's eviction drops its checkpoint; the room maker evicts
them when the Mamba sub-pool is short (or nothing else is left), and the
capacity oracle counts them as holes, as it counts cached pages.

Superseded first: when a request takes its first (c), its (b) is ``demote``-d to the
front of the LRU (the next turn of a chat hits (c); (b) serves only a repeat of that
prompt), and the room maker evicts demoted checkpoints before any cached page,
whatever sub-pool is short: one holds a state slot's bytes (50 pages' worth on the
Qwen3.5 shape), while an evicted page breaks a chain; one at a time, so no more go than
the shortfall needs. On bench_prefix's hybrid chat in the scheduler-level simulation
(``benchmarks/sim_prefix_hybrid_chat.py``; it ignores EOS, so the earlier rule, one (c)
at the last page before ``max_tokens``, fared as well there) the hit rate went from
46.6 % to 51.4 % at 1.25x the pool (evicted pages 747 -> 554) and from 75.0 % to
80.1 % at 2x (113 -> 0, the whole-page ceiling of the workload).

Expected first-hand (issue 41): a waiting request's prompt marks the checkpoint it
would restore (``want``, from ``PrefixVerbs.expect`` when the scheduler adds it; undone
when it opens or is aborted); the room maker evicts every other one first
(``victims``), so admitting one conversation's turn does not evict the turn end that
another waiting turn of the same round would hit.

Carried turn ends (issue 41): a turn end (decode checkpoint) taken by a request that
opened with a hit (``hit_slots``, from ``pin`` until its state slot is freed) is
``carried``: its conversation hit once and its next turn will likely hit this one. Its
chain's pages go after the pages of plain chains and before a junction's
(``prefix_evict.evict_lru``), so round-robin chat over more conversations than the pool
holds keeps the ones that hit instead of evicting each just before its next turn
(``bench_prefix_sim --compare-vllm``, chat at 4x the pool: 3.4 % -> 11.4 %).

Written by the chunk itself (issue 41): a prefill chunk that ends at a point (a) or
(b) needs no copy. Before its step the scheduler reserves a checkpoint slot for it
(``reserve_direct``: bound, keyed by the request slot and the tokens the chunk ends
at, no node yet: its pages are not shared before they are written); the step's plan
names that slot as each recurrent op's second destination of the final state
(``ckpt_slots``, ``kernels/recurrent/ref.py``), and the take after the step adopts it
(``save``: no copy queued). A reservation the take does not adopt (the node had one,
no room, the node was evicted) or whose request is freed first is released
(``release_direct``). Decode checkpoints (c) and chunks of one token keep the copy.

With a host tier (``host``, ``io/prefix_host.py``) an evicted checkpoint of a
reachable node spills to a host slot instead (one envelope copy) and a hit
restores it from there straight into the request's slot (one copy); a node's
checkpoint lives in one place, the device or the host.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from unikv.allocator.fences import FenceQueue
from unikv.allocator.pages import LIVE, PageBook
from unikv.allocator.tables import TablePatch, TableWriter
from unikv.ids import PhysicalPageIds
from unikv.pool import UnifiedPool

if TYPE_CHECKING:
    from unikv.allocator.parts import Parts


class StateCheckpoints:
    """Checkpoint slots of one Mamba sub-pool, keyed by prefix node id.

    ``base``: the first checkpoint virtual id (max_requests + 1). It holds no part
    above it: ``save`` takes the room maker's reserve as an argument."""

    def __init__(
        self,
        pool: UnifiedPool,
        book: PageBook,
        base: int,
        fences: FenceQueue,
        writer: TableWriter,
    ) -> None:
        self.pool, self.book, self.base = pool, book, base
        self.fences, self.writer = fences, writer
        self.by_node: dict[int, int] = {}  # node id -> checkpoint virtual id
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable node ids, oldest first
        self.demoted: set[int] = set()  # superseded node ids (``demote``), first in ``lru``
        self.pending: dict[int, int] = {}  # request slot -> node id to restore
        self.pins: Counter[int] = Counter()  # node id -> pending restores
        # node id -> tokens the state had seen when copied (a hit restores it only at
        # that length: ``pin``; stale entries of host-dropped ones are pruned on save)
        self.position: dict[int, int] = {}
        self.turn_ends: set[int] = set()  # node ids of decode (turn-end) checkpoints
        # node id -> waiting requests whose prompt hits it (``want``): evicted last
        self.wanted: Counter[int] = Counter()
        # node ids of shared junction checkpoints (``junctions``): taken where a prompt
        # left a cached run it matched (two prompts share the prefix, then diverge), or
        # restored by a hit; their chains' pages go after the rest (``evict_lru``)
        self.shared: set[int] = set()
        self.reused: set[int] = set()  # node ids of checkpoints a hit restored
        self.hit_slots: set[int] = set()  # request slots that opened with a hit (``pin``)
        # node ids of turn ends taken by a request that opened with a hit (``carried``):
        # a conversation that hit once; its chain's pages go after plain ones
        self.carried: set[int] = set()
        self.free_vids = list(range(book.num_virtual - 1, base - 1, -1))  # pop() gives the lowest
        self.saved = self.restored = self.evicted = 0
        # a request's own checkpoints a later take of it superseded and dropped (its
        # slot re-keyed or freed): the policy's choice, not room made, so not ``evicted``
        # (the cost rule reads that as pressure: ``PrefixVerbs.evicted``)
        self.superseded = 0
        # checkpoints the room maker evicted for a take (``save``), the one it
        # supersedes not counted: another chain's, which a later hit may have wanted
        self.evicted_by_takes = 0
        # (source vid, checkpoint vid) of taken checkpoints whose table bind and copy
        # are deferred (``deferring``: inside ``PrefixVerbs.batched``) to ``flush``: one
        # table write and one copy for every checkpoint of a step
        self.queued: list[tuple[int, int]] = []
        self.deferring = False
        # request slot -> (checkpoint virtual id, tokens) reserved for the prefill chunk
        # that ends at that many tokens to write its final state into (``reserve_direct``)
        self.direct: dict[int, tuple[int, int]] = {}
        self.copied = 0  # checkpoints taken by a slot copy (``flush``)
        self.written = 0  # checkpoints the prefill chunk wrote itself (adopted reservations)
        self.host: Any = None  # the prefix cache's host tier (io.prefix_host.PrefixHost), if any

    def has(self, node_id: int, host: bool) -> bool:
        """Whether node ``node_id`` has a checkpoint (on the device, or ``host``: on either)."""
        return node_id in self.by_node or (
            host and self.host is not None and node_id in self.host.ckpts
        )

    def nodes(self) -> list[int]:
        """The node ids with a checkpoint, on the device or the host."""
        return list(self.by_node) + (list(self.host.ckpts) if self.host is not None else [])

    @property
    def num_evictable(self) -> int:
        return len(self.lru)

    def save(
        self,
        slot: int,
        node_id: int,
        alive: Callable[[], bool],
        tokens: int,
        reserve: Callable[[Mapping[str, int]], bool],
        turn_end: bool = False,
        source: int | None = None,
        supersedes: int | None = None,
        drop: bool = False,
        junction: bool = False,
    ) -> bool:
        """Copy request ``slot``'s state slot (after its first ``tokens`` tokens) into
        a checkpoint of ``node_id``; False when the chain has no room
        (``reserve(new) -> bool``: the room maker's, no shortfall callback), the
        request holds no slot, or ``alive()`` says the node was evicted while making
        room; ``turn_end``: a decode checkpoint (``turn_ends``); ``source``: the virtual
        id of the slot holding that state, when not the request's live one (a
        per-draft-position slot of a verify step).

        ``supersedes``: the node id of the same request's checkpoint this one replaces
        (its previous rolling one); ``drop``: it is dropped (else demoted) once this one
        is taken. A dropped one gives the take its slot (re-keyed, before any room is
        made), so the take evicts no other chain's checkpoint while a superseded one
        holds a slot (issue 41); a take the chunk wrote itself drops it first (a failed
        save after that leaves it dropped: the request has moved past it). A demoted one (a
        prompt end: a repeat of the prompt still hits it) is demoted after the take, as
        demoting it first cost hit rate in ``sim_prefix_hybrid_chat`` (51.4 % -> 46.1 %).
        Pinned (a request waits to restore it): left alone. ``junction``: the point
        where the request's prompt left a cached run it matched (``shared``)."""
        old = supersedes if supersedes != node_id and supersedes in self.lru else None
        # the slot the chunk that ends here wrote the state into (``reserve_direct``)
        held_direct = self.direct.get(slot) if source is None else None
        written = held_direct[0] if held_direct is not None and held_direct[1] == tokens else None
        if node_id in self.by_node or self.has(node_id, True):  # (host: restored from there)
            if junction:
                self.shared.add(node_id)
            if node_id in self.lru:
                self.lru.move_to_end(node_id)
                self.demoted.discard(node_id)  # used again: no longer superseded
            self._retire(old, drop)
            self.release_direct([slot], tokens)
            return True
        vid_src = np.array([slot + 1 if source is None else source], np.int32)
        held = self.book.physical(vid_src)[0] >= 0
        # a rolling take copies into the slot of the checkpoint it drops (re-keyed: no
        # unbind, no fence, no room to make; the copy runs after every earlier reader
        # of it in stream order). issue 41: a dropped slot stays fenced while the
        # forward runs, so making room for a new one evicted other checkpoints
        reuse = old is not None and drop and written is None
        if not held or (written is None and not reuse and not self.free_vids) or not alive():
            return False
        if reuse:
            assert old is not None, "checkpoint invariant: a reused slot is the superseded one's"
            vid_old = self._rekey(old)
            self._queue(int(vid_src[0]), vid_old)
            self._keep(slot, node_id, vid_old, tokens, turn_end, junction)
            return True
        if old is not None and drop:
            self.drop([old], superseded=True)  # its slot is the take's room
        if written is None:
            evicted = self.evicted
            room = reserve({self.book.name: 1})
            self.evicted_by_takes += self.evicted - evicted
            if not room or not alive():
                return False
        self._retire(old, drop)
        if written is not None:  # the bytes are there already: adopt the slot
            del self.direct[slot]
            vid = np.array([written], np.int32)
            self.written += 1
        else:
            vid = np.array([self.free_vids.pop()], np.int32)
            self.book.bind_host(vid, self.book.take(1))
            self._queue(int(vid_src[0]), int(vid[0]))
        self._keep(slot, node_id, int(vid[0]), tokens, turn_end, junction)
        return True

    def _queue(self, src: int, vid: int) -> None:
        """Copy Mamba virtual id ``src``'s state into checkpoint ``vid`` (bound): at
        ``flush``, with the step's others (``deferring``), else now."""
        self.queued.append((src, vid))
        if not self.deferring:
            self.flush()

    def _rekey(self, node_id: int) -> int:
        """Node ``node_id``'s checkpoint slot, taken from it (still bound) for a take
        that supersedes it; counted as ``superseded``, not evicted: no room was made
        (the cost rule's pressure signal reads the evictions)."""
        vid = self.by_node.pop(node_id)
        self._cancel({vid})  # a copy into it queued this step: overwritten unread
        self.flush_for([vid])  # one reading it: bytes first
        self._forget(node_id)
        self.superseded += 1
        return vid

    def _keep(
        self, slot: int, node_id: int, vid: int, tokens: int, turn_end: bool, junction: bool
    ) -> None:
        """Record checkpoint ``vid`` of node ``node_id``, taken by request ``slot``
        after ``tokens`` tokens (``save``'s bookkeeping)."""
        self.by_node[node_id] = vid
        self.lru[node_id] = None
        if len(self.position) > 2 * len(self.by_node) + 64:  # prune host-dropped ones
            self.position = {n: self.position[n] for n in self.nodes() if n in self.position}
            self.turn_ends &= set(self.position)
            self.shared &= set(self.position)
            self.reused &= set(self.position)
            self.carried &= set(self.position)
        self.position[node_id] = tokens
        if turn_end:
            self.turn_ends.add(node_id)
            if slot in self.hit_slots:
                self.carried.add(node_id)
        if junction:
            self.shared.add(node_id)
        self.saved += 1

    def reserve_direct(
        self, slot: int, tokens: int, reserve: Callable[[Mapping[str, int]], bool]
    ) -> bool:
        """Bind a checkpoint slot for request ``slot``'s prefill chunk that ends at
        ``tokens`` tokens (a checkpoint point) to write its final state into, so the
        take after the step (``save``) needs no copy; False (nothing reserved) when
        the request holds no state slot, no checkpoint id is free or ``reserve`` (the
        room maker's: older checkpoints may go) finds no room. One per request: a
        reservation at other tokens is released first."""
        held = self.direct.get(slot)
        if held is not None:
            if held[1] == tokens:
                return True
            self.release_direct([slot])
        live = self.book.physical(np.array([slot + 1], np.int32))[0] >= 0
        if not live or not self.free_vids:
            return False
        evicted = self.evicted
        room = reserve({self.book.name: 1})
        self.evicted_by_takes += self.evicted - evicted  # (as ``save`` counts its room)
        if not room:
            return False
        vid = np.array([self.free_vids.pop()], np.int32)
        dst = self.book.take(1)
        self.book.bind_host(vid, dst)
        patch = TablePatch()
        v, p = patch.part(vid), patch.part(self.book.physical(vid))
        patch.add(self.writer.v2p_id[self.book.name], v, p)
        patch.add(self.writer.p2v_id[self.book.name], p, v)
        self.writer.stage(patch)  # (in a step's ``batched`` scope: one write for all)
        self.direct[slot] = (int(vid[0]), tokens)
        return True

    def direct_slots(
        self, slots: np.ndarray, ends: np.ndarray, starts: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """((B,) int64 physical checkpoint slots, (B,) int64 rows) reserved for requests
        ``slots`` whose step ends at ``ends`` tokens (host ints; slot 0, the sink, for
        the others), or None when no request of them has one (no work: the common
        step). ``starts``: the tokens each held before the step, and a reservation
        at any tokens in ``(start, end]`` matches (a checkpoint inside the chunk,
        issue 41); its row is ``tokens - start - 1``, -1 where it is the chunk's end
        (and for the other lanes)."""
        if not self.direct:
            return None
        keys = np.fromiter(self.direct, np.int64, len(self.direct))
        vals = np.array(list(self.direct.values()), np.int64).reshape(-1, 2)
        ends = np.asarray(ends, np.int64)
        at = vals[None, :, 1]
        match = np.asarray(slots, np.int64)[:, None] == keys[None, :]
        if starts is None:
            match &= ends[:, None] == at
        else:
            match &= (np.asarray(starts, np.int64)[:, None] < at) & (at <= ends[:, None])
        lane, col = np.nonzero(match)
        if not len(lane):
            return None
        out, rows = np.zeros(len(slots), np.int64), np.full(len(slots), -1, np.int64)
        out[lane] = self.book.physical(vals[col, 0].astype(np.int32))
        if starts is not None:
            tokens = vals[col, 1]
            inside = tokens < ends[lane]
            rows[lane[inside]] = tokens[inside] - np.asarray(starts, np.int64)[lane[inside]] - 1
        return out, rows

    def release_direct(self, slots: Iterable[int], tokens: int | None = None) -> None:
        """Release the reservations of requests ``slots`` (``tokens``: only one at that
        many tokens), fenced by the forward that may still write them."""
        vids = []
        for slot in slots:
            held = self.direct.get(int(slot))
            if held is not None and (tokens is None or held[1] == tokens):
                del self.direct[int(slot)]
                vids.append(held[0])
        if vids:
            array = np.array(vids, np.int32)
            self.writer.unbind(self.book, array, self.fences.unbind(self.book, array))
            self.free_vids.extend(vids)

    def _retire(self, old: int | None, drop: bool) -> None:
        """After a save that replaced ``old`` (None: none): drop it (``drop``) or
        demote it, if it is still evictable here."""
        if old is not None and old in self.lru:
            if drop:
                self.drop([old], superseded=True)
            else:
                self.demote(old)

    def flush(self) -> None:
        """Bind and copy the queued checkpoints: one table write (their v2p / p2v
        entries, with the source slots as data) and one envelope copy for all. Sources
        and checkpoint slots are looked up by virtual id now, so a compaction since
        they were queued (it moves bytes and bindings alike) is followed. Called before
        anything reads, spills, frees or rebinds a slot (``drop``, ``evict``,
        ``restore``, ``MambaSlots.free_bound`` / ``select``)."""
        if not self.queued:
            return
        queued, self.queued = np.array(self.queued, np.int32), []
        book = self.book
        src, dst = book.physical(queued[:, 0]), book.physical(queued[:, 1])
        assert (src > 0).all() and (dst > 0).all(), (
            "deferred checkpoint copies: each source and checkpoint slot is still bound"
        )
        patch = TablePatch()
        v, p = patch.part(queued[:, 1]), patch.part(dst)
        patch.add(self.writer.v2p_id[book.name], v, p)
        patch.add(self.writer.p2v_id[book.name], p, v)
        written = self.writer.write(patch)  # with the step's staged drops and evictions
        self._copy(src.astype(np.int64), PhysicalPageIds(written[p], book.name))
        self.copied += len(queued)

    def _cancel(self, vids: set[int]) -> None:
        """Take the queued copies into checkpoint slots ``vids`` (dropped before the
        step's ``flush``: a take of the same step that evicted one for its room) off
        the queue: no bytes to keep, so no flush mid-step, which cost a second table
        write and copy in the step (issue 41). Their slots' binds were host-only."""
        if self.queued and vids:
            self.queued = [pair for pair in self.queued if pair[1] not in vids]

    def flush_for(self, vids: Iterable[int]) -> None:
        """``flush`` if a queued checkpoint reads or writes one of Mamba virtual ids
        ``vids`` (its source or its slot), so the others of the step stay in one copy."""
        if self.queued:
            touched = {v for pair in self.queued for v in pair}
            if not touched.isdisjoint(int(v) for v in vids):
                self.flush()

    def demote(self, node_id: int) -> None:
        """Make node ``node_id``'s checkpoint, if evictable here, the first to go (a
        longer checkpoint of the same request superseded it)."""
        if node_id in self.lru:
            self.lru.move_to_end(node_id, last=False)
            self.demoted.add(node_id)

    @property
    def num_demoted(self) -> int:
        """Evictable checkpoints a longer one superseded: the first of the LRU."""
        return len(self.demoted)

    def want(self, node_id: int, count: int = 1) -> None:
        """``count`` more (negative: fewer) waiting requests expect to hit node
        ``node_id``'s checkpoint: the room maker evicts those no one expects first
        (``victims``), so one request's admission does not evict the turn end that
        the next waiting turn of another conversation would hit (issue 41)."""
        if node_id not in self.by_node and node_id not in self.wanted:
            return  # gone meanwhile (its drop forgot it)
        self.wanted[node_id] += count
        if self.wanted[node_id] <= 0:
            del self.wanted[node_id]

    def junctions(self) -> set[int]:
        """The ``shared`` node ids less turn ends (decode checkpoints): a turn end a
        hit restored is its conversation's, whose next turn takes a later one."""
        return self.shared - self.turn_ends

    def victims(self, count: int) -> list[int]:
        """The ``count`` evictable checkpoints to go first: LRU order (demoted ones
        lead it), junctions a hit restored (``reused``, turn ends aside) after the
        rest, those a waiting request expects to hit (``wanted``) last. A junction no
        hit restored yet is no exception here: in ``sim_prefix_hybrid_chat`` (1.25x),
        where a chat turn whose previous turn end went but whose pages stayed takes
        one, keeping those evicted the turn ends instead (hit rate 67.3 % -> 45.2 %)."""
        if not self.wanted and not self.reused:
            return list(self.lru)[:count]
        wanted, demoted, shared = self.wanted, self.demoted, self.reused - self.turn_ends
        rank = lambda i: 2 if i in wanted else int(i in shared and i not in demoted)
        return sorted(self.lru, key=rank)[:count]  # (stable: LRU order within a rank)

    def pin(self, slot: int, node_id: int, tokens: int) -> None:
        """Request ``slot`` opened with a hit of ``tokens`` tokens ending at
        ``node_id``: keep its checkpoint until ``restore`` (or ``unpin``)."""
        assert self.position.get(node_id) == tokens, (
            f"a hit restores a checkpoint taken at its own length: the hit has {tokens} "
            f"tokens, the checkpoint of node {node_id} was taken at "
            f"{self.position.get(node_id)}"
        )
        self.pending[slot] = node_id
        self.pins[node_id] += 1
        self.lru.pop(node_id, None)
        self.demoted.discard(node_id)  # a hit wants it
        self.shared.add(node_id)  # and two requests have used it: a shared junction
        self.reused.add(node_id)
        self.hit_slots.add(slot)  # its turn ends are ``carried``

    def slots_freed(self, slots: np.ndarray) -> None:
        """Requests ``slots`` (host int64) gave their state slots back: they wait for
        no restore (``unpin``), their chunk's reserved checkpoint goes
        (``release_direct``) and their turn ends are no longer ``carried``."""
        self.unpin(slots)
        listed = slots.tolist()
        self.release_direct(listed)
        self.hit_slots.difference_update(listed)

    def unpin(self, slots: np.ndarray) -> None:
        """Requests ``slots`` (host ints) no longer wait for a restore."""
        for slot in slots.tolist():
            node_id = self.pending.pop(slot, None)
            if node_id is None:
                continue
            self.pins[node_id] -= 1
            if not self.pins[node_id]:
                del self.pins[node_id]
                if node_id in self.by_node:  # else on the host (its LRU there)
                    self.lru[node_id] = None  # the most recently used

    def restoring(self, slots: np.ndarray) -> np.ndarray:
        """(B,) host bool: which requests of ``slots`` ((B,) host ints) ``restore`` fills
        from a device checkpoint (one whole-envelope copy: their new slots need no
        zeroing first, ``MambaSlots.alloc``); a host checkpoint's lane is False."""
        pending, here = self.pending, self.by_node
        return np.fromiter((pending.get(s, -1) in here for s in slots.tolist()), bool, len(slots))

    def restore(self, slots: np.ndarray) -> None:
        """Copy the pinned checkpoints of ``slots`` ((B,) host ints) into their
        freshly bound state slots (zeroed, but for those ``restoring`` names: the
        copy covers the whole envelope), then unpin them. The destinations are read
        from the host mirror: one upload of sources and destinations, one copy."""
        lanes = [i for i, s in enumerate(slots.tolist()) if s in self.pending]
        if not lanes:
            return
        self.flush_for(self.by_node.get(self.pending[int(slots[i])], -1) for i in lanes)
        nodes = [self.pending[int(slots[i])] for i in lanes]
        here = [i for i, n in zip(lanes, nodes) if n in self.by_node]
        if here:
            vids = np.array([self.by_node[self.pending[int(slots[i])]] for i in here], np.int32)
            src = self.book.physical(vids).astype(np.int64)
            dst = self.book.physical((slots[here] + 1).astype(np.int32)).astype(np.int64)
            assert (src > 0).all() and (dst > 0).all(), (
                "checkpoint restore invariant: each checkpoint and new state slot is bound"
            )
            self._copy(src, dst)
        away = [i for i, n in zip(lanes, nodes) if n not in self.by_node]
        if away:  # host checkpoints, into the slots' physical pages (host mirror)
            held = self.book.physical((slots[away] + 1).astype(np.int32))
            self.host.restore_checkpoints([self.pending[int(slots[i])] for i in away], held)
        self.restored += len(lanes)
        self.unpin(slots[lanes])

    def _copy(self, src: np.ndarray, dst: PhysicalPageIds | np.ndarray) -> None:
        """Envelope copies ``src -> dst`` (host int64 physical slots; ``dst`` on the
        device, or on the host too: then both go up in one upload)."""
        name = self.book.name
        if isinstance(dst, np.ndarray):
            both, n = self.writer.upload([src, dst], wide=True), len(src)
            src_ids, dst_ids = PhysicalPageIds(both[:n], name), PhysicalPageIds(both[n:], name)
            self.pool.move_pages(name, src_ids, dst_ids, check=False)
            return
        wide = dst.data.dtype == torch.int64  # uploaded in dst's dtype: no widening launch
        ids = PhysicalPageIds(self.writer.upload(src, wide=wide), name)
        self.pool.move_pages(name, ids, dst, check=False)

    def drop(self, node_ids: list[int], superseded: bool = False) -> None:
        """Free the checkpoints of ``node_ids`` that have one (their nodes are gone,
        or, ``superseded``, a later take of the same request replaced them: counted
        apart from evictions). A copy into one of their slots queued this step is not
        made (``_cancel``): its bytes would go unread."""
        self._cancel({self.by_node[i] for i in node_ids if i in self.by_node})
        self.flush_for(self.by_node.get(i, -1) for i in node_ids)
        if self.host is not None:
            self.host.drop_checkpoints(node_ids)
        vids = [self.by_node.pop(i) for i in node_ids if i in self.by_node]
        for i in node_ids:
            self._forget(i)
        if vids:
            array = np.array(vids, np.int32)
            self.writer.unbind(self.book, array, self.fences.unbind(self.book, array))
            self.free_vids.extend(vids)
            if superseded:
                self.superseded += len(vids)
            else:
                self.evicted += len(vids)

    def _forget(self, node_id: int) -> None:
        """Drop node ``node_id`` from every mark (its slot is dropped or re-keyed)."""
        self.position.pop(node_id, None)
        self.turn_ends.discard(node_id)
        self.wanted.pop(node_id, None)
        self.lru.pop(node_id, None)
        self.demoted.discard(node_id)
        self.shared.discard(node_id)
        self.reused.discard(node_id)
        self.carried.discard(node_id)

    def evict(self, count: int, reachable: Callable[[list[int]], list[bool]] | None = None) -> int:
        """Drop the ``count`` oldest evictable checkpoints (at most all); returns how
        many. ``reachable``: the prefix cache's ``reachable_many`` (node ids -> whether
        a lookup reaches each, each ancestor walked once), passed by the caller so the checkpoints hold nothing above them; with a
        host tier the reachable ones go to the host (None: none is spilled)."""
        victims = self.victims(count)
        if reachable is not None and self.host is not None and victims:  # spill first
            self.flush_for(self.by_node[i] for i in victims)  # one queued this step: bytes first
            vids = np.array([self.by_node[i] for i in victims], np.int32)
            marks = np.array(reachable(victims), bool)
            copy = self.host.spill_checkpoints(self, victims, vids, marks)
            spilled = [i for i in victims if i in self.host.ckpts]
            for i in spilled:  # their device slots go (once copied); the host keeps them
                self.lru.pop(i)
                self.demoted.discard(i)
                self._free_device(i, copy)
            victims = [i for i in victims if i not in self.host.ckpts]
            self.drop(victims)
            return len(victims) + len(spilled)
        self.drop(victims)
        return len(victims)

    def _free_device(self, node_id: int, copy: Any = None) -> None:
        """Free node ``node_id``'s device slot, fenced by ``copy`` (the done-event of
        a copy still reading it) as well as by the forward."""
        vid = np.array([self.by_node.pop(node_id)], np.int32)
        self.writer.unbind(self.book, vid, self.fences.unbind(self.book, vid, copy, spill=True))
        self.free_vids.append(int(vid[0]))
        self.evicted += 1

    def evictable_physical(self) -> np.ndarray:
        """Physical slots evicting every evictable checkpoint frees (host int64, unpinned)."""
        if not self.lru:
            return np.zeros(0, np.int64)
        vids = np.array([self.by_node[i] for i in self.lru], np.int32)
        ppages = self.book.physical(vids).astype(np.int64)
        return ppages[self.book.pins[ppages] == 0]


def check_checkpoints(parts: Parts) -> None:
    """Invariants of the state checkpoints (``parts``: the allocator's ``Parts``)."""
    states, prefix = parts.prefix.states, parts.prefix
    assert states is not None, "check_checkpoints: the pool has state checkpoints"
    book = states.book
    vids = np.array(sorted(states.by_node.values()), np.int64)
    ppages = book.v2p_host[vids]
    assert (ppages > 0).all() and (book.state[ppages] == LIVE).all(), (
        "checkpoint slots are LIVE Mamba slots owned by the cache"
    )
    bound = np.flatnonzero(book.v2p_host[states.base :] >= 0) + states.base
    direct = sorted(v for v, _ in states.direct.values())
    assert np.array_equal(bound, np.union1d(vids, direct)) and not (
        set(states.free_vids) & (set(vids.tolist()) | set(direct))
    ), (
        "checkpoint virtual ids are bound exactly while the cache holds them or a prefill "
        "chunk's reservation does"
    )
    assert not set(direct) & set(vids.tolist()), "a reserved checkpoint slot is not a cached one"
    reserved = np.array(direct, np.int64)
    assert (book.v2p_host[1 : states.base][:, None] != book.v2p_host[reserved][None, :]).all(), (
        "no request slot aliases a reserved checkpoint slot"
    )
    host = prefix.host.nodes if prefix.host is not None else {}
    device = {n.node_id: n for n in prefix.by_page.values()}
    assert set(states.nodes()) <= set(device) | set(host), "each checkpoint's node exists"
    assert set(device).isdisjoint(host) and set(device) | set(host) == set(prefix.by_id), (
        "the prefix nodes by id are the live nodes (on the device or the host)"
    )
    assert all(prefix.reachable(n) for n in states.nodes()), (
        "each checkpoint is reachable from the root (every ancestor node is live)"
    )
    held = book.v2p_host[1 : states.base]
    assert not set(held[held >= 0].tolist()) & set(ppages.tolist()), (
        "no request slot aliases a checkpoint slot"
    )
    pinned_here = set(states.pins) & set(states.by_node)
    assert set(states.lru) | pinned_here == set(states.by_node) and not (
        set(states.lru) & set(states.pins)
    ), "evictable checkpoints are exactly those no opening request waits to restore"
    assert set(states.pins) <= set(states.nodes()), (
        "a checkpoint an opening request waits to restore exists (device or host)"
    )
    assert Counter(states.pending.values()) == states.pins, (
        "checkpoint pins count the opening requests waiting to restore them"
    )
    # (a host tier drops its own checkpoints under its pressure: an entry may outlive one)
    wanted_exist = states.host is not None or set(states.wanted) <= set(states.nodes())
    assert wanted_exist and min(states.wanted.values(), default=1) > 0, (
        "checkpoints waiting requests expect to hit exist, each expected at least once"
    )
    assert states.carried <= states.turn_ends, "carried checkpoints are turn ends"
    assert states.hit_slots <= set(range(states.base - 1)), (
        "slots that opened with a hit are request slots"
    )
    assert set(list(states.lru)[: len(states.demoted)]) == states.demoted, (
        "demoted checkpoints are evictable and the first of the LRU"
    )
    ps, by_id = prefix.roles.page_size, prefix.by_id
    for node_id in states.nodes():
        depth, walk = 0, node_id
        while walk:
            depth, walk = depth + 1, by_id[walk].parent_id
        assert states.position.get(node_id) == depth * ps, (
            "each checkpoint was taken at its node's position (its chain's tokens)"
        )
