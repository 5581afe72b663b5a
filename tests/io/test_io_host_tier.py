"""Host tier: offload -> reload round trips are byte-identical, through both
copy paths, checked against the layout's (page, slot) views and a naive
per-page slice write of the whole buffer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_io_support import (
    CONFIGS,
    MLA_CONFIGS,
    assert_same_contents,
    make_pool,
    naive_expected,
    page_contents,
)

from unikv.ids import PhysicalPageIds, VirtualPageIds
from unikv.io import HostPageIds, HostTier
from unikv.io.envelopes import runs

PATHS = {"direct": {"direct_min_bytes": 0}, "gather": {"direct_min_bytes": 1 << 40}}


def _pages(ids: list[int], name: str) -> PhysicalPageIds:
    return PhysicalPageIds(torch.tensor(ids, dtype=torch.int64), name)


def _pick(pool, name: str, n: int, seed: int) -> tuple[list[int], list[int]]:
    """Two disjoint random lists of n real (non-sink) pages."""
    sub = pool[name]
    perm = torch.randperm(sub.usable_pages, generator=torch.Generator().manual_seed(seed))
    perm = (perm + sub.first_page).tolist()
    return perm[:n], perm[n : 2 * n]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", ["full", "swa", "mamba", "mla"])
def test_offload_then_reload_into_other_pages(name: str, path: str) -> None:
    pool = make_pool(MLA_CONFIGS if name == "mla" else CONFIGS)
    page_bytes = pool[name].page_bytes
    # staging of 2 envelopes forces several gather chunks
    tier = HostTier(pool, name, 8, staging_bytes=2 * page_bytes, **PATHS[path])
    src, dst = _pick(pool, name, 5, seed=len(name))
    original = pool.buffer.clone()
    want = page_contents(pool, name, src)

    copy = tier.offload(_pages(src, name))
    assert copy is not None and copy.done()
    slots = copy.host_slots.data.tolist()
    for s, slot in zip(src, slots):  # host slot == the envelope's bytes
        assert torch.equal(tier.host[slot], original[s * page_bytes : (s + 1) * page_bytes])

    scrambled = torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8)
    pool.buffer.copy_(scrambled)  # reload must read the host tier, not the pool
    tier.reload(copy.host_slots, _pages(dst, name))
    assert_same_contents(page_contents(pool, name, dst), want)
    assert torch.equal(pool.buffer, naive_expected(scrambled, original, page_bytes, src, dst))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_freed_slots_are_reused_lowest_first_across_runs(path: str) -> None:
    pool = make_pool()
    name, page_bytes = "full", pool["full"].page_bytes
    tier = HostTier(pool, name, 6, staging_bytes=3 * page_bytes, **PATHS[path])
    first = tier.offload(_pages([2, 3, 4, 5, 6, 7], name))
    assert first.host_slots.data.tolist() == [0, 1, 2, 3, 4, 5]
    tier.free(HostPageIds(torch.tensor([1, 3, 4])))
    assert tier.num_free == 3
    original = pool.buffer.clone()
    second = tier.offload(_pages([9, 11, 8], name))
    # the free slots [1, 3, 4], lowest first, go to the pages in ascending order (8, 9,
    # 11), so consecutive pages meet consecutive slots: runs [1] and [3, 4]
    assert second.host_slots.data.tolist() == [3, 4, 1]
    for page, slot in zip([9, 11, 8], [3, 4, 1]):
        assert torch.equal(tier.host[slot], original[page * page_bytes : (page + 1) * page_bytes])
    for page, slot in zip([2, 4, 7], [0, 2, 5]):  # untouched slots keep the first offload
        assert torch.equal(tier.host[slot], original[page * page_bytes : (page + 1) * page_bytes])


def test_full_tier_returns_none_and_keeps_state() -> None:
    pool = make_pool()
    tier = HostTier(pool, "full", 3)
    assert tier.offload(_pages([2, 3], "full")) is not None
    host_before = tier.host.clone()
    assert tier.offload(_pages([4, 5], "full")) is None
    assert tier.num_free == 1 and torch.equal(tier.host, host_before)


def test_bad_inputs_are_refused_with_state_unchanged() -> None:
    pool = make_pool()
    tier = HostTier(pool, "full", 4)
    sub = pool["full"]
    with pytest.raises(ValueError, match="sink"):
        tier.offload(_pages([0], "full"))
    with pytest.raises(ValueError, match=r"\[.*\)"):
        tier.offload(_pages([sub.num_pages], "full"))
    with pytest.raises(ValueError, match="distinct"):
        tier.offload(_pages([3, 3], "full"))
    with pytest.raises(TypeError, match="PhysicalPageIds"):
        tier.offload(VirtualPageIds(torch.tensor([3])))
    with pytest.raises(TypeError, match="sub-pool"):
        tier.offload(PhysicalPageIds(torch.tensor([3]), "swa"))
    assert tier.num_free == 4
    copy = tier.offload(_pages([3, 4], "full"))
    with pytest.raises(ValueError, match="one page per host slot"):
        tier.reload(copy.host_slots, _pages([5], "full"))
    with pytest.raises(ValueError, match="taken by offload"):
        tier.reload(HostPageIds(torch.tensor([3])), _pages([5], "full"))
    tier.free(copy.host_slots)
    with pytest.raises(ValueError, match="taken by offload"):
        tier.free(copy.host_slots)  # double free
    assert tier.num_free == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), unique=True, max_size=20))
def test_runs_cover_the_slot_list(slots: list[int]) -> None:
    rebuilt = []
    for index, first, length in runs(slots):
        assert index == len(rebuilt) and length >= 1
        rebuilt.extend(range(first, first + length))
    assert rebuilt == slots
    # maximal: consecutive runs do not continue each other
    ends = [
        (first + length, slots[i + length] if i + length < len(slots) else None)
        for i, first, length in runs(slots)
    ]
    assert all(end != nxt for end, nxt in ends)
