"""``SliceBacking`` (issue 44 item 4): several pools in one reserved range, their
chunks committed and released in the parent's, and the views of a pool whose
buffer starts inside a larger tensor (a non-zero storage offset) reading the
same bytes as those of a standalone buffer."""

from __future__ import annotations

import pytest
import torch
from allocator_fixtures import CHAINS, PAGES

from unikv.backing import POISON_BYTE, EmulatedBacking, SliceBacking
from unikv.pool import UnifiedPool, pool_bytes_for

CHUNK = 256


def test_slices_commit_and_release_in_the_parent():
    parent = EmulatedBacking(CHUNK)
    parent.reserve(8 * CHUNK)
    a, b = SliceBacking(parent, 0, 4 * CHUNK), SliceBacking(parent, 4 * CHUNK, 4 * CHUNK)
    ta, tb = a.reserve(3 * CHUNK), b.reserve(4 * CHUNK)
    assert ta.data_ptr() == parent.tensor.data_ptr()
    assert tb.data_ptr() == parent.tensor.data_ptr() + 4 * CHUNK
    assert b.commit(0, 2 * CHUNK) == 2 * CHUNK and a.commit(0, CHUNK) == CHUNK
    assert parent.committed == [(0, CHUNK), (4 * CHUNK, 6 * CHUNK)]
    assert parent.committed_bytes == a.committed_bytes + b.committed_bytes == 3 * CHUNK
    tb[: 2 * CHUNK] = 5
    assert b.release(CHUNK, 2 * CHUNK) == CHUNK
    assert (parent.tensor[5 * CHUNK : 6 * CHUNK] == POISON_BYTE).all()
    assert (parent.tensor[4 * CHUNK : 5 * CHUNK] == 5).all()
    assert parent.committed == [(0, CHUNK), (4 * CHUNK, 5 * CHUNK)]
    with pytest.raises(ValueError, match="capacity"):
        SliceBacking(parent, 4 * CHUNK, 4 * CHUNK).reserve(5 * CHUNK)
    with pytest.raises(ValueError, match="runs past"):
        SliceBacking(parent, 6 * CHUNK, 4 * CHUNK)
    with pytest.raises(ValueError, match="multiples"):
        SliceBacking(parent, 10, 4 * CHUNK)
    b.close()
    assert parent.committed == [(0, CHUNK)]


@pytest.mark.parametrize("chain", ["full+swa+mamba", "mla+swa"])
def test_views_of_a_pool_inside_a_larger_range(chain):
    """A pool in the second slice: every view reads the bytes at its own base
    (the slice), the same bytes a standalone pool's views read at the same
    offsets (views were once built from storage offset 0: the first slice's bytes)."""
    configs = CHAINS[chain](4)
    total = pool_bytes_for(configs, {c.name: PAGES[c.name] for c in configs})
    parent = EmulatedBacking(CHUNK)
    cap = -(-(2 * total) // CHUNK) * CHUNK
    parent.reserve(2 * cap)
    pools = [
        UnifiedPool(configs, total, max_bytes=total, backing=SliceBacking(parent, i * cap, cap))
        for i in range(2)
    ]
    alone = UnifiedPool(configs, total)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 120, (total,), generator=g, dtype=torch.uint8)  # no NaN bytes
    pools[0].buffer[:total] = 0
    pools[1].buffer[:total] = data
    alone.buffer[:total] = data
    for name, sub in pools[1].subpools.items():
        theirs = alone.subpools[name]
        for key, view in _flat(sub.views):
            ref = dict(_flat(theirs.views))[key]
            assert view.shape == ref.shape and view.stride() == ref.stride()
            assert torch.equal(view.view(torch.uint8), ref.view(torch.uint8)), (name, key)
            base = parent.tensor.data_ptr() + cap
            assert base <= view.data_ptr() < base + cap, (name, key)


def _flat(views, prefix=()):
    if isinstance(views, torch.Tensor):
        yield prefix, views
    elif isinstance(views, dict):
        for k, v in views.items():
            yield from _flat(v, (*prefix, k))
    else:
        for i, v in enumerate(views):
            yield from _flat(v, (*prefix, i))
