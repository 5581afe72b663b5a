"""A request's later inserts, checkpoints and demotes resume at the chain end its
last insert reached (``PrefixCache.tails``, issue 41: the cache path's per-step
cost), instead of hashing its whole context again: the blocks looked up
(``PrefixCache._find`` calls, a spy) are the new ones only. Checked against a
walk from the root (``PrefixCache.walk``, which hashes every block) over the same
tokens: the same nodes and pages; and where the memo must not be trusted (the slot
reused by another request with other tokens, the chain end evicted, another salt)
the answer is still the root walk's."""

from __future__ import annotations

import numpy as np
import torch

from unikv.allocator import PoolAllocator
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

PS = 4
CONFIG = SubPoolConfig("full", MHASpec(1, 1, 4, dtype=torch.float32), page_size=PS)


def setup():
    pool = UnifiedPool([CONFIG], pool_bytes_for([CONFIG], {"full": 40}))
    alloc = PoolAllocator(pool, max_requests=2, max_context=16 * PS)
    return alloc, alloc.parts.prefix


def open_request(alloc, count: int) -> int:
    slot = alloc.new_request()
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([count])) is not None
    return slot


class Finds:
    """Counts ``_find`` calls (block lookups: one hash each) on ``prefix``."""

    def __init__(self, prefix, monkeypatch) -> None:
        self.count, inner = 0, prefix._find

        def counted(*args, **kwargs):
            self.count += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(prefix, "_find", counted)


def test_a_growing_request_hashes_only_its_new_blocks(monkeypatch) -> None:
    alloc, prefix = setup()
    tokens = np.arange(9 * PS + 1) + 100
    slot = open_request(alloc, len(tokens))
    finds = Finds(prefix, monkeypatch)
    assert alloc.prefix.insert(slot, tokens[: 4 * PS]) == 4
    assert finds.count == 4
    assert alloc.prefix.insert(slot, tokens[: 9 * PS]) == 5
    assert finds.count == 4 + 5, "the second insert looked up its 5 new blocks only"
    walked = prefix.walk(tokens)  # from the root: hashes all 9
    pages = alloc.parts.requests.pages[slot, :9]
    assert [n.page for n in walked] == pages.tolist(), "the chain caches the request's pages"
    before = finds.count
    for blocks in (9, 6, 1):
        end = prefix.own_chain_end(slot, tokens[: blocks * PS], None)
        assert end is walked[blocks - 1]
    assert finds.count == before, "chain ends found by walking back, no block hashed"
    alloc.check_integrity()


def test_the_memo_is_not_trusted_for_other_tokens_salts_or_evicted_ends(monkeypatch) -> None:
    alloc, prefix = setup()
    first = np.arange(6 * PS + 1)
    slot = open_request(alloc, len(first))
    alloc.prefix.insert(slot, first[: 6 * PS])
    alloc.free_request(slot)
    other = first + 1000  # the same slot again, other tokens
    again = open_request(alloc, len(other))
    assert again == slot
    finds = Finds(prefix, monkeypatch)
    assert alloc.prefix.insert(again, other[: 6 * PS]) == 6
    assert finds.count == 6, "a reused slot walks from the root"
    for tokens in (first, other):  # both chains intact, each its own pages
        assert len(prefix.walk(tokens)) == 6
    assert prefix.own_chain_end(again, other[: 3 * PS], None) is prefix.walk(other)[2]
    assert prefix.own_chain_end(again, other[: 3 * PS], "tenant") is None, "another salt"
    assert prefix.own_chain_end(again, first[: 3 * PS], None) is prefix.walk(first)[2]
    alloc.free_request(again)
    alloc.parts.writer.write(prefix.evict(prefix.num_evictable))  # every chain gone
    assert prefix.walk(other) == [] and prefix.own_chain_end(again, other[:PS], None) is None
    alloc.check_integrity()
