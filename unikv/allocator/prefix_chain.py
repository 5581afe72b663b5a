"""The prefix cache's hash-chain records and the hit built from a walk of them.

    node = (node id, parent node id, key, virtual page, block tokens)
    a walk of blocks 0, 1, ... finds nodes n0, n1, ...  --chain_hit-->  PrefixHit

A node's ``page`` is a virtual page on the device, or ``HOST`` when its
envelopes were spilled to the host tier (``io/prefix_host.py``); a cached page's
virtual space owner is ``CACHED``. Node ids are never reused, so a hit names its
nodes and is found stale once one of them is gone.

Sliding windows (every windowed token sub-pool, the owner included when all
are windowed): a hit of k blocks serves a request only if the pages its first
query reads are bound in every windowed sub-pool, blocks ``[first, k)`` with
``first = max(k*ps + 1 - W, 0) // ps``; the hit is the longest such k (a
shorter intact prefix, or a miss). Policy: ``wrefs[name][page]`` counts the open
requests whose window (page columns from ``window_lo`` on; a hit opens with the
window its first query reads) holds a cached page; as a page slides out of a
request's window that hold goes (``Tokens.stage_window_frees``), and at none the
binding is the cache's: kept while the pool has room, evicted alone under
pressure before any node (``prefix_evict.evict_windows``: bindings outside every
chain end's window suffix first, then the suffixes, oldest first). So a request
holds no more window pages than its window, cache or not. A request's private
pages that left its window are freed at once. A page cached after its request
freed it out of the window never regains its binding: hits ending where it is
needed fall back.

Recurrent state (a Mamba sub-pool): a hit of k blocks also needs a state
checkpoint at block k-1's node (``checkpoints.py``); the hit is the longest
intact prefix that has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from unikv.allocator.checkpoints import StateCheckpoints
from unikv.allocator.pages import PageBook
from unikv.allocator.requests import Roles

if TYPE_CHECKING:
    from unikv.allocator.parts import Parts

CACHED = -2  # VirtualSpace.owner of a page the prefix cache holds
HOST = -1  # ChainNode.page of a node whose envelopes live on the host tier (io/prefix_host.py)


@dataclass(frozen=True)
class PrefixHit:
    """The cached pages of the longest cached prefix of some tokens.

    pages: (k,) host int32 virtual pages of blocks 0..k-1; nodes: (k,) host
    int64 node ids (a hit is stale once one of them is evicted); num_tokens:
    k * page_size; num_query_tokens: the tokens looked up; num_page_tokens: the
    tokens of the longest cached page run (>= num_tokens: a hybrid's hit also
    needs a state checkpoint at its end); num_host_pages: pages of it on the host
    tier (``pages`` holds HOST there: pass the hit through ``reload``);
    host_state: its state checkpoint is on the host tier."""

    pages: np.ndarray
    nodes: np.ndarray
    num_tokens: int
    num_query_tokens: int
    num_page_tokens: int = 0
    num_host_pages: int = 0
    host_state: bool = False


@dataclass
class ChainNode:
    """One cached block: its id, its parent's id (0: the root), its key, its
    virtual page (or HOST) and its block's ps int64 tokens as bytes (what its key
    hashes and a lookup compares, with no numpy call); a first block also names
    its request's cache salt (compared like the tokens)."""

    node_id: int
    parent_id: int
    key: int
    page: int
    tokens: bytes = field(repr=False)  # ps * 8 bytes: np.frombuffer(tokens, np.int64)
    salt: str | None = None  # a first block's cache salt (children inherit it by parent id)


def reachable(by_id: dict[int, ChainNode], node_id: int, known: set[int]) -> bool:
    """Whether a lookup can reach node ``node_id``: it and every ancestor are in
    ``by_id`` (the live nodes by node id). ``known``: node ids already found
    reachable (the walk stops at one), updated with those found now."""
    path, walk = [], node_id
    while walk and walk not in known:
        node = by_id.get(walk)
        if node is None:
            return False
        path.append(walk)
        walk = node.parent_id
    known.update(path)
    return True


def reachable_many(by_id: dict[int, ChainNode], node_ids: list[int]) -> list[bool]:
    """``reachable`` of each of ``node_ids``, each ancestor walked once (a spill of a
    whole chain is linear in its length, not quadratic)."""
    known: dict[int, bool] = {0: True}
    out = []
    for start in node_ids:
        path, walk = [], start
        while walk not in known:
            node = by_id.get(walk)
            if node is None:
                known[walk] = False
                break
            path.append(walk)
            walk = node.parent_id
        verdict = known[walk]
        for n in path:
            known[n] = verdict
        out.append(verdict)
    return out


def window_intact(
    roles: Roles, books: dict[str, PageBook], pages: np.ndarray, bound: dict | None = None
) -> int:
    """The largest k <= len(pages) such that a request holding the cached
    ``pages[:k]`` (host int32, block order) finds every page its next query
    reads bound in each windowed sub-pool (module docstring). ``bound``: per
    windowed sub-pool, whether each page is bound (default: on the device)."""
    ps, windows = roles.page_size, roles.windows
    if bound is None:
        bound = {n: books[n].physical(pages) >= 0 for n in windows}
    count = len(pages)
    while count and not all(
        bound[n][max(count * ps + 1 - w, 0) // ps : count].all() for n, w in windows.items()
    ):
        count -= 1
    return count


def chain_hit(
    found: list[ChainNode],
    num_query: int,
    host: bool,
    *,
    roles: Roles,
    books: dict[str, PageBook],
    states: StateCheckpoints | None,
    tier: Any,
) -> PrefixHit:
    """The longest usable prefix of chain nodes ``found`` (block order): window
    pages intact, a state checkpoint at its end (hybrids); ``host``: host nodes
    and host checkpoints count, else the chain stops at the first host node.
    ``tier``: the host tier (``io.prefix_host.PrefixHost``) or None."""
    if not host:
        found = found[: next((i for i, n in enumerate(found) if n.page == HOST), len(found))]
    pages = np.array([n.page for n in found], np.int32)
    if host and tier is not None:
        bound = {n: tier.bound(found, n, books[n]) for n in roles.windows}
    else:
        bound = {n: books[n].physical(pages) >= 0 for n in roles.windows}
    count = intact = window_intact(roles, books, pages, bound)
    if states is not None:  # a hybrid's hit ends at a block with a state checkpoint
        # stepping back to a checkpoint moves the first query back, so its window
        # must be re-checked: step back until both rules hold
        while count and not states.has(found[count - 1].node_id, host):
            count = window_intact(roles, books, pages[: count - 1], bound)
    nodes = np.array([n.node_id for n in found[:count]], np.int64)
    on_host = bool(count and states is not None and nodes[-1] not in states.by_node)
    ps, num_host = roles.page_size, int((pages[:count] == HOST).sum())
    return PrefixHit(pages[:count], nodes, count * ps, num_query, intact * ps, num_host, on_host)


def check_prefix_windows(parts: Parts) -> None:
    """Invariant of windowed pools (``parts``: the allocator's ``Parts``): every
    cached page that an open request's next query reads (columns from
    ``max(len + 1 - W, 0) // ps`` on) is bound in that windowed sub-pool."""
    req, roles, owner = parts.requests, parts.roles, parts.vspace.owner
    npages = -(-req.lens // roles.page_size)
    cols = np.arange(req.max_pages)[None, :]
    for name, window in roles.windows.items():
        first = np.maximum(req.lens + 1 - window, 0) // roles.page_size
        read = (cols >= first[:, None]) & (cols < npages[:, None]) & req.in_use[:, None]
        pages = req.pages[read]
        pages = pages[owner[pages] == CACHED]
        assert (parts.books[name].v2p_host[pages] >= 0).all(), (
            f"{name}: cached pages an open request's window reads are bound"
        )
        held = (cols >= req.window_lo[name][:, None]) & (cols < npages[:, None])
        held_pages = req.pages[held & req.in_use[:, None]]
        held_pages = held_pages[owner[held_pages] == CACHED]
        wrefs = parts.prefix.wrefs[name]
        assert np.array_equal(wrefs, np.bincount(held_pages, minlength=len(wrefs))), (
            f"{name}: window refcount equals the open request windows holding each cached page"
        )
        assert (parts.books[name].v2p_host[wrefs > 0] >= 0).all(), (
            f"{name}: cached pages a request window holds are bound"
        )
