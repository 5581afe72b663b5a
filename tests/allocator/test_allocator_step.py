"""decode_step: the fused step kernel against its torch reference and a naive
per-element loop; the verb against the separate verbs on a twin allocator (every
byte of state, tables and write ids), with Triton (interpreter) and torch table
ops; bad buffers and a full pool leave the state unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import build, snapshot

from unikv.kernels import get_backend
from unikv.kernels.tables.ref import StepTarget, step_tables_ref
from unikv.kernels.tables.step_tables import step_tables


def _naive(req_to_token, slots, lens, ps, target):
    """Per request and column, straight from the definition."""
    table = target.table.clone()
    loc = target.loc.clone()
    v2p = target.v2p.tolist()
    for b, (s, n) in enumerate(zip(slots.tolist(), lens.tolist())):
        for j in range(table.shape[1]):
            live = j * ps < n and (target.window <= 0 or (j + 1) * ps > n - target.window)
            virt = int(req_to_token[s, j * ps]) if j * ps < req_to_token.shape[1] else -1
            phys = v2p[virt // ps] if live and virt >= 0 else -1
            table[b, j] = phys * target.blocks_per_page if phys >= 0 else 0
        pos = n - 1
        loc[b] = int(table[b, pos // ps]) * ps + pos % ps
    return table, loc


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_step_kernel_matches_reference_and_naive(ps):
    rng = np.random.default_rng(ps)
    rows, ctx, num_v = 6, 24 * ps, 40
    batch = 5
    slots = rng.choice(rows, batch, replace=False)
    lens = rng.integers(1, ctx + 1, batch)
    # page-consistent virtual ids (page * ps + position % ps); -1 = padding pages,
    # but never the page of a request's new (last) token
    vpages = rng.integers(-1, num_v, (rows, ctx // ps))
    vpages[slots, (lens - 1) // ps] = rng.integers(0, num_v, batch)
    pos = np.arange(ctx)
    ids = np.where(vpages[:, pos // ps] >= 0, vpages[:, pos // ps] * ps + pos % ps, -1)
    req_to_token = torch.from_numpy(np.ascontiguousarray(ids, np.int32))
    slots = torch.from_numpy(slots.astype(np.int32))
    lens = torch.from_numpy(lens.astype(np.int32))
    cols = ctx // ps + 3  # wider than needed: padding columns read the sink
    specs = [
        (1, 0, torch.int32),
        (2, 3 * ps - 1, torch.int64),
        (3, 5, torch.int32),
        (1, 1, torch.int32),
        (2, 0, torch.int64),
    ]  # fmt: skip  (5 targets: two launches)
    targets, refs = [], []
    for bpp, window, dtype in specs:
        v2p = torch.from_numpy(rng.integers(-1, 90, num_v).astype(np.int32))  # -1: tombstones
        table = torch.full((batch + 2, cols), -9, dtype=torch.int32)
        loc = torch.full((batch + 2,), -9, dtype=dtype)
        targets.append(StepTarget(v2p, bpp, window, table, loc))
        refs.append(StepTarget(v2p, bpp, window, table.clone(), loc.clone()))
    step_tables(req_to_token, slots, lens, ps, targets)
    step_tables_ref(req_to_token, slots, lens, ps, refs)
    for got, ref in zip(targets, refs):
        table, loc = _naive(req_to_token, slots, lens, ps, ref)
        assert torch.equal(ref.table[:batch], table[:batch]) and torch.equal(ref.loc, loc)
        assert torch.equal(got.table, ref.table) and torch.equal(got.loc, ref.loc)
        assert (got.table[batch:] == -9).all() and (got.loc[batch:] == -9).all()  # rows >= B


def _twins(chain_name, ps, backend):
    ops = get_backend("cpu", backend)
    return build(chain_name, ps, requests=3, backend=ops)[1], build(
        chain_name, ps, requests=3, backend=ops
    )[1]


@pytest.mark.parametrize(
    "chain_name,ps,backend",
    [("full+swa", 1, "torch"), ("full+swa", 16, "triton"), ("mla+swa", 4, "triton"),
     ("full+swa+mamba", 4, "torch")],
)  # fmt: skip
def test_decode_step_equals_the_separate_verbs(chain_name, ps, backend):
    verbs, fused = _twins(chain_name, ps, backend)
    rng = np.random.default_rng(ps)
    for alloc in (verbs, fused):
        slots = np.array([alloc.new_request() for _ in range(3)])
        prompts = rng.integers(1, 2 * ps + 1, 3)
        assert alloc.alloc_extend(slots, np.zeros(3, np.int64), prompts) is not None
        rng = np.random.default_rng(ps)  # the same prompts for both
    names = verbs.parts.roles.token_names
    windows = {n: verbs.parts.roles.windows.get(n, 0) for n in names}
    cols = verbs.parts.requests.max_pages
    buffers = {n: torch.full((4, cols), -5, dtype=torch.int32) for n in names}
    locs = {n: torch.full((4,), -5, dtype=torch.int64) for n in names}
    done = 0
    for step in range(6 * ps + 12):
        batch = np.sort(rng.choice(3, int(rng.integers(1, 4)), replace=False))
        lens = verbs.parts.requests.lens[batch].copy()
        if (lens >= verbs.parts.requests.max_context).any():
            break
        ids = verbs.alloc_decode(batch, lens)
        got = fused.decode_step(batch, lens, block_tables=buffers, write_ids=locs)
        if ids is None:  # the chain is full: both refuse, then the longest restarts
            assert got is None and snapshot(fused) == snapshot(verbs)
            longest = int(batch[np.argmax(lens)])
            for alloc in (verbs, fused):
                alloc.free_request(longest)
                assert alloc.new_request() == longest
                assert alloc.alloc_extend(np.array([longest]), [0], [1]) is not None
            continue
        verbs.free_out_of_window(batch, lens + 1)
        assert got is not None
        done += 1
        assert torch.equal(got.virtual_ids.data, ids.data)
        slots_dev = torch.tensor(batch, dtype=torch.int32)
        lens_dev = torch.tensor(lens + 1, dtype=torch.int32)
        assert torch.equal(got.seq_lens, lens_dev) and torch.equal(got.req_slots, slots_dev)
        for name in verbs.parts.roles.token_names:
            table = torch.empty((len(batch), cols), dtype=torch.int32)
            verbs.block_table(slots_dev, lens_dev, name, table, window=windows[name])
            assert torch.equal(got.block_tables[name].data, table), (step, name)
            assert got.block_tables[name].data.data_ptr() == buffers[name].data_ptr()
            assert torch.equal(got.write_ids[name].data, verbs.translate(ids, name).data.long())
        assert snapshot(fused) == snapshot(verbs), f"state differs after step {step}"
    fused.check_integrity()
    assert done >= 6 * ps  # most steps allocated


def test_bad_buffers_are_refused_and_state_unchanged():
    _, alloc = build("full+swa", 4, requests=3)
    slots = np.array([alloc.new_request() for _ in range(2)])
    alloc.alloc_extend(slots, np.zeros(2, np.int64), np.array([9, 4]))
    lens = alloc.parts.requests.lens[slots].copy()
    cols = alloc.parts.requests.max_pages
    good = {n: torch.zeros((2, cols), dtype=torch.int32) for n in alloc.parts.roles.token_names}
    cases = [
        ({**good, "nope": good["full"]}, None, "name token sub-pools"),
        ({"full": good["full"]}, {"swa": torch.zeros(2, dtype=torch.int32)}, "the same sub-pools"),
        ({**good, "swa": torch.zeros((2, 2), dtype=torch.int32)}, None, "int32"),
        ({**good, "swa": torch.zeros((2, cols), dtype=torch.int64)}, None, "int32"),
        ({**good, "swa": torch.zeros((1, cols), dtype=torch.int32)}, None, "int32"),
        ({**good, "swa": torch.zeros((2, cols + 1), dtype=torch.int32)}, None, "one shape"),
        (good, {"full": torch.zeros(2), "swa": torch.zeros(2)}, "int32/int64"),
        (good, {"full": torch.zeros(1, dtype=torch.int32), "swa": torch.zeros(2)}, ">= 2"),
    ]
    before = snapshot(alloc)
    for tables, locs, match in cases:
        with pytest.raises(ValueError, match=match):
            alloc.decode_step(slots, lens, block_tables=tables, write_ids=locs)
        assert snapshot(alloc) == before
    for bad_lens, match in [(lens + 1, "must equal the tokens"), (lens[:1], "shape")]:
        with pytest.raises(ValueError, match=match):
            alloc.decode_step(slots, bad_lens)
        assert snapshot(alloc) == before
    with pytest.raises(ValueError, match="distinct"):
        alloc.decode_step(np.array([slots[0], slots[0]]), np.array([lens[0], lens[0]]))
    assert snapshot(alloc) == before


def test_full_pool_returns_none_with_state_unchanged():
    _, alloc = build("full+swa", 1, requests=4, context=40)
    slots = np.array([alloc.new_request() for _ in range(2)])
    held = 0  # fill the chain (page size 1: every token takes a page of each sub-pool)
    while alloc.alloc_extend(slots[:1], np.array([held]), np.array([1])) is not None:
        held += 1
    assert not alloc.can_admit({"full": 1, "swa": 1})[1]
    before = snapshot(alloc)
    assert alloc.decode_step(slots[:1], np.array([held])) is None
    assert snapshot(alloc) == before


def test_reused_buffers_follow_their_names_and_are_checked_again_when_short():
    _, alloc = build("full+swa", 4, requests=3)
    slots = np.array([alloc.new_request() for _ in range(3)])
    alloc.alloc_extend(slots, np.zeros(3, np.int64), np.array([5, 2, 7]))
    cols = alloc.parts.requests.max_pages
    a, b = (torch.full((3, cols), -1, dtype=torch.int32) for _ in range(2))
    la, lb = (torch.full((3,), -1, dtype=torch.int32) for _ in range(2))
    for tables, locs in [({"full": a, "swa": b}, {"full": la, "swa": lb}),
                         ({"swa": a, "full": b}, {"swa": la, "full": lb})]:  # fmt: skip
        lens = alloc.parts.requests.lens[slots].copy()
        step = alloc.decode_step(slots, lens, block_tables=tables, write_ids=locs)
        for name in ("full", "swa"):  # written into the buffer passed under that name now
            assert step.block_tables[name].data.data_ptr() == tables[name].data_ptr()
            assert step.write_ids[name].data.data_ptr() == locs[name].data_ptr()
            want = torch.empty((3, cols), dtype=torch.int32)
            window = alloc.parts.roles.windows.get(name, 0)
            alloc.block_table(step.req_slots, step.seq_lens, name, want, window=window)
            assert torch.equal(tables[name], want)
            assert torch.equal(locs[name], alloc.translate(step.virtual_ids, name).data)
    short = {"full": la[:2], "swa": lb[:2]}  # the same storage, too few rows: checked again
    before = snapshot(alloc)
    with pytest.raises(ValueError, match=">= 3 entries"):
        alloc.decode_step(
            slots, alloc.parts.requests.lens[slots], block_tables=tables, write_ids=short
        )
    assert snapshot(alloc) == before


def test_a_step_may_build_some_sub_pools_tables_only():
    """Buffers given for one token sub-pool (a lazy draft's left out): that sub-pool's
    table and write ids equal ``block_table`` / ``translate``'s, the other's buffers
    are untouched, and the allocation is the full step's (the next full step's
    tables are right again); alternating the two sets reuses each one's buffers."""
    _, alloc = build("full+swa", 4, requests=3)
    slots = np.array([alloc.new_request() for _ in range(3)])
    alloc.alloc_extend(slots, np.zeros(3, np.int64), np.array([5, 2, 7]))
    cols = alloc.parts.requests.max_pages
    tables = {n: torch.full((3, cols), -1, dtype=torch.int32) for n in ("full", "swa")}
    locs = {n: torch.full((3,), -1, dtype=torch.int32) for n in ("full", "swa")}
    for step_no in range(6):
        names = ("full",) if step_no % 2 == 0 else ("full", "swa")
        untouched = {n: (tables[n].clone(), locs[n].clone()) for n in ("full", "swa")}
        lens = alloc.parts.requests.lens[slots].copy()
        step = alloc.decode_step(slots, lens, block_tables={n: tables[n] for n in names},
                                 write_ids={n: locs[n] for n in names})  # fmt: skip
        assert sorted(step.block_tables) == sorted(names)
        for name in ("full", "swa"):
            if name not in names:
                assert torch.equal(tables[name], untouched[name][0])
                assert torch.equal(locs[name], untouched[name][1])
                continue
            want = torch.empty((3, cols), dtype=torch.int32)
            window = alloc.parts.roles.windows.get(name, 0)
            alloc.block_table(step.req_slots, step.seq_lens, name, want, window=window)
            assert torch.equal(tables[name], want)
            assert torch.equal(locs[name], alloc.translate(step.virtual_ids, name).data)
    assert len(alloc.parts.steps._checked) == 2  # one checked set per set of names
    alloc.check_integrity()


def test_debug_mode_raises_on_a_live_tombstoned_page():
    """In debug mode decode_step checks its block tables: a page released by I/O
    while still inside the window reads a tombstone and raises."""
    from unikv.allocator import TombstoneReadError
    from unikv.ids import VirtualPageIds

    _, alloc = build("full+swa", 4, requests=2, debug=True)
    slot = alloc.new_request()
    alloc.alloc_extend(np.array([slot]), [0], [9])  # pages 0, 1 full and page 2 partly
    step = alloc.decode_step([slot], [9])  # debug checks pass on healthy tables
    assert step is not None
    page = int(alloc.parts.requests.pages[slot, 1])  # inside the window of every sub-pool
    alloc.io.release_physical("full", VirtualPageIds(torch.tensor([page])))
    with pytest.raises(TombstoneReadError, match="full"):
        alloc.decode_step([slot], [10])
