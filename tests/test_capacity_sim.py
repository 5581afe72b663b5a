"""The capacity simulator of ``benchmarks/bench_capacity.py`` on tiny pools.

Checks against independent derivations: live pages per sub-pool after every
step against a brute-force count from the requests' lengths (full: every page
of the prefix; SWA: the pages holding a position the window still needs;
Mamba: one slot per running request); the static split's holdings against
its region's page count; the equal-page padding against arithmetic on the
raw state shapes; and the all-or-nothing rollback of a split allocation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_capacity as bc

from unikv.pool import SubPoolConfig
from unikv.specs import MambaSpec, MHASpec, StatePart

PS, WINDOW = 4, 6
FULL = SubPoolConfig("full", MHASpec(2, 1, 8, dtype=torch.float16), page_size=PS)
SWA = SubPoolConfig(
    "swa", MHASpec(2, 1, 8, dtype=torch.float16, sliding_window=WINDOW), page_size=PS
)
MAMBA = SubPoolConfig(
    "mamba", MambaSpec(3, (StatePart((5, 4), torch.float16),), StatePart((2, 8, 4))), page_size=1
)
PAGE = FULL.spec.page_bytes(PS)  # 256 bytes


def _expected_pages(running, kinds) -> dict[str, int]:
    """Brute force: for each request, walk its pages one by one."""
    want = {name: 0 for name in kinds}
    for r in running:
        c = r.num_cached
        for j in range(-(-c // PS)):
            want["full"] += 1
            last = min(c, (j + 1) * PS) - 1  # last position held by page j
            if "swa" in want and last >= c - WINDOW:
                want["swa"] += 1
        if "mamba" in want:
            want["mamba"] += 1
    return want


@pytest.mark.parametrize("scheme", bc.SCHEMES)
@pytest.mark.parametrize("configs", [[FULL, SWA], [FULL, MAMBA]], ids=["swa", "mamba"])
def test_live_pages_match_request_lengths_every_step(scheme, configs):
    budget = 64 * PAGE if configs[1] is SWA else 40 * PAGE + 12 * MAMBA.spec.entry_bytes
    workload = bc.mixed_workload(
        14, seed=3, short=(2, 12), long=(20, 44), long_frac=0.4, out=(3, 9)
    )
    max_context = max(p + o for p, o in workload) + 1
    alloc, subpools, regions = bc.build_scheme(scheme, configs, budget, 16, max_context)
    page_bytes = {s.name: s.page_bytes for s in subpools}
    entry = {s.name: s.page_bytes // s.page_size for s in subpools}

    def check(sched):
        usage = alloc.usage()
        live = {n: usage[n][0] // page_bytes[n] for n in usage}
        if scheme == "equal_pages" and "mamba" in live:  # attention pages are not PS tokens there
            want = {"mamba": len(sched.running)}
            live = {"mamba": live["mamba"]}
        else:
            want = _expected_pages(sched.running, live)
        assert live == want, f"{scheme}: live pages {live} != derived {want}"
        total = sum(v[0] for v in usage.values())
        assert total <= budget, f"{scheme}: {total} live bytes over the {budget}-byte budget"
        for name, region in regions.items():
            assert usage[name][0] <= region, f"{name} exceeds its static region"
        assert entry  # the geometry was read

    res = bc.simulate(
        alloc, subpools, workload, max_context=max_context, chunk=16, max_num_seqs=16, on_step=check
    )
    assert res["max_concurrent"] >= 1 and res["steps"] >= max(o for _, o in workload)


def test_unified_holds_more_tokens_than_a_static_split_can():
    """Long prompts only: the static split is capped by its full region; unified is not."""
    budget = 80 * PAGE
    workload = [(40, 40)] * 12
    results = {}
    for scheme in ("unified", "static_split"):
        alloc, subpools, regions = bc.build_scheme(scheme, [FULL, SWA], budget, 16, 90)
        results[scheme] = bc.simulate(
            alloc, subpools, workload, max_context=90, chunk=64, max_num_seqs=16
        )
        if regions:
            # SGLang rule: SWA tokens = 0.8 x full tokens, equal entry bytes -> full gets 1/1.8
            assert regions["full"] == int(budget / 1.8)
            full_tokens = (regions["full"] // PAGE - 1) * PS  # less its sink page
    assert results["static_split"]["max_tokens_held"] <= full_tokens
    assert results["unified"]["max_tokens_held"] > 1.4 * full_tokens


def test_equal_pages_padding_from_raw_shapes():
    padded = {c.name: c for c in bc.equal_page_configs([FULL, MAMBA])}
    # one attention layer's K+V row per token: 2 * 1 head * 8 dims * 2 bytes = 32 bytes
    mamba_layer = 5 * 4 * 2 + 2 * 8 * 4 * 4  # conv fp16 + temporal fp32 = 296 bytes
    ps = padded["full"].page_size
    assert ps % 16 == 0 and ps * 32 >= mamba_layer and (ps - 16) * 32 < mamba_layer
    layers = padded["mamba"].spec.num_layers
    assert layers == 4  # 3 Mamba layers padded to a multiple of the 2 attention layers
    assert padded["mamba"].spec.entry_bytes == layers * ps * 32
    assert padded["mamba"].spec.entry_bytes == 2 * padded["full"].spec.page_bytes(ps)


def test_split_allocation_is_all_or_nothing():
    """Static split: when the SWA region is full, the full region is rolled back."""
    alloc, _, regions = bc.build_scheme("static_split", [FULL, SWA], 30 * PAGE, 8, 64)
    swa_pages = regions["swa"] // PAGE - 1
    hog = alloc.new_request()
    assert (
        alloc.alloc_extend(np.array([hog]), np.array([0]), np.array([swa_pages * PS])) is not None
    )
    before = {n: live for n, (live, _) in alloc.usage().items()}
    slot = alloc.new_request()
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([PS])) is None
    assert {n: live for n, (live, _) in alloc.usage().items()} == before, (
        "a failed split allocation must leave every region unchanged"
    )
    alloc.free_request(slot)
    alloc.free_request(hog)
    assert all(live == 0 for live, _ in alloc.usage().values())
