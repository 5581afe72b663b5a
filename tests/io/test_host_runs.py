"""The host tier's run-coalesced copies (issue 41, "the host tier at line rate"):
ascending free slots go to ascending pages, and each run where the pages and the
slots are both consecutive moves as one byte range (page-major: one envelope per
page, consecutive pages one range); the rest through the staging gather.

Checked against a second description of the same bytes: the per-page checksums of
``io/checksum.py`` of the source pages before the round trip against those of the
destination pages after it (and the host rows in between), under hypothesis-drawn
page sets, destination sets, fragmented free lists and all three copy paths; the
untouched bytes against a naive per-page slice write of the whole buffer; the number
of copies against the maximal runs counted by hand."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_io_support import make_pool, naive_expected

from unikv.ids import PhysicalPageIds
from unikv.io import HostPageIds, HostTier
from unikv.io.checksum import mismatched_pages, page_checksums
from unikv.io.envelopes import page_rows, pair_runs

NAME = "full"
SLOTS = 10


def _paths(page_bytes: int) -> dict[str, dict]:
    """direct (every envelope alone or in runs), gather (all staged), mixed (runs of
    two or more pages direct, single pages staged)."""
    return {
        "direct": {"direct_min_bytes": 0},
        "gather": {"direct_min_bytes": 1 << 40},
        "mixed": {"direct_min_bytes": 2 * page_bytes},
    }


def _ids(pages: list[int]) -> PhysicalPageIds:
    return PhysicalPageIds(torch.tensor(pages, dtype=torch.int64), NAME)


class CountCopies(torch.overrides.TorchFunctionMode):
    """Counts ``Tensor.copy_`` and ``index_copy_`` / ``index_select`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = self.gathers = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        self.copies += name == "copy_"
        self.gathers += name in ("index_copy_", "index_select")
        return func(*args, **(kwargs or {}))


@st.composite
def round_trips(draw):
    """(path, taken slots to free first, source pages, destination pages)."""
    pool = make_pool(pages=24)
    sub = pool[NAME]
    real = list(range(sub.first_page, sub.first_page + sub.usable_pages))
    n = draw(st.integers(1, min(8, SLOTS - 2)))
    if draw(st.booleans()):  # a run of consecutive pages, in a drawn order
        start = draw(st.integers(real[0], real[-1] - n + 1))
        src = draw(st.permutations(list(range(start, start + n))))
    else:
        src = draw(st.lists(st.sampled_from(real), min_size=n, max_size=n, unique=True))
    dst = draw(st.lists(st.sampled_from(real), min_size=n, max_size=n, unique=True))
    hole = draw(st.lists(st.integers(0, SLOTS - 1), max_size=SLOTS - n, unique=True))
    path = draw(st.sampled_from(["direct", "gather", "mixed"]))
    return pool, path, hole, src, dst


@settings(max_examples=40, deadline=None)
@given(round_trips())
def test_offload_reload_round_trips_keep_every_page_by_checksum(case) -> None:
    pool, path, hole, src, dst = case
    page_bytes = pool[NAME].page_bytes
    tier = HostTier(pool, NAME, SLOTS, staging_bytes=2 * page_bytes, **_paths(page_bytes)[path])
    rows = page_rows(pool, NAME)
    # fragment the free list: take every slot, give back the drawn ones
    everything = tier.offload(_ids(list(range(1, SLOTS + 1))))
    tier.free(HostPageIds(torch.tensor(hole, dtype=torch.int64)))
    keep = [s for s in everything.host_slots.data.tolist() if s not in hole]
    if tier.num_free < len(src):
        assert tier.offload(_ids(src)) is None  # no room: nothing taken
        return
    original = pool.buffer.clone()
    want = page_checksums(rows[torch.tensor(src)])
    copy = tier.offload(_ids(src))
    got = copy.host_slots.data.tolist()
    assert sorted(got) == sorted(hole)[: len(src)], "the lowest free slots"
    assert got == [sorted(got)[sorted(src).index(p)] for p in src], "by page order"
    assert mismatched_pages(want, page_checksums(tier.host[torch.tensor(got)])) == []
    scrambled = torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8)
    pool.buffer.copy_(scrambled)  # the reload must read the host, not the pool
    tier.reload(copy.host_slots, _ids(dst)).wait()
    assert mismatched_pages(want, page_checksums(rows[torch.tensor(dst)])) == []
    assert torch.equal(pool.buffer, naive_expected(scrambled, original, page_bytes, src, dst))
    for slot in keep:  # the first offload's other slots are untouched
        page = 1 + everything.host_slots.data.tolist().index(slot)
        want_row = original[page * page_bytes : (page + 1) * page_bytes]
        assert torch.equal(tier.host[slot], want_row)


@pytest.mark.parametrize("path", ["direct", "mixed"])
def test_a_run_of_consecutive_pages_moves_in_one_copy_each_way(path: str) -> None:
    pool = make_pool(pages=24)
    page_bytes = pool[NAME].page_bytes
    tier = HostTier(pool, NAME, SLOTS, **_paths(page_bytes)[path])
    pages = [9, 7, 8, 6, 5]  # one run (5..9) in a scrambled order
    with CountCopies() as out:
        copy = tier.offload(_ids(pages))
    assert (out.copies, out.gathers) == (1, 0), "one range D2H copy, no staging"
    with CountCopies() as back:
        tier.reload(copy.host_slots, _ids([14, 12, 13, 11, 10]))
    assert (back.copies, back.gathers) == (1, 0), "one range H2D copy, no staging"
    rows = page_rows(pool, NAME)
    assert torch.equal(rows[torch.tensor([14, 12, 13, 11, 10])], rows[torch.tensor(pages)])


def test_mixed_path_stages_only_the_single_pages() -> None:
    pool = make_pool(pages=24)
    page_bytes = pool[NAME].page_bytes
    tier = HostTier(pool, NAME, SLOTS, **_paths(page_bytes)["mixed"])
    with CountCopies() as out:
        tier.offload(_ids([3, 4, 5, 9, 12]))  # run 3..5 direct; 9 and 12 staged
    # one range copy, one gather, then one staged copy per run of slots (3, 4 in a row)
    assert (out.copies, out.gathers) == (2, 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=16))
def test_pair_runs_are_the_maximal_runs_of_both_lists(pairs) -> None:
    pages, slots = [p for p, _ in pairs], [s for _, s in pairs]
    rebuilt = []
    for index, first, length in pair_runs(pages, slots):
        assert index == len(rebuilt) and length >= 1
        assert pages[index : index + length] == list(range(first, first + length))
        assert slots[index : index + length] == list(range(slots[index], slots[index] + length))
        rebuilt.extend(range(index, index + length))
        end = index + length
        if end < len(pages):  # maximal: the next pair breaks one of the two runs
            assert pages[end] != pages[end - 1] + 1 or slots[end] != slots[end - 1] + 1
    assert rebuilt == list(range(len(pages)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_runs_round_trip_on_cuda_side_streams_by_checksum() -> None:
    """On a CUDA pool (pinned slots, side streams, events): runs of 256 KiB pages
    (a run of four or more crosses the 1 MiB direct threshold) and stray pages round
    trip byte for byte; the current stream only waits on the device."""
    from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
    from unikv.specs import MHASpec

    config = SubPoolConfig("kv", MHASpec(4, 8, 128, dtype=torch.bfloat16), page_size=16)
    pool = UnifiedPool([config], pool_bytes_for([config], {"kv": 96}), "cuda")
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, device="cuda"))
    tier = HostTier(pool, "kv", 48)
    rows = page_rows(pool, "kv")
    src = [*range(40, 56), 3, 9, *range(20, 26), 70]  # runs of 16 and 6, three strays
    dst = [*range(60, 69), *range(80, 90), 5, 7, 11, 13, 15, 17]
    want = page_checksums(rows[torch.tensor(src, device="cuda")])
    copy = tier.offload(PhysicalPageIds(torch.tensor(src), "kv"))
    assert copy.event is not None and copy.host_slots.data.numel() == len(src)
    copy.synchronize()
    pool.buffer.zero_()  # the reload must read the host slots
    back = tier.reload(copy.host_slots, PhysicalPageIds(torch.tensor(dst), "kv"))
    back.wait()  # the current stream waits for the side stream's copy
    got = page_checksums(rows[torch.tensor(dst, device="cuda")])
    assert mismatched_pages(want, got) == []
    others = torch.ones(rows.shape[0], dtype=torch.bool, device="cuda")
    others[torch.tensor(dst, device="cuda")] = False
    assert not rows[others].any(), "no other page is written"
