"""The prefix cache's host tier does O(1) host work per spill and per reload
(issue 41, "the host tier at line rate"): the spill of N cached pages and the
reload of their hit make the same number of copies, of torch calls, of calls of
unikv's own Python functions (comprehensions and generator expressions included)
and of heap operations whether N is 8 or 40; only the bytes grow. Spies: a
``sys.setprofile`` hook counting Python-level calls into ``unikv/`` and C calls of
``heapq``, and a ``TorchFunctionMode`` counting torch calls and copies. Checked
against the work actually done: every page went to the host and came back, and
the reloaded envelopes equal the bytes written before the spill (read back
through the pool's rows, a second description of the same bytes)."""

from __future__ import annotations

import os
import sys
from collections import Counter

import numpy as np
import torch

from unikv.allocator import PoolAllocator
from unikv.io.envelopes import page_rows
from unikv.io.prefix_host import ReloadPolicy
from unikv.io.prefix_host_setup import enable_prefix_host
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

PS = 4
UNIKV = os.sep + "unikv" + os.sep
CONFIG = SubPoolConfig("full", MHASpec(2, 1, 8, dtype=torch.float32), page_size=PS)


class TorchCalls(torch.overrides.TorchFunctionMode):
    """Counts every torch function call, and the copies among them."""

    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        self.counts["torch"] += 1
        self.counts["copies"] += name in ("copy_", "index_copy_", "index_select")
        return func(*args, **(kwargs or {}))


def spied(fn) -> tuple[object, Counter]:
    """(fn(), counts of the calls it made)."""
    counts: Counter = Counter()

    def hook(frame, event, arg) -> None:
        if event == "call" and UNIKV in frame.f_code.co_filename:
            counts["python"] += 1
        elif event == "c_call" and getattr(arg, "__module__", None) in ("heapq", "_heapq"):
            counts["heap"] += 1

    with TorchCalls(counts):
        sys.setprofile(hook)
        try:
            out = fn()
        finally:
            sys.setprofile(None)
    return out, counts


def spill_and_reload(n: int) -> tuple[Counter, Counter]:
    """Cache ``n`` pages of one prompt, spill them all, reload them by a hit; the
    calls each made."""
    pool = UnifiedPool([CONFIG], pool_bytes_for([CONFIG], {"full": n + 6}))
    alloc = PoolAllocator(pool, max_requests=2, max_context=(n + 2) * PS)
    host = enable_prefix_host(alloc, (n + 4) * pool["full"].page_bytes, ReloadPolicy("always"))
    prefix = alloc.parts.prefix
    tokens = np.arange(n * PS + 1) + 7
    slot = alloc.new_request()
    alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([len(tokens)]))
    rows, book = page_rows(pool, "full"), alloc.parts.books["full"]
    vpages = alloc.parts.requests.pages[slot, :n].copy()
    written = torch.randn(n, rows.shape[1] // 4).view(torch.uint8)
    rows[torch.from_numpy(book.v2p_host[vpages].astype(np.int64))] = written
    alloc.prefix.insert(slot, tokens)
    alloc.free_request(slot)

    _, spill = spied(lambda: alloc.parts.writer.write(prefix.evict(prefix.num_evictable)))
    assert host.stats.spilled_pages == n and len(host.nodes) == n, "every page spilled"
    found = alloc.prefix.match(tokens)
    assert found.num_host_pages == n
    hit, reload = spied(lambda: alloc.prefix.reload(found))
    assert hit.num_host_pages == 0 and hit.num_tokens == n * PS and not host.nodes
    back = torch.from_numpy(book.v2p_host[hit.pages].astype(np.int64))
    assert torch.equal(rows[back], written), "the reloaded envelopes are the spilled bytes"
    alloc.check_integrity()
    return spill, reload


def test_spill_and_reload_host_work_does_not_grow_with_the_pages() -> None:
    small, large = spill_and_reload(8), spill_and_reload(40)
    for what, few, many in zip(("spill", "reload"), small, large, strict=True):
        assert few == many, f"{what}: calls grow with the pages: {dict(few)} -> {dict(many)}"
        assert many["copies"] <= 2, f"{what}: a run of pages is one copy, got {dict(many)}"
