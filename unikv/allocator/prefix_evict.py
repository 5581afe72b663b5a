"""The prefix cache's references and LRU: release, eviction, the pages it would free.

    refs[page]  request tables holding cached page ``page``
    refs == 0   evictable: in ``lru``, oldest first, deepest block first within
                one release, so leaves go before their parents

Eviction unbinds a page in every token sub-pool (fenced like any free, the
tombstones staged in a patch), retires its virtual page and drops its node and
the checkpoints no lookup can reach any more; with a host tier a reachable
node's envelopes are spilled first and the node kept (``page = HOST``).
The functions here are ``prefix.PrefixCache``'s verbs of that kind, over the
cache's state (``cache``: the ``PrefixCache``, which owns ``refs`` and ``lru``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from unikv.allocator.fences import FenceQueue
from unikv.allocator.pages import PageBook
from unikv.allocator.prefix_chain import CACHED, HOST, ChainNode, reachable_many
from unikv.allocator.tables import TablePatch, TableWriter

if TYPE_CHECKING:
    from unikv.allocator.prefix import PrefixCache


def stage_unbind(
    books: dict[str, PageBook],
    names: tuple[str, ...],
    fences: FenceQueue,
    writer: TableWriter,
    vpages: np.ndarray,
    patch: TablePatch,
    copies: Mapping[str, Any] | None = None,
) -> None:
    """Unbind the bound ones of ``vpages`` (host int32) in token sub-pools
    ``names`` on the host (fenced, also by ``copies[name]``: the done-event of a
    copy still reading them); stage their tombstones in ``patch``."""
    for name in names:
        book = books[name]
        bound = vpages[book.physical(vpages) >= 0]  # I/O or a window may have freed some
        ppages = fences.unbind(book, bound, (copies or {}).get(name), spill=True)
        if len(ppages):
            patch.add_tombstones(writer.v2p_id[name], bound)
            patch.add_tombstones(writer.p2v_id[name], ppages)


def release_pages(cache: PrefixCache, vpages: np.ndarray) -> np.ndarray:
    """A request gives up ``vpages`` (host int32, block order): cached ones lose a
    reference (evictable at none, deepest first); returns the private ones."""
    cached = cache.vspace.owner[vpages] == CACHED
    if not cached.any():
        return vpages
    shared = vpages[cached]
    np.subtract.at(cache.refs, shared, 1)
    for page in shared[::-1].tolist():
        if cache.refs[page] == 0:
            cache.lru[page] = None
    return vpages[~cached]


def evict_pages(cache: PrefixCache, count: int, spill: bool = True) -> TablePatch:
    """Evict the ``count`` oldest evictable pages (at most all): unbound
    everywhere (fenced), virtual pages retired, nodes dropped (or, with a host
    tier and ``spill``, kept on the host); the tombstones are staged in the
    returned patch."""
    count = min(count, len(cache.lru))
    pages = np.array([cache.lru.popitem(last=False)[0] for _ in range(count)], np.int32)
    patch = TablePatch()
    if count == 0:
        return patch
    nodes = [cache.by_page.pop(page) for page in pages.tolist()]
    host = cache.host if spill else None
    spilled, copies = host.spill(cache, nodes) if host is not None else (set(), {})
    names = cache.roles.token_names  # unbound after the spill, fenced by its copies
    stage_unbind(cache.books, names, cache.fences, cache.writer, pages, patch, copies)
    dropped = []
    for node in nodes:
        if node.node_id in spilled:
            node.page = HOST
        else:
            del cache.by_key[node.key], cache.by_id[node.node_id]
            cache.ends.discard(node.node_id)
            dropped.append(node.node_id)
    if cache.states is not None and dropped:  # the checkpoints no lookup can reach any more
        held = cache.states.nodes()  # (each ancestor walked once, not once per checkpoint)
        alive = reachable_many(cache.by_id, held)
        cache.states.drop(dropped + [n for n, ok in zip(held, alive) if not ok])
    if cache.host is not None and dropped:
        cache.host.prune(cache)  # host nodes below a dropped one
    cache.vspace.retire(pages)
    cache.stats.evicted_pages += count
    return patch


def window_suffixes(cache: PrefixCache, name: str, insert_ends: bool = True) -> np.ndarray:
    """Cached pages (host int32) in the window suffix of a chain end in windowed
    sub-pool ``name``: the blocks the first query of a hit ending there reads. Chain
    ends: device nodes with no device child (a chain's end), with several (where
    prompts diverge: a shared system prompt), with a state checkpoint, or where an
    insert ended (a prompt's end: a repeat of the prompt hits there), unless not
    ``insert_ends``."""
    nodes = cache.by_page.values()
    children: dict[int, int] = {}
    for node in nodes:
        children[node.parent_id] = children.get(node.parent_id, 0) + 1
    states = cache.states.by_node if cache.states is not None else {}
    span = -(-(cache.roles.windows[name] - 1) // cache.roles.page_size)  # blocks read
    keep: set[int] = set()
    for node in nodes:
        if (
            children.get(node.node_id, 0) == 1
            and node.node_id not in states
            and not (insert_ends and node.node_id in cache.ends)
        ):
            continue
        walk: ChainNode | None = node
        for _ in range(span):
            if walk is None or walk.page == HOST or walk.page in keep:
                break
            keep.add(walk.page)
            walk = cache.by_id.get(walk.parent_id)
    return np.fromiter(keep, np.int32, len(keep))


def dead_pages(cache: PrefixCache) -> np.ndarray:
    """Evictable cached pages (host int32, LRU order) no hit can use any more, in a
    windowed or recurrent-state pool without a host tier: a hit ending at a node needs
    the window pages its first query reads bound (``prefix_chain.window_intact``) and,
    with state, a checkpoint there, so a page is useful only while some node at or
    below it in its chain ends such an intact window (or none of the pool's sub-pools
    is windowed) and holds a checkpoint (issue 41: a hybrid's pages past its chain's
    last checkpoint only cost room; evicting them first keeps the turn ends the next
    turns hit). A chain whose end lost its window
    suffix (its leaf page evicted after its inner window bindings went alone) is dead
    weight down to its deepest intact node; evicting it first loses no hit. Orphans
    (a parent evicted) never match and are dead too."""
    roles, by_id, states = cache.roles, cache.by_id, cache.states
    if (not roles.windows and states is None) or cache.host is not None or not cache.lru:
        return np.zeros(0, np.int32)
    ps = roles.page_size
    depth: dict[int, int] = {0: 0}  # node id -> its blocks from the root (-1: an orphan)

    def depth_of(node_id: int) -> int:
        path = []
        while node_id not in depth:
            node = by_id.get(node_id)
            if node is None:  # an evicted parent: every node below it is an orphan
                depth[node_id] = -1
                break
            path.append(node_id)
            node_id = node.parent_id
        d = depth[node_id]
        for walked in reversed(path):
            d = d + 1 if d >= 0 else -1
            depth[walked] = d
        return d

    useful: set[int] = set()
    # with recurrent state a hit ends at a checkpoint: only those nodes end a hit
    ends: Iterable[ChainNode] = cache.by_page.values()
    if states is not None:
        ends = [by_id[n] for n in states.by_node if n in by_id]
    for node in ends:
        d = depth_of(node.node_id)
        if d <= 0 or node.node_id in useful:
            continue
        intact = True
        walk: ChainNode | None
        for name, window in roles.windows.items():
            book, walk = cache.books[name], node
            for _ in range(d - max(d * ps + 1 - window, 0) // ps):  # the blocks read
                if walk is None or walk.page == HOST or book.v2p_host[walk.page] < 0:
                    intact = False
                    break
                walk = by_id.get(walk.parent_id)
            if not intact:
                break
        walk = node if intact else None
        while walk is not None and walk.node_id not in useful:
            useful.add(walk.node_id)
            walk = by_id.get(walk.parent_id)
    dead = [page for page in cache.lru if cache.by_page[page].node_id not in useful]
    return np.array(dead, np.int32)


def evict_dead(cache: PrefixCache, count: int) -> tuple[TablePatch, int]:
    """Evict up to ``count`` of the ``dead_pages`` (no hit lost); (tombstones, how many)."""
    dead = dead_pages(cache)[:count]
    for page in dead[::-1].tolist():  # to the front of the LRU, in their order
        cache.lru.move_to_end(page, last=False)
    return evict_pages(cache, len(dead)), len(dead)


def chain_nodes(cache: PrefixCache, node_ids: Iterable[int]) -> set[int]:
    """Node ids at or above any of ``node_ids`` (each ancestor walked once)."""
    by_id, keep = cache.by_id, set()
    for node_id in node_ids:
        walk = by_id.get(node_id)
        while walk is not None and walk.node_id not in keep:
            keep.add(walk.node_id)
            walk = by_id.get(walk.parent_id)
    return keep


def evict_lru(cache: PrefixCache, count: int) -> TablePatch:
    """``evict_pages`` of the ``count`` oldest evictable pages, those on the chain of
    a shared junction checkpoint (``StateCheckpoints.junctions``: where a prompt left a
    cached run it matched, or one a hit restored; turn ends aside) after the rest, and
    those on the chain of a checkpoint a waiting request expects (``wanted``) after
    those: a per-request leaf goes before the prefix many requests hit, whatever its
    age (issue 41; ``bench_prefix_sim --compare-vllm``, few-shot at 4x the pool:
    79.3 % -> 85.9 %). Between the plain pages and a junction's: those on the chain of
    a ``carried`` turn end (taken by a request that opened with a hit: a conversation
    that hits again), so chat over more conversations than the pool holds keeps those
    that hit (chat at 4x: 3.4 % -> 11.4 %)."""
    states = cache.states
    if states is None or not (states.junctions() or states.wanted or states.carried):
        return evict_pages(cache, count)
    carried = chain_nodes(cache, states.carried)
    shared = chain_nodes(cache, states.junctions())
    wanted = chain_nodes(cache, states.wanted)
    by_page = cache.by_page

    def rank(page: int) -> int:
        node = by_page[page].node_id
        return 3 if node in wanted else 2 if node in shared else int(node in carried)

    first = sorted(cache.lru, key=rank)[:count]  # (stable: LRU order within a rank)
    for page in reversed(first):  # to the front of the LRU, in their order
        cache.lru.move_to_end(page, last=False)
    return evict_pages(cache, count)


def evict_windows(cache: PrefixCache, count: int, suffixes: bool = True) -> tuple[TablePatch, int]:
    """Unbind up to ``count`` window bindings per windowed sub-pool that only the
    cache holds (``PrefixCache.window_evictable``): those outside every chain end's
    window suffix (``window_suffixes``) first, then those only in the suffix of an
    insert's end (a prompt's end inside a chain: only a repeat of that prompt hits
    there), then, if ``suffixes``, the suffixes of the other chain ends; each oldest
    first (the window LRU, ``wtime``). The nodes stay; a hit that needs a binding gone
    falls back (``prefix_chain.window_intact``). Returns (the tombstones, the most
    unbound in one sub-pool)."""
    patch, done = TablePatch(), 0
    for name in cache.roles.windows:
        pages = cache.window_evictable(name)
        if not len(pages) or count <= 0:
            continue
        rank = np.isin(pages, window_suffixes(cache, name)).astype(np.int64)
        rank += np.isin(pages, window_suffixes(cache, name, insert_ends=False))
        if not suffixes:
            pages, rank = pages[rank < 2], rank[rank < 2]
        order = np.lexsort((cache.wtime[name][pages], rank))[:count]
        stage_unbind(cache.books, (name,), cache.fences, cache.writer, pages[order], patch)
        cache.stats.evicted_windows += len(order)
        done = max(done, len(order))
    return patch, done


def evictable_physical(cache: PrefixCache, name: str) -> np.ndarray:
    """Physical pages of ``name`` that evicting every evictable page (and, in a
    windowed sub-pool, every window binding only the cache holds) would free (host
    int64; unpinned ones only)."""
    book = cache.books[name]
    vpages = np.fromiter(cache.lru, np.int32, len(cache.lru))
    if name in cache.roles.windows:
        vpages = np.union1d(vpages, cache.window_evictable(name)).astype(np.int32)
    if not len(vpages):
        return np.zeros(0, np.int64)
    ppages = book.physical(vpages).astype(np.int64)
    ppages = ppages[ppages > 0]
    return ppages[book.pins[ppages] == 0]


def reset_cache(cache: PrefixCache) -> int:
    """Drop every cached page, state checkpoint and host-tier copy that no request
    holds (pages a running request references stay cached); returns the device
    pages dropped. Evicted pages are dropped, not spilled to the host tier."""
    states, host, count = cache.states, cache.host, len(cache.lru)
    cache.writer.write(evict_pages(cache, count, spill=False))
    cache.writer.write(evict_windows(cache, cache.vspace.size)[0])  # bindings no one holds
    if states is not None:
        states.evict(states.num_evictable)  # no reachability given: none spills
    if host is not None:
        host.drop(cache, [i for i in host.nodes if i not in host.held])  # and checkpoints
    return count
