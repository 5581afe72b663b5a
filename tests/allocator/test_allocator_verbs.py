"""The objects the facade hands out (``alloc.prefix``, ``alloc.io``, ``alloc.view``)
and ``resize``: in debug mode each mutating verb ends with ``check_integrity``, as
the facade's own verbs do, and the read-only view reads what the parts hold.

Oracle for the debug check: a planted broken invariant (one device ``v2p`` entry no
verb touches, off its host mirror) makes the verb raise the check's named
AssertionError in debug mode, and nothing outside it. The view is compared with
the page books and request table it reads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import CHAINS, PAGES, build

from unikv.allocator import PoolAllocator
from unikv.allocator.pages import LIVE
from unikv.backing import EmulatedBacking
from unikv.ids import PhysicalPageIds, VirtualPageIds
from unikv.pool import UnifiedPool, pool_bytes_for

PS = 4


def served(debug: bool):
    """A full+swa+mamba allocator holding one request of 9 tokens, its state slot
    bound and its first two pages shared with the prefix cache."""
    _, alloc = build("full+swa+mamba", PS, debug=debug)
    slot = alloc.new_request()
    alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([9]))
    alloc.alloc_mamba(np.array([slot]))
    alloc.prefix.insert(slot, np.arange(8))
    return alloc, slot


def plant(alloc) -> None:
    """Break one invariant no verb below touches: the last virtual page of ``full``
    (never minted here) reads a page on the device but not on the host."""
    alloc.parts.books["full"].v2p[-1] = 3


def _verbs(alloc, slot):
    """(name, call) per mutating verb of the handed-out objects and the facade's resize."""
    vpage = int(alloc.parts.requests.pages[slot, 2])  # the request's own, unshared page
    v = VirtualPageIds(torch.tensor([vpage], dtype=torch.int32), "full")
    page = lambda: PhysicalPageIds(torch.from_numpy(alloc.io.physical_pages("full", v)), "full")
    return [
        ("prefix.insert", lambda: alloc.prefix.insert(slot, np.arange(8))),
        ("prefix.checkpoint", lambda: alloc.prefix.checkpoint(slot, np.arange(8))),
        ("prefix.demote_checkpoint", lambda: alloc.prefix.demote_checkpoint(np.arange(8))),
        ("prefix.reload", lambda: alloc.prefix.reload(alloc.prefix.match(np.arange(8)))),
        ("io.pin", lambda: alloc.io.pin("full", page())),
        ("io.unpin", lambda: alloc.io.unpin("full", page())),
        ("io.release_physical", lambda: alloc.io.release_physical("full", v)),
        ("io.bind_physical", lambda: alloc.io.bind_physical("full", v)),
        ("prefix.reset", lambda: alloc.prefix.reset()),
    ]


def test_every_handed_out_verb_runs_the_debug_check():
    alloc, slot = served(debug=True)
    plant(alloc)
    for name, call in _verbs(alloc, slot):
        with pytest.raises(AssertionError, match="device v2p mirrors the host"):
            call()
            pytest.fail(f"{name} ran no check_integrity")


def test_without_debug_the_same_verbs_do_not_check():
    alloc, slot = served(debug=False)
    plant(alloc)
    for _, call in _verbs(alloc, slot):
        call()  # the planted defect is never looked at
    with pytest.raises(AssertionError, match="device v2p mirrors the host"):
        alloc.check_integrity()


@pytest.mark.parametrize("debug", [True, False])
def test_resize_runs_the_debug_check(debug):
    configs = CHAINS["full+swa"](PS)
    total = pool_bytes_for(configs, {c.name: PAGES[c.name] for c in configs})
    pool = UnifiedPool(configs, total, max_bytes=2 * total, backing=EmulatedBacking(256))
    alloc = PoolAllocator(pool, max_requests=2, max_context=10 * PS, debug=debug)
    plant(alloc)
    if debug:
        with pytest.raises(AssertionError, match="device v2p mirrors the host"):
            alloc.resize(2 * total)
    else:
        assert alloc.resize(2 * total) == 0  # growth moves no page
    assert pool.total_bytes == 2 * total  # the resize itself ran before the check


def test_the_view_reads_the_books_and_the_request_table():
    alloc, slot = served(debug=True)
    books, req = alloc.parts.books, alloc.parts.requests
    assert alloc.view.roles is alloc.parts.roles and alloc.view.max_context == 10 * PS
    for name, book in books.items():
        states = alloc.view.page_states(name)
        assert alloc.view.live_pages(name) == int((states == LIVE).sum()) == book.num_live
        with pytest.raises(ValueError):  # read-only
            states[0] = 0
    assert alloc.view.live_pages("mamba") == 1  # the request's state slot
    assert alloc.view.window_lo(slot, "swa") == int(req.window_lo["swa"][slot])
    with pytest.raises(ValueError, match="not a sliding-window sub-pool"):
        alloc.view.window_lo(slot, "full")
    with pytest.raises(KeyError, match="no sub-pool 'nope'"):
        alloc.view.live_pages("nope")
    alloc.check_integrity()


def test_the_view_reads_allocated_lengths():
    """``allocated_lens`` against the lengths the verbs were asked for (extend adds,
    ``truncate`` sets, a freed slot reopens empty) and, page by page, against the
    virtual pages each request owns (``ceil(len / PS)``). Asked in any order; a copy."""
    _, alloc = build("full+swa", PS, requests=4, context=10 * PS)
    slots = np.array([alloc.new_request() for _ in range(3)])
    want = dict.fromkeys(slots.tolist(), 0)

    def check(ask: np.ndarray) -> None:
        got = alloc.view.allocated_lens(ask)
        assert got.dtype == np.int64 and got.tolist() == [want[s] for s in ask.tolist()]
        owner = alloc.parts.vspace.owner
        assert [int((owner == s).sum()) for s in ask.tolist()] == (-(-got // PS)).tolist()

    alloc.alloc_extend(slots, np.zeros(3, np.int64), np.array([9, 4, 10]))
    want.update(zip(slots.tolist(), [9, 4, 10], strict=True))
    check(slots[[2, 0, 1]])
    alloc.truncate(slots[2:], np.array([5]))
    want[int(slots[2])] = 5
    check(slots)
    alloc.view.allocated_lens(slots)[:] = 99  # a copy: the allocator's table is untouched
    check(slots)
    alloc.free_request(int(slots[0]))
    alloc.alloc_extend(slots[1:2], np.array([4]), np.array([3]))
    want[int(slots[1])] = 7
    again = alloc.new_request()
    assert again == slots[0]
    want[again] = 0
    check(np.array([slots[2], again, slots[1]]))
