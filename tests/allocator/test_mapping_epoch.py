"""The allocator's mapping epoch (``alloc.view.mapping_epoch``): block tables and
write ids built at one epoch are still right at the same epoch (the step planner
reuses a verify step's tables on it: ``engine/plan_tables.py``). Over random
extends, cuts, frees, window frees, prefix-less opens and compactions that move
pages, the tables of every open request, built afresh into new tensors, and the
write ids of every row it holds are the same whenever the epoch is one seen
before; lookups leave the epoch alone. ``row_vids`` (the host mirror) equals
``token_vids`` (a gather of ``req_to_token`` on the device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import build

from unikv.ids import VirtualTokenIds


def tables(alloc) -> bytes:
    """Every request's block table (full width, its window's) and the write ids of
    every row it holds, per token sub-pool, as bytes (requests holding rows: one
    holding none has no table entries); lookups only."""
    req = alloc.parts.requests
    slots = np.flatnonzero(req.in_use & (req.lens > 0))
    lens = req.lens[slots]
    out = [slots.tobytes(), lens.tobytes()]
    if not len(slots):
        return b"".join(out)
    view, cols = alloc.view, req.max_pages
    vids = view.token_vids(slots, np.zeros_like(lens), lens)
    assert view.row_vids(slots, np.zeros_like(lens), lens).tolist() == vids.tolist()
    for name in alloc.parts.roles.token_names:
        window = alloc.parts.roles.windows.get(name, 0)
        table = torch.full((len(slots), cols), -7, dtype=torch.int32)
        slots_dev = torch.from_numpy(slots.astype(np.int32))
        lens_dev = torch.from_numpy(lens.astype(np.int32))
        alloc.block_table(slots_dev, lens_dev, name, table, window=window)
        out.append(table.numpy().tobytes())
        if not window:  # (a windowed sub-pool's rows behind the window are freed)
            out.append(alloc.translate(VirtualTokenIds(vids), name).data.numpy().tobytes())
    return b"".join(out)


def act(alloc, rng) -> tuple[str, int]:
    """One random verb (its name, pages it moved)."""
    req, ps = alloc.parts.requests, alloc.parts.roles.page_size
    open_ = np.flatnonzero(req.in_use)
    op = int(rng.integers(0, 6))
    if op == 0 and len(open_) < req.max_requests:
        alloc.new_request()
        return "open", 0
    if op in (1, 2) and len(open_):
        slot = int(rng.choice(open_))
        held = int(req.lens[slot])
        ext = int(rng.integers(1, 2 * ps + 2))
        if held + ext <= req.max_context:
            alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([ext]))
        return "extend", 0
    if op == 3 and len(open_):
        slot = int(rng.choice(open_))
        held = int(req.lens[slot])
        keep = int(rng.integers(0, held + 1)) // ps * ps
        if alloc.parts.roles.windows:
            keep = held  # (a cut into freed window pages is refused; cut nothing)
        alloc.truncate(np.array([slot]), np.array([keep]))
        return "truncate", 0
    if op == 4 and len(open_):
        alloc.free_request(int(rng.choice(open_)))
        return "free", 0
    return "compact", alloc.compact()


@pytest.mark.parametrize("chain", ["full+mamba", "full+swa", "mla+swa"])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_same_epoch_same_tables(chain, ps):
    rng = np.random.default_rng(ps * 31 + len(chain))
    _, alloc = build(chain, ps, requests=5)
    seen: dict[int, bytes] = {}
    moved = repeats = 0
    for _ in range(200):
        epoch = alloc.view.mapping_epoch
        state = tables(alloc)
        assert alloc.view.mapping_epoch == epoch, "lookups leave the epoch alone"
        if epoch in seen:
            repeats += 1
            assert seen[epoch] == state, "the tables changed at the same mapping epoch"
        seen[epoch] = state
        _, pages = act(alloc, rng)
        moved += pages
        if pages:
            assert alloc.view.mapping_epoch != epoch, "compaction moved pages: a new epoch"
    assert moved > 0 and repeats > 0 and len(seen) > 10, (moved, repeats, len(seen))
