"""Translation edge cases: kernel ids address the same bytes as the (page, slot)
oracle view, tombstones and padding go to the sink at every page size (never
v2p[-1]), debug mode raises on live tombstone reads, ``out=`` may alias its
input and only the filled prefix is written, and the block table equals a
naive per-entry loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import CHAINS, build

from unikv import layout
from unikv.allocator import PoolAllocator, TombstoneReadError
from unikv.allocator.translate import check_tombstones, translate
from unikv.ids import PhysicalPageIds, VirtualTokenIds
from unikv.kernels import get_backend
from unikv.pool import UnifiedPool, pool_bytes_for


@pytest.mark.parametrize("ps", [1, 16])
def test_kernel_ids_hit_the_oracle_rows(ps):
    pool, alloc = build("full+swa", ps, requests=2)
    r = alloc.new_request()
    ids = alloc.alloc_extend(np.array([r]), np.array([0]), np.array([3 * ps - 1]))
    for name in alloc.parts.roles.token_names:
        kernel = alloc.translate(ids, name).data.long()
        physical = alloc.translate(ids, name, physical=True).data
        assert torch.equal(
            kernel, layout.kernel_ids(physical.long(), ps, pool[name].blocks_per_page)
        )
        values = torch.arange(1, len(ids) + 1, dtype=torch.float32)
        for layer, (k, v) in enumerate(pool[name].views):
            k[kernel] = values[:, None, None] + 1000 * layer
            v[kernel] = -values[:, None, None]
        v2p = alloc.parts.books[name].v2p_host  # oracle: page v2p[tv // ps], slot tv % ps
        tv = ids.data.numpy()
        pages, slots = v2p[tv // ps], tv % ps
        for layer, (k, v) in enumerate(pool[name].paged_views):
            assert torch.equal(k[pages, slots][:, 0, 0], values + 1000 * layer)
            assert torch.equal(v[pages, slots][:, 0, 0], -values)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_padding_and_tombstones_go_to_the_sink_never_v2p_minus_one(ps, backend):
    v2p = torch.tensor([0, 3, -1, 5, 77], dtype=torch.int32)  # v2p[-1] = 77 is a trap
    ids = torch.tensor(
        [-1, -ps, -3 * ps - 1, ps + 1 % ps, 2 * ps, 3 * ps + ps - 1], dtype=torch.int32
    )
    got = translate(get_backend("cpu", backend).translate_ids, ids, v2p, ps, ps * 6, None).tolist()
    # by hand: padding and the tombstone (page 2) read page 0; others P*ps*B + slot
    slot = lambda t: t % ps
    want = [slot(-1), 0, slot(-3 * ps - 1), 3 * ps * 6 + 1 % ps, 0, 5 * ps * 6 + ps - 1]
    assert got == want
    assert all(g < ps for g in got[:3]) and got[4] < ps, "sink rows only"
    with pytest.raises(TombstoneReadError, match="tombstoned"):
        check_tombstones(ids, v2p, ps, "full")


def test_out_aliases_input_and_only_the_prefix_is_written():
    _, alloc = build("full+swa", 16, requests=2)
    r = alloc.new_request()
    ids = alloc.alloc_extend(np.array([r]), np.array([0]), np.array([20]))
    expected = alloc.translate(ids, "full").data.clone()
    buffer = torch.full((32,), -7, dtype=torch.int32)
    buffer[:20] = ids.data
    ptr = buffer.data_ptr()
    out = alloc.translate(VirtualTokenIds(buffer[:20]), "full", out=buffer).data
    assert buffer.data_ptr() == ptr and out.data_ptr() == ptr
    assert torch.equal(buffer[:20], expected) and (buffer[20:] == -7).all()
    with pytest.raises(ValueError, match="at least 20"):
        alloc.translate(ids, "full", out=torch.zeros(5, dtype=torch.int32))


def test_debug_mode_raises_on_out_of_window_reads():
    _, alloc = build("full+swa", 1, requests=2, context=24, debug=True)
    r = alloc.new_request()
    first = alloc.alloc_extend(np.array([r]), np.array([0]), np.array([6]))
    alloc.free_out_of_window(np.array([r]), np.array([6]))
    second = alloc.alloc_extend(np.array([r]), np.array([6]), np.array([4]))
    alloc.free_out_of_window(np.array([r]), np.array([10]))  # window 5: tokens 0..4 leave
    ids = VirtualTokenIds(torch.cat([first.data, second.data]))
    alloc.translate(ids, "full")  # full attention keeps every page
    with pytest.raises(TombstoneReadError):
        alloc.translate(ids, "swa")
    assert len(alloc.translate(VirtualTokenIds(ids.data[5:]), "swa")) == 5
    table = torch.zeros((1, 24), dtype=torch.int32)
    slots, lens = torch.tensor([r], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    alloc.block_table(slots, lens, "swa", table)  # live lanes are inside the window: fine
    alloc.parts.books["swa"].v2p[
        ids.data[8]
    ] = -1  # corrupt a live page behind the allocator's back
    with pytest.raises(TombstoneReadError):
        alloc.block_table(slots, lens, "swa", table)


@pytest.mark.parametrize("ps", [1, 16])
def test_block_table_matches_naive_loop(ps):
    _, alloc = build("full+swa", ps, requests=4)
    rng = np.random.default_rng(ps)
    slots = [alloc.new_request() for _ in range(3)]
    for _ in range(6):
        s = int(rng.choice(slots))
        ext = int(rng.integers(1, 2 * ps + 1))
        if alloc.parts.requests.lens[s] + ext <= alloc.parts.requests.max_context:
            alloc.alloc_extend(np.array([s]), alloc.parts.requests.lens[[s]], np.array([ext]))
    alloc.free_out_of_window(np.array(slots), alloc.parts.requests.lens[slots])
    lens = alloc.parts.requests.lens[slots]
    cols = alloc.parts.requests.max_pages
    for name in alloc.parts.roles.token_names:
        out = torch.full((3, cols), 99, dtype=torch.int32)
        alloc.block_table(
            torch.tensor(slots, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), name, out
        )
        sub, r2t = alloc.parts.books[name], alloc.parts.requests.req_to_token
        for b, s in enumerate(slots):
            for j in range(cols):
                want = 0
                if j * ps < lens[b]:
                    page = int(sub.v2p_host[int(r2t[s, j * ps]) // ps])
                    want = page * sub.blocks_per_page if page >= 0 else 0
                assert int(out[b, j]) == want, (name, b, j)


def test_wrong_id_kinds_are_refused():
    _, alloc = build("full+swa+mamba", 1, requests=2)
    r = alloc.new_request()
    alloc.alloc_extend(np.array([r]), np.array([0]), np.array([2]))
    with pytest.raises(TypeError, match="VirtualTokenIds"):
        alloc.translate(PhysicalPageIds(torch.tensor([1]), "full"), "full")
    with pytest.raises(TypeError, match="VirtualTokenIds"):
        alloc.translate(torch.tensor([1]), "full")
    with pytest.raises(ValueError, match="Mamba"):
        alloc.translate(VirtualTokenIds(torch.tensor([1])), "mamba")
    with pytest.raises(TypeError, match="of sub-pool 'swa'"):
        alloc.io.pin("swa", PhysicalPageIds(torch.tensor([1]), "full"))


@pytest.mark.parametrize("chain", ["full+swa", "mla+swa"])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_host_row_kernel_ids_equal_the_device_translation(chain, ps):
    """``view.row_kernel_ids`` (host mirror, numpy) equals ``translate`` on the device
    of the same rows gathered from ``req_to_token`` byte for byte, in every token
    sub-pool (blocks per page > 1 included), after frees, a cut, window frees
    (tombstones: the sink page) and compaction's moves."""
    configs = CHAINS[chain](ps)
    pool = UnifiedPool(configs, pool_bytes_for(configs, {c.name: 16 for c in configs}))
    alloc = PoolAllocator(pool, max_requests=3, max_context=10 * ps)
    view, names = alloc.view, alloc.parts.roles.token_names
    assert any(pool[n].blocks_per_page > 1 for n in names)
    a, b, c = (alloc.new_request() for _ in range(3))
    alloc.alloc_extend(np.array([a, b]), np.array([0, 0]), np.array([3 * ps + 1, 3 * ps]))
    alloc.alloc_extend(np.array([c]), np.array([0]), np.array([2 * ps]))
    alloc.truncate(np.array([b]), np.array([2 * ps - 1]))
    alloc.alloc_extend(np.array([c]), np.array([2 * ps]), np.array([4 * ps + 2]))
    alloc.free_request(a)  # (holes under b and c: compaction moves their pages)
    alloc.free_out_of_window(np.array([c]), np.array([6 * ps + 2]))  # swa tombstones
    moves = []

    def check() -> None:
        slots = np.array([b, c])
        lens = view.allocated_lens(slots)
        starts = np.array([1, 0])
        counts = lens - starts
        ids = VirtualTokenIds(view.token_vids(slots, starts, counts))
        host = view.row_vids(slots, starts, counts)
        assert host.tolist() == ids.data.tolist()
        for name in names:
            want = alloc.translate(ids, name).data.long().numpy().tobytes()
            assert view.row_kernel_ids(name, host).tobytes() == want, name

    check()
    moves.append(alloc.compact())
    check()
    assert moves[0] > 0, "compaction moved nothing: the test did not reach a move"
    tomb = alloc.parts.books["swa"].v2p_host[view.row_vids([c], [0], [1]) // ps]
    assert (tomb < 0).all(), "the swa window left no tombstone in the rows read"
    with pytest.raises(ValueError, match="not a token sub-pool"):
        view.row_kernel_ids("nope", np.zeros(1, np.int64))


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_row_vids_repeat_calls_equal_the_device_gather(ps):
    """``view.row_vids`` (host, keeping what depends on slots and counts only for the
    next call with the same ones) equals ``token_vids`` (a gather of ``req_to_token``
    on the device) over calls that repeat (slots, counts) with other starts (a steady
    verify step's rows), one count each and ragged counts, counts of 0, slots in
    another order, and after a cut, a regrow and compaction's moves changed the
    pages; rows not held are refused, naming them."""
    configs = CHAINS["full+swa"](ps)
    pool = UnifiedPool(configs, pool_bytes_for(configs, {c.name: 24 for c in configs}))
    alloc = PoolAllocator(pool, max_requests=3, max_context=12 * ps)
    view, rng = alloc.view, np.random.default_rng(ps)
    slots = np.array([alloc.new_request() for _ in range(3)])
    grown = alloc.alloc_extend(slots, np.zeros(3, np.int64), np.array([5 * ps, 7 * ps + 1, 4 * ps]))
    assert grown is not None

    def check(slots: np.ndarray, counts: np.ndarray) -> None:
        lens = view.allocated_lens(slots)
        for _ in range(3):  # the same slots and counts, other starts
            starts = rng.integers(0, lens - counts + 1)
            host = view.row_vids(slots, starts, counts)
            assert host.dtype == np.int64
            assert host.tolist() == view.token_vids(slots, starts, counts).tolist()

    check(slots, np.array([3, 3, 3]))
    check(slots[::-1].copy(), np.array([3, 3, 3]))  # (other slots, the same counts)
    for counts in ([1, 4, 2], [0, 2, 0], [1, 2, 4], [4, 4, 4]):
        check(slots, np.array(counts))
    alloc.truncate(slots[:1], np.array([2 * ps]))
    alloc.free_request(int(slots[2]))  # (holes under the others: compaction moves)
    alloc.alloc_extend(slots[:1], np.array([2 * ps]), np.array([3 * ps]))
    assert alloc.compact() > 0, "compaction moved nothing: the test did not reach a move"
    check(slots[:2], np.array([3, 3]))
    check(slots[:2], np.array([2, 5]))
    with pytest.raises(ValueError, match="rows must be held"):
        view.row_vids(slots[:2], np.array([5 * ps - 1, 0]), np.array([2, 1]))
    with pytest.raises(ValueError, match="rows must be held"):
        view.row_vids(slots[:1], np.array([-1]), np.array([1]))
