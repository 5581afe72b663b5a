"""The host tier behind the prefix cache (issue 17): cached pages and state
checkpoints that eviction would drop spill to (pinned) host slots instead, and a
hit reloads them rather than recomputing their tokens.

    device node:  node.page = its virtual page (CACHED), in ``by_page``    (prefix.py)
    host node:    node.page = HOST, ``nodes[node id] = {sub-pool: host slot}``
                  (-1 where the page was unbound: a window had freed it)
    checkpoint:   on the device (``StateCheckpoints.by_node``) or on the host
                  (``ckpts[node id] = host slot``), never both

Spill (``PrefixCache.evict``, ``StateCheckpoints.evict``): the reachable victims'
envelopes (one contiguous range per page and sub-pool, every layer: the
page-major law) go to host slots, one copy each, batched per sub-pool through
``io.host_tier.HostTier``, on its side stream behind the current one. The spill
does not wait for its copy (no host sync): the unbound pages are fenced by the
copy's done-event as well as by the forward (``FenceQueue.hold(spill=True)``), so
they become holes when their bytes have left, and the slow path that waits for the
forward waits for the copy too. A reload of a slot still being written waits for
that copy on the device (``HostTier``'s writer events). The node stays in the hash
chain. The host LRU (oldest first) is bounded by
the slots: when full its oldest entries are dropped for real, and host nodes no
lookup can reach any more (an ancestor dropped) and their checkpoints go too.

Reload (``PrefixCache.reload(hit)``, before ``new_request(prefix=hit)``): fresh
virtual pages and one page per sub-pool are reserved for the hit's host nodes
(the hit's other pages and checkpoint held meanwhile), the envelopes copied back
(one copy each), and the current stream waits for the copies (``HostCopy.wait``:
no host sync; on CPU the copies are synchronous), so the first forward reads the
reloaded bytes. No room: the device-only prefix (``reload_fallbacks``). A host
checkpoint is copied straight into the request's new state slot at
``alloc_mamba`` (it stays on the host).

Cost rule (``ReloadPolicy``): reload when ``bytes / h2d_bytes_per_s`` is below
``tokens / prefill_tokens_per_s`` for the tokens the host part adds to the hit;
``mode`` "always" / "never" forces it. Budget, set-up and invariants: ``prefix_host_setup.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from unikv.allocator.prefix import CACHED, HOST
from unikv.allocator.prefix_chain import reachable_many
from unikv.ids import PhysicalPageIds

MODES = ("cost", "always", "never")


@dataclass
class ReloadPolicy:
    """Reload a hit's host part or recompute it (module docstring)."""

    mode: str = "cost"
    h2d_bytes_per_s: float = 10e9
    prefill_tokens_per_s: float = 1e4

    def reload(self, num_bytes: int, num_tokens: int) -> bool:
        if self.mode not in MODES:
            raise ValueError(f"ReloadPolicy.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode != "cost":
            return self.mode == "always"
        return num_bytes / self.h2d_bytes_per_s < num_tokens / self.prefill_tokens_per_s


@dataclass
class HostStats:
    """Host-tier counters since construction (host ints), ``host_``-prefixed in
    ``PrefixCache.counters()``."""

    spilled_pages: int = 0  # cached pages copied to the host on eviction
    spilled_checkpoints: int = 0
    spilled_bytes: int = 0
    hit_tokens: int = 0  # hit tokens served by reloading host pages
    reloaded_pages: int = 0
    reloaded_checkpoints: int = 0
    reloaded_bytes: int = 0
    evicted_pages: int = 0  # host nodes dropped for real (LRU, or unreachable)
    evicted_checkpoints: int = 0
    reload_fallbacks: int = 0  # reloads the pool had no room for: device-only hit
    reload_declined: int = 0  # host parts the cost rule chose to recompute


class PrefixHost:
    """Host slots of the prefix cache's spilled nodes and checkpoints.

    ``tiers``: one HostTier per token sub-pool (``num_slots`` each); ``state_tier``:
    the Mamba sub-pool's. The tier holds no allocator part: the prefix cache it
    extends is held by it, not the other way (docs/structure.md, "The allocator's
    parts: a tree"), so each verb that reads or changes the cache takes it as its
    first argument (``prefix``: the ``PrefixCache``), and a reload takes the room
    maker's reserve, as the cache's own ``reload`` does."""

    def check_integrity(self, parts) -> None:
        """The host tier's named invariants (``prefix_host_setup.check_prefix_host``);
        ``parts``: the allocator's parts, whose prefix cache this tier serves."""
        from unikv.io.prefix_host_setup import check_prefix_host

        check_prefix_host(parts)

    def __init__(self, tiers: dict, state_tier, policy: ReloadPolicy):
        self.tiers, self.state_tier = tiers, state_tier
        self.policy = policy
        self.capacity = min(t.num_slots for t in tiers.values())
        self.nodes: OrderedDict[int, dict[str, int]] = OrderedDict()  # host nodes, LRU
        self.ckpts: OrderedDict[int, int] = OrderedDict()  # node id -> host slot, LRU
        self.held: set[int] = set()  # host nodes and checkpoints a reload protects
        self.stats = HostStats()

    def counters(self) -> dict[str, int]:
        out = {f"host_{k}": v for k, v in self.stats.__dict__.items()}
        return {**out, "host_pages": len(self.nodes), "host_checkpoints": len(self.ckpts)}

    # -- spill ------------------------------------------------------------------------

    def spill(self, prefix, nodes: list) -> tuple[set[int], dict[str, Any]]:
        """Copy the envelopes of the reachable ones of ``nodes`` (device nodes of the
        cache ``prefix`` being
        evicted, pages still bound) to host slots. Returns their node ids (now on
        the host: the caller unbinds every page and marks them ``HOST``) and, per
        sub-pool, the copy's done-event (None on CPU): the caller fences the
        unbound pages with it, so they are reused only once their bytes have left
        (no host sync; a reload waits for the copy on the device)."""
        ids = [n.node_id for n in nodes]
        ok = reachable_many(prefix.by_id, ids)
        held = len(self.nodes)
        free = self._room(prefix, sum(ok))
        if len(self.nodes) != held:  # room-making dropped host nodes: reachability again
            ok = reachable_many(prefix.by_id, ids)
        alive = [n for n, keep in zip(nodes, ok) if keep][:free]
        if not alive:
            return set(), {}
        vpages = np.array([n.page for n in alive], np.int32)
        slots, fences = {}, {}
        for name, tier in self.tiers.items():
            ppages = prefix.books[name].physical(vpages)
            slots[name], fences[name] = self._offload(tier, ppages, ppages > 0)
        names, rows = list(slots), zip(*(s.tolist() for s in slots.values()))
        for node, row in zip(alive, rows):  # no call per node: one dict each
            self.nodes[node.node_id] = dict(zip(names, row))
        self.stats.spilled_pages += len(alive)
        return {n.node_id for n in alive}, fences

    def spill_checkpoints(
        self, states, node_ids: list[int], vids: np.ndarray, reachable: np.ndarray
    ) -> Any:
        """Copy the device checkpoints ``vids`` (host int32 Mamba virtual ids) of
        ``node_ids``, being evicted from ``states`` (the ``StateCheckpoints``), to host
        slots (those ``reachable`` marks, host bools, as room allows); returns the
        copy's done-event (None on CPU or when nothing moved), the fence of the slots
        the caller frees."""
        keep = [i for i in range(len(node_ids)) if reachable[i]]
        victims = [n for n in self.ckpts if n not in states.pins and n not in self.held]
        while victims and self.state_tier.num_free < len(keep):
            self._drop_checkpoints([victims.pop(0)])
        keep = keep[: self.state_tier.num_free]
        if not keep:
            return None
        ppages = states.book.physical(vids[keep])
        slots, event = self._offload(self.state_tier, ppages, ppages > 0)
        for i, slot in zip(keep, slots.tolist()):
            self.ckpts[node_ids[i]] = slot
        self.stats.spilled_checkpoints += len(keep)
        return event

    def _offload(self, tier, ppages: np.ndarray, bound: np.ndarray) -> tuple[np.ndarray, Any]:
        """(host slots, -1 where unbound, that receive copies of the bound ``ppages``;
        the copy's done-event, None on CPU or when nothing is bound). No host sync."""
        slots = np.full(len(ppages), -1, np.int64)
        if not bound.any():
            return slots, None
        ids = PhysicalPageIds(torch.from_numpy(ppages[bound].astype(np.int64)), tier.name)
        copy = tier.offload(ids, check=False)
        assert copy is not None, "prefix host: a spill finds the host slots it counted"
        slots[bound] = copy.host_slots.data.numpy()
        self.stats.spilled_bytes += int(bound.sum()) * tier.page_bytes
        return slots, copy.event

    def _room(self, prefix, count: int) -> int:
        """Drop the oldest host nodes (not held) until ``count`` more fit; returns
        how many fit."""
        if self._num_free() >= count:  # the common case: no walk over the host nodes
            return count
        victims = [i for i in self.nodes if i not in self.held]
        while victims and self._num_free() < count:
            self.drop(prefix, [victims.pop(0)])
            victims = [i for i in victims if i in self.nodes]
        return min(count, self._num_free())

    def _num_free(self) -> int:
        return min(self.capacity - len(self.nodes), *(t.num_free for t in self.tiers.values()))

    # -- dropping ---------------------------------------------------------------------

    def drop(self, prefix, node_ids: list[int]) -> None:
        """Drop host nodes of the cache ``prefix`` for real, then every host node and
        checkpoint no lookup can reach any more."""
        for i in node_ids:
            self._free_slots(self.nodes.pop(i))
            node = prefix.by_id.pop(i)
            del prefix.by_key[node.key]
        self.stats.evicted_pages += len(node_ids)
        self.prune(prefix)

    def prune(self, prefix) -> None:
        """Drop the host nodes, then the checkpoints, that no lookup of the cache
        ``prefix`` can reach."""
        ids = list(self.nodes)
        orphans = [i for i, ok in zip(ids, reachable_many(prefix.by_id, ids)) if not ok]
        if orphans:
            self.drop(prefix, orphans)  # descendants first found by the recursion's prune
            return
        if prefix.states is not None:
            ids = prefix.states.nodes()
            prefix.states.drop(
                [n for n, ok in zip(ids, reachable_many(prefix.by_id, ids)) if not ok]
            )

    def _free_slots(self, slots: Mapping[str, int]) -> None:
        from unikv.io.host_tier import HostPageIds

        for name, slot in slots.items():
            if slot >= 0:
                self.tiers[name].free(HostPageIds(torch.tensor([slot], dtype=torch.int64)))

    def _drop_checkpoints(self, node_ids: list[int]) -> None:
        from unikv.io.host_tier import HostPageIds

        slots = [self.ckpts.pop(i) for i in node_ids if i in self.ckpts]
        if slots:
            self.state_tier.free(HostPageIds(torch.tensor(slots, dtype=torch.int64)))
            self.stats.evicted_checkpoints += len(slots)

    drop_checkpoints = _drop_checkpoints

    # -- lookups and reload -----------------------------------------------------------

    def bound(self, found: list, name: str, book) -> np.ndarray:
        """Whether each of ``found`` (chain nodes) is bound in windowed sub-pool
        ``name`` (its page book ``book``) on the device, or was when it spilled (host
        nodes)."""
        return np.array(
            [
                self.nodes[n.node_id][name] >= 0 if n.page == HOST else book.v2p_host[n.page] >= 0
                for n in found
            ],
            bool,
        )

    def choose(self, prefix, full, device):
        """``full`` (a hit of the cache ``prefix`` with host pages or a host
        checkpoint) or ``device`` (its device-only prefix), by the cost rule."""
        gained = full.num_tokens - device.num_tokens
        nodes = [prefix.by_id[int(i)] for i in full.nodes]
        num_bytes = sum(
            self.tiers[name].page_bytes
            for n in nodes
            if n.page == HOST
            for name, slot in self.nodes[n.node_id].items()
            if slot >= 0
        )
        if full.host_state:
            num_bytes += self.state_tier.page_bytes
        if gained > 0 and self.policy.reload(num_bytes, gained):
            return full
        self.stats.reload_declined += gained > 0
        return replace(device, num_page_tokens=full.num_page_tokens)

    def reload(self, prefix, hit, reserve: Callable):
        """``hit`` (of the cache ``prefix``) with its host pages reloaded into fresh
        device pages (cached,
        evictable: ``new_request`` attaches them), or its device-only prefix when
        the pool has no room; ``hit`` itself when a node of it is gone (stale).
        ``reserve``: ``(new, virtual) -> bool``, the room maker's reserve without
        the shortfall callback."""
        ids = hit.nodes.tolist()
        if not prefix.by_id.keys() >= set(ids):  # a node is gone: stale
            return hit
        nodes = [prefix.by_id[i] for i in ids]
        columns = [i for i, n in enumerate(nodes) if n.page == HOST]
        if columns:
            if not self._reserve(prefix, nodes, columns, reserve):
                self.stats.reload_fallbacks += 1
                device = prefix.chain_hit(nodes, hit.num_query_tokens, host=False)
                return replace(device, num_page_tokens=hit.num_page_tokens)
            self._copy_in(prefix, [nodes[i] for i in columns], np.array(columns, np.int64))
            self.stats.hit_tokens += len(columns) * prefix.roles.page_size
        pages = np.array([n.page for n in nodes], np.int32)
        return replace(hit, pages=pages, num_host_pages=0)

    def _reserve(self, prefix, nodes: list, columns: list[int], reserve: Callable) -> bool:
        """Room for the host nodes ``nodes[columns]``; the hit's device pages, host
        nodes and checkpoint are held meanwhile (room-making may evict others)."""
        states = prefix.states
        pages = np.array([n.page for n in nodes if n.page != HOST], np.int32)
        np.add.at(prefix.refs, pages, 1)
        for page in pages.tolist():
            prefix.lru.pop(page, None)
        for wrefs in prefix.wrefs.values():  # and their window bindings (issue 41)
            np.add.at(wrefs, pages, 1)
        last = nodes[-1].node_id
        self.held = {nodes[i].node_id for i in columns} | {last}
        was_evictable = states is not None and states.lru.pop(last, 0) is None
        slots = [self.nodes[nodes[i].node_id] for i in columns]
        need = {name: int((np.array([s[name] for s in slots]) >= 0).sum()) for name in self.tiers}
        try:
            return bool(reserve(need, len(columns)))
        finally:
            np.subtract.at(prefix.refs, pages, 1)
            for wrefs in prefix.wrefs.values():
                np.subtract.at(wrefs, pages, 1)
            for page in pages[::-1].tolist():
                if prefix.refs[page] == 0:
                    prefix.lru[page] = None
            self.held = set()
            if was_evictable and last in states.by_node:
                states.lru[last] = None

    def _copy_in(self, prefix, nodes: list, columns: np.ndarray) -> None:
        """Bind fresh virtual and physical pages to host ``nodes`` (block indices
        ``columns``) and copy their envelopes back; they become evictable cached pages
        of ``prefix``."""
        from unikv.io.host_tier import HostPageIds

        vpages = prefix.vspace.mint(np.full(len(nodes), CACHED, np.int32), columns)
        for name, tier in self.tiers.items():
            slots = np.array([self.nodes[n.node_id][name] for n in nodes], np.int64)
            has = slots >= 0
            if not has.any():
                continue
            book = prefix.books[name]
            ppages = book.take(int(has.sum()))  # ascending pages to ascending slots: runs
            ppages[np.argsort(slots[has], kind="stable")] = np.sort(ppages)
            book.bind_host(vpages[has], ppages)
            prefix.writer.bind(book, vpages[has], ppages)
            host = HostPageIds(torch.from_numpy(slots[has]))
            dst = PhysicalPageIds(torch.from_numpy(ppages.astype(np.int64)), name)
            tier.reload(host, dst, check=False).wait()  # the next forward reads them
            tier.free(host)
            self.stats.reloaded_bytes += int(has.sum()) * tier.page_bytes
        for node, vpage in zip(nodes, vpages.tolist()):
            del self.nodes[node.node_id]
            node.page = vpage
            prefix.by_page[vpage] = node
            prefix.lru[vpage] = None
        self.stats.reloaded_pages += len(nodes)

    def restore_checkpoints(self, node_ids: list[int], dst: np.ndarray) -> None:
        """Copy the host checkpoints of ``node_ids`` into physical state slots ``dst``
        (host ints, one per node; bound, zeroed); they stay on the host."""
        from unikv.io.host_tier import HostPageIds

        tier = self.state_tier
        if not node_ids:
            return
        slots, pages = [self.ckpts[n] for n in node_ids], np.asarray(dst, np.int64)
        lanes = list(range(len(slots)))
        while lanes:  # one batch per round (a round reads each host slot once)
            first = {slots[i]: i for i in reversed(lanes)}
            batch = sorted(first.values())
            host = HostPageIds(torch.tensor([slots[i] for i in batch], dtype=torch.int64))
            ids = PhysicalPageIds(torch.from_numpy(pages[batch]), tier.name)
            tier.reload(host, ids, check=False).wait()  # the next forward reads them
            lanes = [i for i in lanes if i not in set(batch)]
        for node_id in node_ids:
            self.ckpts.move_to_end(node_id)
        self.stats.reloaded_checkpoints += len(node_ids)
        self.stats.reloaded_bytes += len(node_ids) * tier.page_bytes
