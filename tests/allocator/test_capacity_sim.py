"""The capacity simulator of ``benchmarks/bench_capacity.py`` on tiny pools.

Checks against independent derivations: live pages per sub-pool after every
step against a brute-force count from the requests' lengths (full: every page
of the prefix; SWA: the pages holding a position the window still needs;
Mamba: one slot per running request); the static split's holdings against
its region's page count; the equal-page padding against arithmetic on the
raw state shapes; the all-or-nothing rollback of a split allocation; the
padded-K/V and expanded-MLA layouts' bytes per token against hand counts from
the presets; and the meta-buffer runs against runs over real CPU buffers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import bench_capacity as bc
from benchmarks import capacity_models as cm
from unikv.hf_config import model_specs_from_hf_config
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


# -- layout schemes (benchmarks/capacity_models.py) ------------------------------------


def _preset(name: str):
    path = cm.PRESETS / f"{name}.json"
    return model_specs_from_hf_config(path, page_size=16), json.loads(path.read_text())


def test_padded_kv_costs_the_wider_row_by_hand():
    """MiMo-V2-Flash: K 192 / V 128 bf16; full layers are the 0s of the hub's
    hybrid_layer_pattern (4 KV heads), SWA layers the 1s (8 KV heads)."""
    specs, hf = _preset("mimo-v2-flash")
    full_layers = hf["hybrid_layer_pattern"].count(0)
    swa_layers = hf["hybrid_layer_pattern"].count(1)
    assert (full_layers, swa_layers) == (9, 39)
    exact = {"full": 9 * 4 * (192 + 128) * 2, "swa": 39 * 8 * (192 + 128) * 2}
    padded = {"full": 9 * 4 * (192 + 192) * 2, "swa": 39 * 8 * (192 + 192) * 2}
    assert exact == {"full": 23040, "swa": 199680}
    assert padded == {"full": 27648, "swa": 239616}
    got_exact = {c.name: c.spec.entry_bytes for c in specs.subpools}
    got_padded = {c.name: c.spec.entry_bytes for c in cm.pad_kv(list(specs.subpools), hf)}
    assert got_exact == exact and got_padded == padded
    for name, nbytes in exact.items():
        assert padded[name] * (192 + 128) == nbytes * (192 + 192)  # (D + D) / (D + Dv)
    # a second description of the same bytes: the pages a real pool builds
    _, subpools, _ = bc.build_scheme(
        "unified", cm.pad_kv(list(specs.subpools), hf), 1 << 30, 4, 64, device="meta"
    )
    assert {s.name: s.page_bytes for s in subpools} == {n: 16 * b for n, b in padded.items()}
    assert all(isinstance(s.spec, MHASpec) and not s.spec.is_asymmetric for s in subpools)


def test_expanded_kv_of_deepseek_v3_by_hand():
    """61 layers, 128 heads, K = nope 128 + rope 64, V = 128, bf16; the latent
    row is 512 + 64 wide, one per layer."""
    specs, hf = _preset("deepseek-v3")
    (mla,) = specs.subpools
    assert mla.spec.entry_bytes == 61 * (512 + 64) * 2 == 70272
    (expanded,) = cm.expand_mla(list(specs.subpools), hf)
    assert expanded.name == mla.name
    assert expanded.spec.entry_bytes == 61 * 128 * ((128 + 64) + 128) * 2 == 4_997_120
    assert cm.pad_kv([mla], hf) == [mla]  # padding leaves MLA rows alone
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        cm.expanded_kv_spec(mla.spec, {k: v for k, v in hf.items() if k != "qk_rope_head_dim"})


@pytest.mark.parametrize("configs", [[FULL, SWA], [FULL, MAMBA]], ids=["swa", "mamba"])
def test_meta_buffers_give_the_cpu_run(configs):
    """The benchmark's default meta buffers skip copies and zero fills; the run
    (every step's trace) equals the one over a real CPU buffer."""
    budget = 48 * PAGE if configs[1] is SWA else 30 * PAGE + 8 * MAMBA.spec.entry_bytes
    workload = bc.mixed_workload(
        12, seed=5, short=(2, 12), long=(20, 44), long_frac=0.4, out=(3, 9)
    )
    max_context = max(p + o for p, o in workload) + 1
    runs = {}
    for device in ("cpu", "meta"):
        alloc, subpools, _ = bc.build_scheme(
            "unified", configs, budget, 16, max_context, device=device
        )
        res = bc.simulate(
            alloc, subpools, workload, max_context=max_context, chunk=16, max_num_seqs=16
        )
        runs[device] = {k: v for k, v in res.items() if k != "sim_seconds"}
    assert runs["meta"] == runs["cpu"]
    assert runs["cpu"]["preemptions"] + runs["cpu"]["max_concurrent"] > 1


def test_a_request_that_cannot_run_alone_fails_at_build():
    with pytest.raises(ValueError, match="cannot run alone"):
        bc.build_scheme("unified", [FULL, SWA], 12 * PAGE, 4, 200, max_request_tokens=200)
    bc.build_scheme("unified", [FULL, SWA], 12 * PAGE, 4, 20, max_request_tokens=20)
