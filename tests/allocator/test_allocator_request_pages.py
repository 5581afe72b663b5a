"""``PoolAllocator.request_pages``: what a transfer or offload of one request sends.

The expectation is derived independently of the allocator's host mirrors: page
columns from the window arithmetic, physical pages from the DEVICE tables
(``req_to_token`` then ``v2p``)."""

from __future__ import annotations

import numpy as np
import pytest
from allocator_fixtures import CHAINS, WINDOW

from unikv.allocator import PoolAllocator
from unikv.pool import UnifiedPool, pool_bytes_for


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_request_pages_match_the_device_tables_and_the_window(ps):
    configs = CHAINS["full+swa"](ps)
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": 64, "swa": 32}))
    window = WINDOW[ps]
    context = 4 * window + ps
    alloc = PoolAllocator(pool, max_requests=2, max_context=context)
    slots = [alloc.new_request(), alloc.new_request()]
    lens = [min(context - 1, 3 * window), 2 * window + 1]
    for slot, n in zip(slots, lens):  # prefill in window-sized chunks, as the engine does
        for start in range(0, n, window):
            chunk = min(window, n - start)
            ids = alloc.alloc_extend(np.array([slot]), np.array([start]), np.array([chunk]))
            assert ids is not None
            alloc.free_out_of_window(np.array([slot]), np.array([start + chunk]))
    for slot, n in zip(slots, lens):
        got = alloc.request_pages(slot)
        num_pages = -(-n // ps)
        first_tokens = alloc.parts.requests.req_to_token[slot, : num_pages * ps : ps].long()
        vpages = (first_tokens // ps).numpy()
        # SWA keeps the pages whose last position is >= n - window (docs/design.md section 5)
        last_pos = (np.arange(num_pages) + 1) * ps - 1
        expect_cols = {"full": np.arange(num_pages), "swa": np.flatnonzero(last_pos >= n - window)}
        for name in ("full", "swa"):
            cols, physical = got[name]
            assert np.array_equal(cols, expect_cols[name]), (name, cols, expect_cols[name])
            v2p = alloc.parts.books[name].v2p.long().numpy()
            assert np.array_equal(physical, v2p[vpages[cols]])
            assert (physical >= pool[name].first_page).all()  # never the sink
        assert len(got["swa"][0]) < num_pages  # pages did leave the window
