"""Prefix caching: full pages of a prompt shared by reference across requests.

    block i of a request = tokens [i*ps, (i+1)*ps) = virtual page pages[r, i]
    key(i)  = hash((key(i-1), block tokens)),  key(-1) = 0 (or the salt's key)
    node    = (node id, parent node id, key, virtual page, block tokens)

A page is *cached* once ``insert`` gave it to the cache: its virtual
space owner becomes ``CACHED``, ``refs[page]`` counts the request tables that
hold it, and the page is never written again (a hit covers whole pages only; a
request writes its own next page; ``truncate`` refuses to cut into one). At
``refs == 0`` the page is *evictable*; eviction (LRU, leaves first) unbinds it
everywhere and drops its node (``prefix_evict.py``, this cache's base class).
A hit never trusts a hash: each block's tokens are compared, and each
node names its parent by node id (ids are never reused), so a node found by a
colliding key, or one whose parent was evicted, does not match.

Cache salt (vLLM's per-request ``cache_salt``, a tenant's secret): the chain
verbs take ``salt`` (None: unsalted). It is hashed into key(-1) and a first
block's node keeps it and is compared to it, so chains of different salts never
share a node, and the nodes below a first block inherit its salt by parent id.

Which chain walks make a usable hit (sliding windows intact, a state
checkpoint at its end) and the node records: ``prefix_chain.py``. Recurrent
state: ``attach`` pins the hit's checkpoint for ``alloc_mamba`` to restore, and a
node's eviction drops its checkpoint (``checkpoints.py``). Host tier
(``io/prefix_host.py``, when ``host`` is set): eviction spills a reachable
node's envelopes to host slots and keeps the node (``page = HOST``); ``match``
walks device and host nodes alike, ``reload`` brings a hit's host part back (or
chooses recompute by cost, or falls back to the device-only prefix).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from unikv.allocator.checkpoints import StateCheckpoints
from unikv.allocator.fences import FenceQueue
from unikv.allocator.pages import PageBook
from unikv.allocator.prefix_chain import (
    CACHED,
    HOST,
    ChainNode,
    PrefixHit,
    chain_hit,
    check_prefix_windows,
    reachable,
    reachable_many,
)
from unikv.allocator.prefix_evict import (
    evict_dead,
    evict_lru,
    evict_pages,
    evict_windows,
    evictable_physical,
    release_pages,
    reset_cache,
    stage_unbind,
)
from unikv.allocator.requests import RequestTable, Roles, VirtualSpace
from unikv.allocator.tables import TablePatch, TableWriter

# re-exported: the allocator, the host tier and tests import them from here
__all__ = ["CACHED", "HOST", "PrefixCache", "PrefixHit", "check_prefix_windows", "stage_unbind"]


@dataclass
class PrefixStats:
    """Counters since construction (host ints)."""

    queries: int = 0  # admissions with a prefix lookup (a given-up one is uncounted)
    query_tokens: int = 0  # tokens those lookups covered
    hit_tokens: int = 0  # of them, tokens served from cached pages
    cached_pages: int = 0  # pages given to the cache
    evicted_pages: int = 0  # cached pages evicted
    evicted_windows: int = 0  # window bindings of cached pages evicted alone
    checkpoints: int = 0  # recurrent-state checkpoints taken (copies)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class PrefixCache:
    """The hash chain of cached pages, their reference counts and the LRU.

    Its public verbs are ``alloc.prefix`` (``verbs.PrefixVerbs``, which adds the
    facade's debug-mode ``check_integrity`` and the room maker's reserve):
    ``match`` a prompt, pass the hit to ``alloc.new_request(prefix=hit)``,
    ``insert`` a request's written pages, ``checkpoint`` a hybrid request's state,
    read ``counters()``. ``states``: the Mamba sub-pool's checkpoints. It holds no
    part above it: room-making reaches it as an argument (``reload``, ``checkpoint``)."""

    def __init__(
        self,
        roles: Roles,
        requests: RequestTable,
        vspace: VirtualSpace,
        books: dict[str, PageBook],
        fences: FenceQueue,
        writer: TableWriter,
        states: StateCheckpoints | None = None,
    ) -> None:
        self.roles, self.requests, self.vspace, self.books = roles, requests, vspace, books
        self.fences, self.writer, self.states = fences, writer, states
        self.refs = np.zeros(vspace.size, np.int32)  # request tables holding each cached page
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, oldest first
        self.by_key: dict[int, ChainNode] = {}
        self.by_page: dict[int, ChainNode] = {}
        self.by_id: dict[int, ChainNode] = {}  # the live nodes by node id
        # per windowed sub-pool: open requests whose window holds each cached page
        # (column >= window_lo), and when it last dropped to none (the window LRU)
        self.wrefs = {n: np.zeros(vspace.size, np.int32) for n in roles.windows}
        self.wtime = {n: np.zeros(vspace.size, np.int64) for n in roles.windows}
        self.ends: set[int] = set()  # node ids where an insert ended (a prompt's end)
        # request slot -> (blocks, node id, key, salt) of the chain end its last insert
        # reached: a later insert, checkpoint or demote of that request's own tokens
        # resumes there instead of hashing its whole context again (``_resume``)
        self.tails: dict[int, tuple[int, int, int, str | None]] = {}
        self._tick = 0
        self.stats = PrefixStats()
        self._next_id = 1  # node id 0 is the root
        # node ids known reachable while no node left ``by_id`` since (``reachable``)
        self._reach_stamp, self._reached = 1, set[int]()
        self.host: Any = None  # the host tier (io.prefix_host.PrefixHost): add_host_tier

    @property
    def num_evictable(self) -> int:
        return len(self.lru)

    def check_supported(self, what: str) -> None:
        roles = self.roles
        if roles.owner is None:
            raise ValueError(
                f"{what}: prefix caching needs an attention sub-pool (full, MLA, sliding "
                f"window); this pool has {list(self.books)} only; turn prefix caching off"
            )

    def counters(self) -> dict[str, int]:
        """Host-int counters (``PrefixStats``) and the pages cached and evictable now."""
        states = {"checkpoints": len(self.states.by_node)} if self.states is not None else {}
        host = self.host.counters() if self.host is not None else {}
        return {
            **self.stats.as_dict(), "pages": len(self.by_page), "evictable": len(self.lru),
            **states, **host,
        }  # fmt: skip

    def tokens(self, token_ids: object, what: str) -> np.ndarray:
        """``token_ids`` (a 1-D host sequence, array or CPU tensor of ints) as int64,
        or ValueError; also refuses pools this cache does not support."""
        self.check_supported(what)
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.detach().cpu().numpy()
        array = np.asarray(token_ids)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise ValueError(f"{what}: token_ids must be a 1-D list of ints, got {token_ids!r}")
        return array.astype(np.int64, copy=False)  # (read only here: no copy needed)

    def _find(
        self, parent_key: int, parent_id: int, block: bytes, salt: str | None = None
    ) -> tuple[int, ChainNode | None]:
        """(key of ``block`` (one block's int64 tokens as bytes) under its parent, the
        node caching it or None); ``salt``: the cache salt (first blocks compare it)."""
        key = hash((parent_key, block))
        node = self.by_key.get(key)
        if node is not None and (
            node.parent_id != parent_id
            or node.tokens != block
            or (parent_id == 0 and node.salt != salt)
        ):
            node = None  # a colliding key, an orphan or another salt: never trust the hash
        return key, node

    @staticmethod
    def _root_key(salt: str | None) -> int:
        """key(-1): 0 unsalted, else the salt's own hash (``salt``: a str or None)."""
        if salt is None:
            return 0
        if not isinstance(salt, str):
            raise TypeError(f"prefix cache salt must be a str or None, got {salt!r:.40}")
        return hash(("unikv-cache-salt", salt))

    def _blocks(self, tokens: np.ndarray, start: int = 0) -> list[bytes]:
        """The whole blocks of ``tokens`` (1-D ints) from block ``start`` on, each as
        the bytes of its int64 tokens: one copy, then byte slices (a block's cost is
        its hash, not numpy calls)."""
        ps = self.roles.page_size
        whole = np.ascontiguousarray(tokens[start * ps : len(tokens) // ps * ps], dtype=np.int64)
        raw, width = whole.tobytes(), ps * whole.itemsize
        return [raw[i : i + width] for i in range(0, len(raw), width)]

    def _tail(self, slot: int, salt: str | None) -> tuple[int, int, ChainNode] | None:
        """(blocks, key, node) of the chain end request ``slot``'s last insert reached
        (``tails``) when that node still caches the page the request holds at that
        column (a request holds a cached page only through a hit or its own insert
        of the same tokens), under the same salt, and the chain above it is live (so
        a walk from the root finds the same nodes); else None."""
        tail = self.tails.get(slot)
        if tail is None:
            return None
        blocks, node_id, key, tail_salt = tail
        node = self.by_id.get(node_id)
        if (
            node is None
            or tail_salt != salt
            or node.page < 0
            or not self.requests.in_use[slot]
            or self.requests.pages[slot, blocks - 1] != node.page
            or not self.reachable(node_id)  # (dict steps up the chain: no hashing)
        ):
            return None
        return blocks, key, node

    def _resume(
        self, slot: int, tokens: np.ndarray, salt: str | None
    ) -> tuple[int, int, ChainNode | None]:
        """(blocks, key, node) where a walk of request ``slot``'s own first tokens
        ``tokens`` may resume: its chain end (``_tail``) when ``tokens`` cover it and
        agree with its block; else (0, root key, None)."""
        tail = self._tail(slot, salt)
        if tail is not None:
            blocks, key, node = tail
            ps = self.roles.page_size
            if blocks * ps <= len(tokens) and node.tokens == self._block(tokens, blocks - 1):
                return blocks, key, node
        return 0, self._root_key(salt), None

    def _block(self, tokens: np.ndarray, index: int) -> bytes:
        """Block ``index`` of ``tokens`` as the bytes of its int64 tokens."""
        ps = self.roles.page_size
        return np.ascontiguousarray(tokens[index * ps : (index + 1) * ps], np.int64).tobytes()

    def own_chain_end(
        self, slot: int | None, tokens: np.ndarray, salt: str | None
    ) -> ChainNode | None:
        """The node caching the last whole block of ``tokens`` (the first tokens of
        request ``slot``, whole pages), reachable from the root; None when not all
        its blocks are cached. Walks back from the request's chain end (``_tail``)
        when it covers them and agrees with that block, else from the root."""
        ps = self.roles.page_size
        count = len(tokens) // ps
        tail = self._tail(slot, salt) if slot is not None and count else None
        if tail is not None and tail[0] >= count:
            walk: ChainNode | None = tail[2]
            for _ in range(tail[0] - count):
                walk = self.by_id.get(walk.parent_id) if walk is not None else None
            if walk is not None and walk.tokens == self._block(tokens, count - 1):
                return walk
        found = self.walk(tokens, salt)
        return found[-1] if count and len(found) == count else None

    def walk(self, tokens: np.ndarray, salt: str | None = None) -> list[ChainNode]:
        """The nodes (device or host) caching the leading whole blocks of ``tokens``
        (1-D host int64) under ``salt``, up to the first block not cached; no window
        or checkpoint rule (``chain_hit`` applies those)."""
        key, parent, found = self._root_key(salt), 0, []
        for block in self._blocks(tokens):
            key, node = self._find(key, parent, block, salt)
            if node is None:
                break
            found.append(node)
            parent = node.node_id
        return found

    def match(self, token_ids: object, salt: str | None = None) -> PrefixHit:
        """The longest run of whole cached pages holding the first tokens of
        ``token_ids`` (1-D host ints) under cache salt ``salt``, compared token by
        token; no state change. Pass a prompt without its last token, so a forward
        is left to run."""
        tokens = self.tokens(token_ids, "prefix.match")
        found = self.walk(tokens, salt)
        hit = self.chain_hit(found, len(tokens), host=self.host is not None)
        if hit.num_host_pages or hit.host_state:  # reload or recompute the host part
            hit = self.host.choose(self, hit, self.chain_hit(found, len(tokens), host=False))
        return hit

    def want(self, token_ids: object, salt: str | None = None) -> int:
        """Mark the checkpoint a lookup of ``token_ids`` would restore as expected by
        a waiting request (``StateCheckpoints.want``; no stats) and make its chain's
        evictable pages the youngest of the LRU; returns its node id, 0 when the
        lookup would restore none (no state, a miss)."""
        if self.states is None:
            return 0
        tokens = self.tokens(token_ids, "prefix.want")
        hit = self.chain_hit(self.walk(tokens, salt), len(tokens), host=self.host is not None)
        if not hit.num_tokens:
            return 0
        node_id = int(hit.nodes[-1])
        if not self.states.has(node_id, True):
            return 0
        self.states.want(node_id)
        # its chain's evictable pages to the young end of the LRU, deepest first (so
        # leaves still go before their parents): page eviction reaches them last too
        for page in hit.pages[::-1].tolist():
            if page in self.lru:
                self.lru.move_to_end(page)
        return node_id

    def unwant(self, node_id: int) -> None:
        """A waiting request that ``want`` marked node ``node_id`` for no longer waits."""
        if self.states is not None and node_id:
            self.states.want(node_id, -1)

    def chain_hit(self, found: list[ChainNode], num_query: int, host: bool) -> PrefixHit:
        """``prefix_chain.chain_hit`` over this cache's sub-pools, checkpoints and tier."""
        return chain_hit(
            found, num_query, host,
            roles=self.roles, books=self.books, states=self.states, tier=self.host,
        )  # fmt: skip

    def reload(
        self, hit: PrefixHit, reserve: Callable[[Mapping[str, int], int], bool]
    ) -> PrefixHit:
        """The hit to pass to ``new_request``: ``hit`` with its host pages reloaded
        (or its device-only prefix when the pool has no room: ``io/prefix_host.py``);
        ``reserve(new, virtual) -> bool``: the room maker's, without the callback."""
        if self.host is None or not len(hit.pages):
            return hit
        return self.host.reload(self, hit, reserve)

    def _count(self, hit: PrefixHit, sign: int) -> None:
        self.stats.queries += sign
        self.stats.query_tokens += sign * hit.num_query_tokens
        self.stats.hit_tokens += sign * hit.num_tokens

    def uncount(self, hit: PrefixHit) -> None:
        """Take back the lookup counters of an attached ``hit`` whose admission was
        given up (the caller frees the slot and looks up again later)."""
        self._count(hit, -1)

    def attach(self, slot: int, hit: PrefixHit) -> TablePatch:
        """Give the empty request ``slot`` the pages of ``hit``: host state now, the
        req_to_token writes staged in the returned patch. On a bad hit the slot
        is closed again and ValueError raised."""
        if not isinstance(hit, PrefixHit):
            self.requests.close(slot)
            raise TypeError(f"new_request: prefix must be a PrefixHit or None, got {hit!r}")
        if hit.num_host_pages:
            self.requests.close(slot)
            raise ValueError(
                f"new_request: {hit.num_host_pages} pages of the prefix hit are on the host "
                "tier; pass prefix.reload(hit), which reloads them, instead"
            )
        pages, count = hit.pages, len(hit.pages)
        listed = pages.tolist()  # (Python ints: no numpy scalar per page)
        live = [n.node_id if n is not None else -1 for n in map(self.by_page.get, listed)]
        states = self.states
        last = int(hit.nodes[-1]) if count else 0
        if live != hit.nodes.tolist() or (
            states is not None and count and not states.has(last, True)
        ):
            self.requests.close(slot)
            raise ValueError(
                "new_request: the prefix hit is stale (a page it names was evicted since "
                "prefix.match); call prefix.match again right before new_request"
            )
        self._count(hit, 1)
        patch = TablePatch()
        if count == 0:
            return patch
        self.requests.pages[slot, :count] = pages
        self.requests.lens[slot] = hit.num_tokens
        self.refs[pages] += 1  # (a chain's pages are distinct)
        pop = self.lru.pop
        for page in listed:
            pop(page, None)
        ps = self.roles.page_size
        for name, window in self.roles.windows.items():
            # the request holds the window its first query reads (bound: window_intact)
            first = max(hit.num_tokens + 1 - window, 0) // ps
            self.requests.window_lo[name][slot] = first
            np.add.at(self.wrefs[name], pages[first:], 1)
        if states is not None:
            states.pin(slot, last, hit.num_tokens)  # restored by alloc_mamba
        positions = np.arange(hit.num_tokens, dtype=np.int64)
        rows = np.full(hit.num_tokens, slot, np.int64)
        flat = rows * self.requests.max_context + positions
        patch.add(TableWriter.REQ_TO_TOKEN, flat, self.requests.token_ids(rows, positions))
        return patch

    def insert(self, slot: int, token_ids: object, salt: str | None = None) -> int:
        """Share the full pages of request ``slot`` that hold ``token_ids`` (its
        first tokens, 1-D host ints, <= tokens held, keys and values written or
        enqueued) and are not cached yet: read-only from now on, kept past the
        request while the pool has room; ``salt``: the request's cache salt. Returns
        the pages newly cached."""
        tokens = self.tokens(token_ids, "prefix.insert")
        slot = self.requests.check_slot(slot, "prefix.insert")
        return self._insert(slot, tokens, salt)[0]

    def _insert(
        self, slot: int, tokens: np.ndarray, salt: str | None
    ) -> tuple[int, int, ChainNode | None]:
        """``insert`` past its argument checks; (pages newly cached, blocks of the
        chain end it reached, that node or None)."""
        if len(tokens) > self.requests.lens[slot]:
            raise ValueError(
                f"prefix.insert: {len(tokens)} token ids but request {slot} holds "
                f"{int(self.requests.lens[slot])} tokens; pass at most those"
            )
        start, key, tail = self._resume(slot, tokens, salt)
        parent, added, reached = (tail.node_id if tail is not None else 0), 0, start
        blocks = self._blocks(tokens, start)
        pages = self.requests.pages[slot, start : start + len(blocks)].tolist()
        for col, (block, page) in enumerate(zip(blocks, pages, strict=True), start):
            found_key, node = self._find(key, parent, block, salt)
            if node is None:
                node = self._new_node(page, found_key, parent, block, salt if parent == 0 else None)
                if node is None:
                    break
                added += 1
                for name, lo in self.requests.window_lo.items():  # in its window: held
                    self.wrefs[name][page] = int(col >= lo[slot])
            key, parent, reached, tail = found_key, node.node_id, col + 1, node  # cached
            # already: this request's page or another's
        if parent:
            self.tails[slot] = (reached, parent, key, salt)
        if parent and self.roles.windows:  # a hit may end here: keep its window suffix
            self.ends.add(parent)
        self.stats.cached_pages += added
        return added, reached, tail

    def share_checkpoint(
        self,
        slot: int,
        token_ids: object,
        at: int,
        reserve: Callable[[Mapping[str, int]], bool],
        salt: str | None = None,
        turn_end: bool = False,
        source: int | None = None,
        previous: int = 0,
        drop: bool = False,
        junction: bool = False,
    ) -> bool:
        """``insert`` of ``token_ids`` (request ``slot``'s first tokens), then
        ``checkpoint`` at its first ``at`` tokens (whole pages), superseding the
        request's own checkpoint at its first ``previous`` tokens (0: none): one chain
        walk for both (issue 41: a decode take's host cost). The checkpoint's node and
        the superseded one are found by walking back from the chain end the insert
        reached (each checked against its block's tokens), not by a lookup each; where
        that end does not cover ``at`` (an insert cut short), ``checkpoint``'s own
        lookup decides."""
        tokens = self.tokens(token_ids, "prefix.share_checkpoint")
        slot = self.requests.check_slot(slot, "prefix.share_checkpoint")
        reached, end = self._insert(slot, tokens, salt)[1:]
        ps, states = self.roles.page_size, self.states
        if states is None or at <= 0 or at % ps or at > len(tokens):
            return False
        blocks = at // ps
        node = self._back(end, reached - blocks, tokens, blocks)
        old = self._back(node, blocks - previous // ps, tokens, previous // ps)
        if node is None or (previous and (old is None or previous % ps)):
            old_tokens = tokens[:previous] if previous else None
            return self.checkpoint(
                slot, tokens[:at], reserve, salt, turn_end, source, old_tokens, drop, junction
            )
        try:
            return self._save(slot, node, old, at, reserve, turn_end, source, drop, junction)
        finally:  # the chunk's reserved slot, if the take did not adopt it
            states.release_direct([slot], at)

    def _back(
        self, node: ChainNode | None, steps: int, tokens: np.ndarray, blocks: int
    ) -> ChainNode | None:
        """The node ``steps`` parents above ``node`` (a request's own chain end, its
        block compared by ``_insert`` already), if it caches block ``blocks - 1`` of
        ``tokens``; None otherwise (or ``blocks`` 0)."""
        if node is None or steps < 0 or blocks <= 0:
            return None
        if steps == 0:
            return node
        for _ in range(steps):
            node = self.by_id.get(node.parent_id)
            if node is None:
                return None
        return node if node.tokens == self._block(tokens, blocks - 1) else None

    def checkpoint(
        self,
        slot: int,
        token_ids: object,
        reserve: Callable[[Mapping[str, int]], bool],
        salt: str | None = None,
        turn_end: bool = False,
        source: int | None = None,
        supersedes: object = None,
        drop: bool = False,
        junction: bool = False,
    ) -> bool:
        """Copy request ``slot``'s state slot into a checkpoint keyed by the cached
        node of the last block of ``token_ids`` (its first k * page_size tokens, all
        prefilled and ``insert``-ed; the state must be the one after exactly them).
        False when nothing was taken: no Mamba sub-pool, no node, or no room.
        ``turn_end``: a decode checkpoint (the next turn of a chat extends it);
        ``reserve(new) -> bool``: room for the copy (older checkpoints may go,
        cached pages never: ``Room.reserve(evict_pages=False)``); ``source``: the Mamba
        virtual id holding that state when not the request's live slot (a
        per-draft-position slot after a speculative verify step); ``supersedes``: the
        first tokens (whole pages) of the request's own checkpoint this one replaces:
        dropped (``drop``; before room is made, so no other chain's checkpoint is
        evicted for the take while it holds a slot) or demoted once this one is taken
        (``StateCheckpoints.save``); ``junction``: a shared junction
        (``StateCheckpoints.shared``)."""
        tokens = self.tokens(token_ids, "prefix.checkpoint")
        ps = self.roles.page_size
        if self.states is None or not len(tokens) or len(tokens) % ps:
            return False
        try:
            return self._checkpoint(
                slot, tokens, reserve, salt, turn_end, source, supersedes, drop, junction
            )
        finally:  # the chunk's reserved slot, if the take did not adopt it
            self.states.release_direct([int(slot)], len(tokens))

    def reserve_checkpoint(
        self, slot: int, tokens: int, reserve: Callable[[Mapping[str, int]], bool]
    ) -> bool:
        """Reserve a checkpoint slot that request ``slot``'s prefill chunk ending at
        ``tokens`` tokens writes its final state into (``StateCheckpoints.reserve_direct``;
        the ``checkpoint`` after the step adopts it: no copy). False: none reserved."""
        if self.states is None or tokens <= 0 or tokens % self.roles.page_size:
            return False
        return self.states.reserve_direct(int(slot), int(tokens), reserve)

    def _checkpoint(
        self, slot: int, tokens: np.ndarray, reserve: Callable[[Mapping[str, int]], bool],
        salt: str | None, turn_end: bool, source: int | None, supersedes: object, drop: bool,
        junction: bool = False,
    ) -> bool:  # fmt: skip
        """``checkpoint`` past its argument checks."""
        assert self.states is not None, "prefix._checkpoint: checked by checkpoint()"
        node = self.own_chain_end(int(slot), tokens, salt)
        if node is None:
            return False
        old = None
        if supersedes is not None:
            prev = self.tokens(supersedes, "prefix.checkpoint")
            old = self.own_chain_end(int(slot), prev, salt) if len(prev) else None
        return self._save(
            int(slot), node, old, len(tokens), reserve, turn_end, source, drop, junction
        )

    def _save(
        self, slot: int, node: ChainNode, old: ChainNode | None, tokens: int,
        reserve: Callable[[Mapping[str, int]], bool], turn_end: bool, source: int | None,
        drop: bool, junction: bool,
    ) -> bool:  # fmt: skip
        """``StateCheckpoints.save`` of request ``slot``'s checkpoint at node ``node``
        (``tokens`` tokens), superseding ``old`` (None: none); the stats follow."""
        assert self.states is not None, "prefix._save: a checkpoint needs a Mamba sub-pool"
        # making room may evict any node of the chain: the checkpoint must stay reachable
        alive = lambda: self.reachable(node.node_id)
        saved = self.states.save(
            slot, node.node_id, alive, tokens, reserve, turn_end, source,
            old.node_id if old is not None else None, drop, junction,
        )  # fmt: skip
        self.stats.checkpoints = self.states.saved
        return saved

    def demote_checkpoint(
        self,
        token_ids: object,
        drop: bool = False,
        salt: str | None = None,
        slot: int | None = None,
    ) -> None:
        """The checkpoint at the last block of ``token_ids`` (whole pages) goes first
        when the Mamba sub-pool is short (``drop``: goes now, unless a request waits
        to restore it): a longer one of the same conversation made it the less likely
        hit (``allocator/checkpoints.py``, the policy). ``slot``: the request whose
        own first tokens these are (its chain end is walked back from, not hashed)."""
        tokens, states = self.tokens(token_ids, "prefix.demote_checkpoint"), self.states
        node = self.own_chain_end(slot, tokens, salt) if states is not None else None
        if states is not None and node is not None:
            node_id = node.node_id
            if drop and node_id in states.lru:
                states.drop([node_id], superseded=True)
            else:
                states.demote(node_id)

    def reachable(self, node_id: int) -> bool:
        """Whether a lookup can reach node ``node_id``: it and every ancestor are live.
        Nodes found reachable are remembered until a node leaves ``by_id`` (stamp: ids
        issued less live ones, which only a removal moves), so a request's own chain
        end is checked in O(1) per take, not by a walk to the root (issue 41)."""
        stamp = self._next_id - len(self.by_id)
        if stamp != self._reach_stamp:
            self._reach_stamp, self._reached = stamp, set[int]()
        return reachable(self.by_id, node_id, self._reached)

    def reachable_many(self, node_ids: list[int]) -> list[bool]:
        """``reachable`` of each of ``node_ids``, each ancestor walked once."""
        return reachable_many(self.by_id, node_ids)

    def _new_node(
        self, page: int, key: int, parent: int, block: bytes, salt: str | None = None
    ) -> ChainNode | None:
        """Give ``page`` to the cache under ``key``; None when the key is held by a
        node still referenced, or the page is cached already (under another chain)."""
        stale = self.by_key.get(key)
        if stale is not None and stale.page == HOST:
            self.host.drop(self, [stale.node_id])  # an orphan or a collision on the host
        elif stale is not None and not self._drop_evictable(stale.page):
            return None  # an orphan or a collision holds the key
        if self.vspace.owner[page] == CACHED:
            return None
        node = ChainNode(self._next_id, parent, key, page, block, salt)
        self._next_id += 1
        self.by_key[key] = self.by_id[node.node_id] = node
        self._own(node, page)
        return node

    def _own(self, node: ChainNode, page: int) -> None:
        """``node`` caches the request page ``page`` (held by that one request)."""
        node.page = page
        self.by_page[page] = node
        self.vspace.owner[page] = CACHED
        self.refs[page] = 1

    def _drop_evictable(self, page: int) -> bool:
        """Evict one evictable page now (its tombstones written); False if it is not."""
        if page not in self.lru:
            return False
        self.lru.move_to_end(page, last=False)
        self.writer.stage(evict_pages(self, 1))
        return True

    def leave_window(self, name: str, vpages: np.ndarray) -> None:
        """Cached ``vpages`` (host int32, one entry per request) left a request's
        window in sub-pool ``name``: that request's hold goes; at none the binding is
        the cache's, evictable alone (``prefix_evict.evict_windows``)."""
        if not len(vpages):
            return
        wrefs = self.wrefs[name]
        np.subtract.at(wrefs, vpages, 1)
        self._tick += 1
        self.wtime[name][vpages[wrefs[vpages] == 0]] = self._tick

    def release_window(self, slot: int, lo: int, hi: int) -> None:
        """Request ``slot`` gives up its page columns ``[lo, hi)``: its holds on the
        cached ones in its windows go (call before ``window_lo`` moves)."""
        for name in self.roles.windows:
            start = max(lo, int(self.requests.window_lo[name][slot]))
            if start < hi:
                vpages = self.requests.pages[slot, start:hi]
                self.leave_window(name, vpages[self.is_cached(vpages)])

    def window_evictable(self, name: str) -> np.ndarray:
        """Cached pages (host int32) whose binding in windowed sub-pool ``name`` only
        the cache holds: bound, no request window holds them."""
        pages = np.fromiter(self.by_page, np.int32, len(self.by_page))
        pages = pages[self.wrefs[name][pages] == 0]
        return pages[self.books[name].physical(pages) >= 0]

    @property
    def num_reclaimable(self) -> int:
        """Evictable pages plus window bindings evictable alone (the room maker's)."""
        windows = sum(len(self.window_evictable(n)) for n in self.roles.windows)
        return len(self.lru) + windows

    def release(self, vpages: np.ndarray) -> np.ndarray:
        """``prefix_evict.release_pages``: the private ones of ``vpages`` (host int32)."""
        return release_pages(self, vpages)

    def is_cached(self, vpages: np.ndarray) -> np.ndarray:
        return self.vspace.owner[vpages] == CACHED

    def evict(self, count: int) -> TablePatch:
        """Under pressure, ``count`` of, cheapest first: evictable pages no hit can
        use (``prefix_evict.dead_pages``: below the last intact window of their
        chain); window bindings no request holds outside every chain end's window
        suffix (no hit lost); the oldest evictable pages, those on a shared junction's
        chain last (``prefix_evict.evict_lru``;
        their window bindings go with them); when no page is evictable, the suffix
        bindings of pages requests hold below their windows
        (``prefix_evict.evict_windows``)."""
        patch, done = evict_dead(self, count)
        if done >= count:
            return patch
        self.writer.stage(patch)  # (inside ``TableWriter.batch``: with the verb's write)
        count -= done
        patch, done = evict_windows(self, count, suffixes=False)
        if done >= count:
            return patch
        count -= done
        self.writer.stage(patch)
        if self.lru:
            return evict_lru(self, count)
        return evict_windows(self, count)[0]

    def evict_dead(self, count: int) -> tuple[TablePatch, int]:
        """``prefix_evict.evict_dead``: up to ``count`` pages no hit can use."""
        return evict_dead(self, count)

    def reset(self) -> int:
        """``prefix_evict.reset_cache``: drop everything no request holds."""
        return reset_cache(self)

    def evictable_physical(self, name: str) -> np.ndarray:
        """``prefix_evict.evictable_physical``: (host int64) pages eviction would free."""
        return evictable_physical(self, name)
