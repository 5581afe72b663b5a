"""Bad input gets a clear error and leaves every byte of allocator state as it
was (snapshot digest of host mirrors, device tables and the pool buffer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import build, snapshot

from unikv.allocator import PoolAllocator
from unikv.ids import PhysicalPageIds, VirtualPageIds, VirtualTokenIds


@pytest.fixture
def busy():
    _, alloc = build("full+swa+mamba", 4, requests=3, context=40)
    a, b = alloc.new_request(), alloc.new_request()
    alloc.alloc_extend(np.array([a, b]), np.array([0, 0]), np.array([6, 9]))
    alloc.alloc_mamba(np.array([a]))
    return alloc, a, b


CASES = {
    "double free": (
        lambda al, a, b: (al.free_request(a), al.free_request(a)),
        ValueError,
        "not open",
    ),
    "free never opened": (lambda al, a, b: al.free_request(2), ValueError, "not open"),
    "free bad slot": (lambda al, a, b: al.free_request(-1), ValueError, r"\[0, 3\)"),
    "stale prefix": (
        lambda al, a, b: al.alloc_extend(np.array([a]), np.array([5]), np.array([1])),
        ValueError,
        "hold",
    ),
    "stale decode": (
        lambda al, a, b: al.alloc_decode(np.array([a, b]), np.array([6, 8])),
        ValueError,
        "hold",
    ),
    "closed slot": (
        lambda al, a, b: al.alloc_decode(np.array([2]), np.array([0])),
        ValueError,
        "not open",
    ),
    "repeated slot": (
        lambda al, a, b: al.alloc_decode(np.array([a, a]), np.array([6, 6])),
        ValueError,
        "distinct",
    ),
    "past max_context": (
        lambda al, a, b: al.alloc_extend(np.array([a]), np.array([6]), np.array([35])),
        ValueError,
        "max_context",
    ),
    "float slots": (
        lambda al, a, b: al.alloc_decode(np.array([0.0]), np.array([6])),
        ValueError,
        "integer",
    ),
    "release unowned": (
        lambda al, a, b: al.io.release_physical("full", VirtualPageIds(torch.tensor([20]))),
        ValueError,
        "belong to no request",
    ),
    "release twice": (
        lambda al, a, b: [
            al.io.release_physical("full", VirtualPageIds(torch.tensor([1]))) for _ in range(2)
        ],
        ValueError,
        "hold no physical page",
    ),
    "release physical ids": (
        lambda al, a, b: al.io.release_physical("full", PhysicalPageIds(torch.tensor([1]), "full")),
        TypeError,
        "VirtualPageIds",
    ),
    "bind bound": (
        lambda al, a, b: al.io.bind_physical("swa", VirtualPageIds(torch.tensor([1]))),
        ValueError,
        "already bound",
    ),
    "mamba twice": (lambda al, a, b: al.alloc_mamba(np.array([a])), ValueError, "already hold"),
    "free mamba none": (
        lambda al, a, b: al.parts.mamba.free(np.array([b])),
        ValueError,
        "hold no slot",
    ),
    "unpin unpinned": (
        lambda al, a, b: al.io.unpin(
            "full", PhysicalPageIds(torch.tensor([al.parts.books["full"].v2p_host[1]]), "full")
        ),
        ValueError,
        "not pinned",
    ),
    "unknown demand": (lambda al, a, b: al.can_admit({"nope": 1}), ValueError, "nope"),
    "negative demand": (lambda al, a, b: al.can_admit({"full": -1}), ValueError, "non-negative"),
    "truncate past": (
        lambda al, a, b: al.truncate(np.array([a]), np.array([7])),
        ValueError,
        "tokens held",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_and_state_unchanged(busy, case):
    alloc, a, b = busy
    call, error, match = CASES[case]
    if case in ("double free", "release twice"):  # the first call is legal
        with pytest.raises(error, match=match):
            call(alloc, a, b)
        return
    before = snapshot(alloc)
    with pytest.raises(error, match=match):
        call(alloc, a, b)
    assert snapshot(alloc) == before
    alloc.check_integrity()


def test_double_free_leaves_state_unchanged(busy):
    alloc, a, _ = busy
    alloc.free_request(a)
    before = snapshot(alloc)
    with pytest.raises(ValueError, match="not open"):
        alloc.free_request(a)
    assert snapshot(alloc) == before


def test_beyond_capacity_returns_none_with_state_unchanged(busy):
    alloc, _, _ = busy
    c = alloc.new_request()
    before = snapshot(alloc)
    assert alloc.can_admit(alloc.parts.tokens.demand_for(np.array([c]), np.array([40]))) == (
        False,
        False,
    )
    assert alloc.alloc_extend(np.array([c]), np.array([0]), np.array([40])) is None
    assert snapshot(alloc) == before
    while alloc.alloc_mamba(np.array([c])) is not None:
        alloc.parts.mamba.free(np.array([c]))
        break
    with pytest.raises(ValueError, match="request slots are open"):
        alloc.new_request()


def test_construction_errors():
    pool, _ = build("full+swa", 1)
    with pytest.raises(ValueError, match="max_requests"):
        PoolAllocator(pool, max_requests=0, max_context=8)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        PoolAllocator(pool, max_requests=2**16, max_context=2**16)
    from allocator_fixtures import full_config, swa_config

    from unikv.pool import UnifiedPool, pool_bytes_for

    configs = [full_config(1), swa_config(16)]
    mixed = UnifiedPool(configs, pool_bytes_for(configs, {"full": 8, "swa": 8}))
    with pytest.raises(ValueError, match="one page size"):
        PoolAllocator(mixed, max_requests=2, max_context=8)


def test_translate_refuses_raw_tensors(busy):
    alloc, _, _ = busy
    with pytest.raises(TypeError):
        alloc.translate(torch.tensor([4]), "full")
    assert len(alloc.translate(VirtualTokenIds(torch.tensor([4])), "full")) == 1
