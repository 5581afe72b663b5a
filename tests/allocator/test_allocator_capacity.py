"""The capacity oracle against brute force: on random allocator states, for
random demands, ``can_admit`` must agree with an enumeration of EVERY placement
of every band (UP top, FLOAT bottom and top, DOWN bottom) on the sub-pools' own
page grids. Also: the joint check (docs/lessons.md bug 11) and ``pack_bands`` equals
``UnifiedPool.fits`` when nothing is kept."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from allocator_fixtures import build, churn

from unikv.allocator import pack_bands
from unikv.allocator.bands import Mode, band_needs
from unikv.allocator.pages import LIVE, PENDING
from unikv.pool import Grow


def _candidates(sub, keep: np.ndarray, occupied: int, new: int):
    """Every band (lo, hi) of ``sub`` holding ``keep`` and ``occupied + new`` pages."""
    if sub.grow == Grow.UP:
        bands = [(sub.first_page, hi) for hi in range(sub.first_page, sub.num_pages + 1)]
    elif sub.grow == Grow.DOWN:
        bands = [(lo, sub.num_pages) for lo in range(sub.first_page, sub.num_pages + 1)]
    else:
        bands = [
            (lo, hi)
            for lo in range(sub.first_page, sub.num_pages + 1)
            for hi in range(lo, sub.num_pages + 1)
        ]
    bands = np.array(bands)
    ok = bands[:, 1] - bands[:, 0] >= occupied + new
    if len(keep):
        ok &= (bands[:, 0] <= keep.min()) & (bands[:, 1] > keep.max())
    ok &= (bands[:, 1] > bands[:, 0]) | (occupied + new == 0)
    return bands[ok] * sub.page_bytes  # byte ranges


def brute_force(alloc, demand: dict, mode: str) -> bool:
    """Whether some placement of all bands works (byte order UP | FLOAT | DOWN)."""
    ranges = {}
    for name, sub in alloc.parts.books.items():
        if mode == "now":
            keep = np.flatnonzero(sub.state >= LIVE)
            occupied = len(keep)
        else:  # compaction: pinned pages and pages a transfer holds stay put
            held = np.zeros(sub.num_pages, bool)
            held[alloc.parts.fences.held(name, transfer_only=True)] = True
            keep = np.flatnonzero((sub.pins > 0) | held)
            occupied = sub.num_live + int(((sub.state == PENDING) & ((sub.pins > 0) | held)).sum())
        ranges[sub.grow] = _candidates(sub, keep, occupied, demand.get(name, 0))
    floor, ceiling = alloc.pool.sink_bytes, alloc.pool.total_bytes
    order = [ranges.get(g, np.array([[floor, floor]])) for g in (Grow.UP, Grow.FLOAT, Grow.DOWN)]
    up, flt, down = (r.reshape(-1, 2) for r in order)
    if Grow.DOWN not in ranges:
        down = np.array([[ceiling, ceiling]])
    u = up[:, None, None, :]
    f = flt[None, :, None, :]
    d = down[None, None, :, :]
    u_empty = u[..., 0] == u[..., 1]  # an empty band takes no bytes
    f_empty = f[..., 0] == f[..., 1]
    d_empty = d[..., 0] == d[..., 1]
    ok = (u_empty | f_empty | (u[..., 1] <= f[..., 0])) & (
        u_empty | d_empty | (u[..., 1] <= d[..., 0])
    )
    ok &= f_empty | d_empty | (f[..., 1] <= d[..., 0])
    return bool(ok.any())


@pytest.mark.parametrize("chain", ["full+swa", "full+swa+mamba", "full+mamba", "mla+swa"])
@pytest.mark.parametrize("ps", [1, 16])
def test_can_admit_matches_brute_force(chain, ps):
    rng = np.random.default_rng(zlib.crc32(f"{chain}-{ps}".encode()))
    agree = {(a, b): 0 for a in (False, True) for b in (False, True)}
    for trial in range(12):
        _, alloc = build(chain, ps, requests=4)
        churn(alloc, rng, int(rng.integers(5, 40)))
        alloc.parts.room.drain()
        for _ in range(6):
            demand = {
                n: int(rng.integers(0, max(4, (s.num_pages - s.first_page) * 2 // 3)))
                for n, s in alloc.parts.books.items()
                if rng.random() < 0.7
            }
            now, after = alloc.can_admit(demand)
            if (
                alloc.parts.roles.owner
                and demand.get(alloc.parts.roles.owner, 0) > alloc.parts.vspace.num_free
            ):
                assert (now, after) == (False, False)
                continue
            assert now == brute_force(alloc, demand, "now"), (trial, demand)
            assert after == brute_force(alloc, demand, "after"), (trial, demand)
            agree[(now, after)] += 1
    assert agree[(True, True)] and agree[(False, False)], f"one-sided: {agree}"
    # demands that only compaction meets: (False, True) above, and the dedicated
    # test_shortfall_compaction_is_byte_exact in test_allocator_compaction.py


def test_joint_shortfall_is_seen():
    """4 and 4 pages fit each sub-pool alone, not both together (docs/lessons.md bug 11)."""
    pool, alloc = build("full+mamba", 1)
    full, mamba = alloc.parts.books["full"], alloc.parts.books["mamba"]
    room = pool.total_bytes - pool.sink_bytes
    alone_full = room // full.page_bytes - 1  # pages the full band could take alone
    alone_mamba = (room - full.page_bytes * (alone_full - 2)) // mamba.page_bytes
    assert alloc.can_admit({"full": alone_full})[0]
    assert alloc.can_admit({"mamba": alone_mamba})[0]
    assert alloc.can_admit({"full": alone_full, "mamba": alone_mamba}) == (False, False)


@pytest.mark.parametrize("chain", ["full+swa", "full+swa+mamba", "full+mamba"])
def test_pack_bands_equals_pool_fits_when_nothing_is_kept(chain):
    pool, alloc = build(chain, 16)
    rng = np.random.default_rng(7)
    for _ in range(200):
        demand = {n: int(rng.integers(0, 16)) for n in alloc.parts.books}
        needs = band_needs(
            alloc.parts.books, alloc.parts.room.frame, demand, Mode.NOW
        )  # keeps nothing
        assert (pack_bands(needs, pool.sink_bytes, pool.total_bytes) is not None) == pool.fits(
            demand
        )
