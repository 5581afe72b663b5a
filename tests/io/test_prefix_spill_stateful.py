"""Hypothesis stateful runs of the prefix cache with a host tier behind it
(``io/prefix_host.py``) over a tight full-attention pool (pages 1 and 4),
a host tier of 12 tokens (so it drops for real), reload forced: the rules of
``test_prefix_cache_stateful`` plus explicit spills; ``check_integrity()`` after
every step, and:

- a hit reads exactly the cached bytes: every page a request opens with holds
  the envelope recorded from the pool buffer when its node was cached, whether
  the page stayed on the device or came back from the host;
- a host node's slot holds exactly that envelope (the host tier's row against
  the pool bytes recorded at caching: a second description);
- no page is freed while referenced (parent's invariant), host slots are never
  aliased (integrity).

The named host invariants of ``check_prefix_host`` each fire on their corruption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import full_config
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_prefix_cache_stateful import BASES, PrefixMachine, derandomized

from unikv.allocator import PoolAllocator
from unikv.allocator.prefix import HOST
from unikv.io.prefix_host import ReloadPolicy
from unikv.io.prefix_host_setup import check_prefix_host, enable_prefix_host
from unikv.pool import UnifiedPool, pool_bytes_for

HOST_TOKENS = 12  # host tier: 12 tokens of pages (3 nodes at page size 4)


class SpillMachine(PrefixMachine):
    def __init__(self) -> None:
        super().__init__()
        self.prefix = self.alloc.parts.prefix
        page_bytes = self.pool["full"].page_bytes
        self.host = enable_prefix_host(
            self.alloc, HOST_TOKENS // self.PS * page_bytes, ReloadPolicy(mode="always")
        )
        self.node_bytes: dict[int, torch.Tensor] = {}  # node id -> envelope when cached

    def _envelope(self, vpage: int) -> torch.Tensor:
        return self.pool.page_envelope("full", int(self.book.v2p_host[vpage])).clone()

    @precondition(lambda self: len(self.tokens) < 4)
    @rule(
        base=st.sampled_from(BASES),
        cut=st.sampled_from([8, 12]),
        tail=st.lists(st.integers(0, 1), max_size=2),
    )
    def admit(self, base, cut, tail):
        prompt = (base[:cut] + tail)[:20] or [0]
        hit = self.alloc.prefix.reload(self.alloc.prefix.match(np.array(prompt[:-1])))
        slot = self.alloc.new_request(prefix=hit)
        pages = self.alloc.parts.requests.held_pages(slot)
        for vpage, node_id in zip(pages.tolist(), hit.nodes.tolist()):
            assert self.prefix.by_page[vpage].node_id == node_id
            assert torch.equal(self._envelope(vpage), self.node_bytes[node_id]), "hit bytes"
        self.hits += len(pages) > 0
        self._prefill(slot, prompt, hit.num_tokens)

    def _after_chains(self) -> None:  # the initial chains: 2 pages' worth to the host
        self.spill(2)

    def _cache(self, slot: int) -> None:
        self.alloc.prefix.insert(slot, np.array(self.tokens[slot]))
        for vpage, node in self.prefix.by_page.items():
            if node.node_id not in self.node_bytes:
                self.node_bytes[node.node_id] = self._envelope(vpage)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        """Cache a request's pages and free it (the engine's end of a request)."""
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        self._cache(slot)
        self._free(slot)

    @precondition(lambda self: self.prefix.num_evictable)
    @rule(count=st.integers(1, 6))
    def spill(self, count):
        self.alloc.parts.writer.write(self.prefix.evict(count * (4 // self.PS)))  # ~ tokens

    @invariant()
    def shared_pages_hold_what_was_cached(self):
        self.alloc.check_integrity()
        live = set(self.prefix.by_id)
        self.node_bytes = {i: b for i, b in self.node_bytes.items() if i in live}
        assert set(self.node_bytes) == live, "a node no rule cached"
        tier = self.host.tiers["full"]
        for node_id, saved in self.node_bytes.items():
            node = self.prefix.by_id[node_id]
            if node.page == HOST:
                got = tier.host[self.host.nodes[node_id]["full"]]
            else:
                got = self._envelope(node.page)
            assert torch.equal(got, saved), f"node {node_id}'s bytes changed"


@pytest.mark.parametrize("ps", [1, 4])
def test_prefix_spill_state_machine(ps):
    machine = type(f"SpillMachine{ps}", (SpillMachine,), {"PS": ps})
    runs = {"hits": 0, "reloaded": 0, "dropped": 0, "spilled": 0}

    class Counted(machine):
        def teardown(self):
            stats = self.alloc.prefix.counters()
            runs["hits"] += self.hits
            runs["reloaded"] += stats["host_reloaded_pages"]
            runs["dropped"] += stats["host_evicted_pages"]
            runs["spilled"] += stats["host_spilled_pages"]

    Counted.TestCase.settings = derandomized(max_examples=40, steps=30, shrink=False)
    Counted.TestCase().runTest()
    assert runs["reloaded"] > 10 and runs["dropped"] > 5 and runs["spilled"] > 40, runs


# -- each host invariant fires on its corruption ----------------------------------------


def _spilled() -> PoolAllocator:
    """Two cached chains of 3 pages; the 2 deepest pages of the first spilled."""
    configs = [full_config(4)]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": 12}))
    alloc = PoolAllocator(pool, max_requests=4, max_context=24, debug=True)
    enable_prefix_host(alloc, 4 * pool["full"].page_bytes, ReloadPolicy(mode="always"))
    prefix = alloc.parts.prefix
    for start in (0, 100):
        tokens = np.arange(start, start + 13)
        slot = alloc.new_request()
        alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([13]))
        alloc.prefix.insert(slot, tokens)
        alloc.free_request(slot)
    alloc.parts.writer.write(prefix.evict(2))
    alloc.check_integrity()
    assert len(prefix.host.nodes) == 2
    return alloc


def _corrupt(alloc: PoolAllocator, how: str) -> None:
    prefix = alloc.parts.prefix
    host = prefix.host
    first, second = list(host.nodes)
    if how == "page":
        prefix.by_id[first].page = 5
    elif how == "slots":
        del host.nodes[first]
    elif how == "capacity":
        host.capacity = 1
    elif how == "alias":
        host.nodes[second]["full"] = host.nodes[first]["full"]
    elif how == "unreachable":  # a host node's device parent gone from the chain
        parent = prefix.by_id[prefix.by_id[second].parent_id]
        if parent.page == HOST:
            parent = prefix.by_id[prefix.by_id[first].parent_id]
        del prefix.by_id[parent.node_id]
    elif how == "held":
        host.held = {first}


@pytest.mark.parametrize(
    "how, message",
    [
        ("page", "host nodes are live nodes holding no device page"),
        ("slots", "every node without a device page has host slots"),
        ("capacity", "the host nodes fit the host slots"),
        ("alias", "full: host slots are never aliased"),
        ("unreachable", "host nodes and host checkpoints are reachable from the root"),
        ("held", "no reload holds host nodes between verbs"),
    ],
)
def test_each_host_invariant_names_its_corruption(how, message):
    alloc = _spilled()
    check_prefix_host(alloc.parts)
    _corrupt(alloc, how)
    with pytest.raises(AssertionError, match=message):
        check_prefix_host(alloc.parts)
