"""The unified pool: placement, sink, start-up checks, fits() and move_pages,
each against an independent derivation (brute-force sweeps, Python bytes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from unikv import layout
from unikv.ids import PhysicalPageIds, VirtualPageIds
from unikv.kernels import get_backend
from unikv.pool import Grow, SubPoolConfig, UnifiedPool, default_grow
from unikv.specs import MambaSpec, MHASpec, MLASpec, StatePart

U8 = torch.uint8
FULL = MHASpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
SWA = MHASpec(num_layers=3, num_kv_heads=1, head_dim=4, dtype=torch.bfloat16, sliding_window=8)
MAMBA = MambaSpec(2, (StatePart((3, 4), torch.bfloat16),), StatePart((2, 3), torch.float32))


def pages_between(lo: int, hi: int, page_bytes: int) -> int:
    """Whole pages of a grid (page p = [p*pb, (p+1)*pb)) inside [lo, hi), by counting."""
    return sum(
        1
        for p in range(hi // page_bytes + 1)
        if p * page_bytes >= lo and (p + 1) * page_bytes <= hi
    )


def max_kernel_id(sub) -> int:
    """Largest kernel id of any valid (page, slot), from layout.kernel_ids in int64."""
    last = torch.tensor([sub.num_pages * sub.page_size - 1], dtype=torch.int64)
    return int(layout.kernel_ids(last, sub.page_size, sub.spec.blocks_per_page or 1)[0])


# -- placement and the sink ----------------------------------------------------------


def test_default_placement_follows_design() -> None:
    def grows(*specs):
        return [
            g.value for g in default_grow([SubPoolConfig(f"s{i}", s) for i, s in enumerate(specs)])
        ]

    assert grows(FULL, SWA) == ["down", "up"]
    assert grows(FULL, MAMBA) == ["down", "up"]
    assert grows(FULL, SWA, MAMBA) == ["down", "float", "up"]
    assert grows(MLASpec(2, 8, 4)) == ["down"]
    assert grows(SWA) == ["up"]
    configs = [SubPoolConfig("f", FULL, grow="up"), SubPoolConfig("s", SWA, grow=Grow.DOWN)]
    assert [g.value for g in default_grow(configs)] == ["up", "down"]


@pytest.mark.parametrize("page_sizes", [(1, 1), (4, 16), (16, 4)])
def test_page_zero_of_every_subpool_lies_in_the_sink(page_sizes) -> None:
    configs = [
        SubPoolConfig("full", FULL, page_sizes[0]),
        SubPoolConfig("swa", SWA, page_sizes[1]),
        SubPoolConfig("mamba", MAMBA),
    ]
    pool = UnifiedPool(configs, 20_000)
    for sub in pool.subpools.values():
        start = pool.page_envelope(sub.name, 0).data_ptr() - pool.buffer.data_ptr()
        assert start + sub.page_bytes <= pool.sink_bytes, f"{sub.name} page 0 leaves the sink"
        for page in range(sub.num_pages):  # first_page: the lowest page wholly above the floor
            assert (page >= sub.first_page) == (page * sub.page_bytes >= pool.sink_bytes)
        assert sub.usable_pages == pages_between(pool.sink_bytes, pool.total_bytes, sub.page_bytes)
        rows = (
            sub.views["temporal"].shape[1] if sub.spec.kind == "mamba" else sub.views[0][0].shape[0]
        )
        assert max_kernel_id(sub) < sub.kernel_id_limit == rows  # every dense row is addressable


def test_buffer_is_zeroed_views_share_it_and_poison_is_nan() -> None:
    configs = [SubPoolConfig("full", FULL, 4), SubPoolConfig("swa", SWA, 4)]
    pool = UnifiedPool(configs, 5_000)
    assert pool.buffer.dtype == U8 and int(pool.buffer.count_nonzero()) == 0
    k = pool["swa"].views[2][0]  # layer 2 K, dense
    k[27] = 1.5
    paged_k = pool["swa"].paged_views[2][0]
    assert float(paged_k[1, 3, 0, 0]) == 1.5  # kernel id 27 = page 1 slot 3 (ps 4, B 6)
    assert int(pool.page_envelope("swa", 1).count_nonzero()) > 0
    poisoned = UnifiedPool(configs + [SubPoolConfig("mamba", MAMBA)], 5_000, poison=True)
    assert torch.isnan(poisoned["full"].views[0][1].float()).all()
    assert torch.isnan(poisoned["mamba"].views["temporal"]).all()
    assert torch.isnan(poisoned["mamba"].views["conv0"].float()).all()
    fp8 = MHASpec(1, 1, 4, dtype=torch.float8_e4m3fn)
    poisoned = UnifiedPool([SubPoolConfig("full", fp8)], 100, poison=True)
    assert torch.isnan(poisoned["full"].views[0][0].view(torch.float8_e4m3fn).float()).all()


# -- start-up checks -------------------------------------------------------------------


def test_kernel_ids_beyond_int32_fail_and_the_advice_works() -> None:
    tiny = MHASpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=U8)  # 2-byte pages, B = 2
    config = [SubPoolConfig("full", tiny)]
    int32_max = torch.iinfo(torch.int32).max
    at_limit = UnifiedPool(config, 2**31, device="meta")  # no memory is allocated on meta
    assert max_kernel_id(at_limit["full"]) <= int32_max
    with pytest.raises(ValueError, match=r"kernel ids reach .* > 2\*\*31") as info:
        UnifiedPool(config, 2**31 + 2, device="meta")
    assert "lower total_bytes to at most 2147483648" in str(info.value)
    mla = MLASpec(num_layers=4, kv_lora_rank=1, rope_dim=1, dtype=U8)  # B = 4, ps 16
    with pytest.raises(ValueError, match="kernel ids") as info:
        UnifiedPool([SubPoolConfig("mla", mla, 16)], 2**33, device="meta")
    advice = int(str(info.value).split("at most ")[1].split()[0])
    pool = UnifiedPool([SubPoolConfig("mla", mla, 16)], advice, device="meta")
    assert max_kernel_id(pool["mla"]) <= int32_max


def test_a_pool_fitting_no_real_page_fails_and_the_advice_works() -> None:
    config = [SubPoolConfig("full", FULL, 4)]
    page = FULL.page_bytes(4)
    with pytest.raises(ValueError, match="'full' fits no real page") as info:
        UnifiedPool(config, 2 * page - 1, device="meta")
    advice = int(str(info.value).split("at least ")[1].split()[0])
    assert advice == 2 * page  # one sink page plus one real page, counted by hand
    assert UnifiedPool(config, advice, device="meta")["full"].usable_pages == 1
    # a second sub-pool with bigger pages raises the sink above the first one's only page
    with pytest.raises(ValueError, match="fits no real page"):
        UnifiedPool(config + [SubPoolConfig("mamba", MAMBA)], MAMBA.entry_bytes + 1, device="meta")


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_one_worst_case_request_must_fit_alone(page_size) -> None:
    config = [SubPoolConfig("full", FULL, page_size)]
    tokens, pb = 100, FULL.page_bytes(page_size)
    need = -(-tokens // page_size)
    enough = next(b for b in range(pb, 10**7, pb) if pages_between(pb, b, pb) >= need)
    UnifiedPool(config, enough, device="meta", max_request_tokens=tokens)
    with pytest.raises(
        ValueError, match="worst-case request of 100 tokens cannot run alone"
    ) as info:
        UnifiedPool(config, enough - 1, device="meta", max_request_tokens=tokens)
    assert "raise total_bytes" in str(info.value)


def test_worst_case_with_a_window_and_mamba_and_the_advice_works() -> None:
    configs = [
        SubPoolConfig("full", FULL, 4),
        SubPoolConfig("swa", SWA, 4),
        SubPoolConfig("mamba", MAMBA),
    ]
    with pytest.raises(ValueError, match="cannot run alone") as info:
        UnifiedPool(configs, 3_000, device="meta", max_request_tokens=64)
    advice = int(str(info.value).split("to about ")[1].split()[0])
    pool = UnifiedPool(configs, advice, device="meta", max_request_tokens=64)
    # the window keeps few pages: the full band alone dominates the demand
    assert pool.fits({"full": 16, "swa": 4, "mamba": 1})


def test_bad_pool_arguments_say_what_to_change() -> None:
    c = SubPoolConfig("full", FULL)
    cases = [
        (lambda: UnifiedPool([], 100), "1 to 3 sub-pools, got 0"),
        (lambda: UnifiedPool([c] * 4, 100), "1 to 3 sub-pools, got 4"),
        (lambda: UnifiedPool([c, SubPoolConfig("full", SWA)], 100), "names must be unique"),
        (
            lambda: UnifiedPool([c, SubPoolConfig("x", FULL)], 10**4),
            "at most one sub-pool may grow 'down'",
        ),
        (lambda: UnifiedPool([c], 0), "total_bytes must be a positive int, got 0"),
        (lambda: UnifiedPool([c], 10.5), "total_bytes must be a positive int, got 10.5"),
        (
            lambda: UnifiedPool([c], 10**4, max_request_tokens=0),
            "max_request_tokens must be a positive",
        ),
        (lambda: SubPoolConfig("", FULL), "SubPoolConfig.name"),
        (lambda: SubPoolConfig("a", "full"), "SubPoolConfig.spec"),
        (lambda: SubPoolConfig("a", FULL, grow="sideways"), "SubPoolConfig.grow must be one of"),
        (lambda: SubPoolConfig("a", FULL, layers=(1, 2, 3)), "layers names 3 model layers"),
        (lambda: SubPoolConfig("a", MAMBA, page_size=4), "page_size 1, got 4"),
        (lambda: SubPoolConfig("a", FULL, page_size=0), "page_size must be a positive int"),
    ]
    for build, message in cases:
        with pytest.raises(ValueError, match=message):
            build()
    with pytest.raises(KeyError, match="no sub-pool 'swa'"):
        UnifiedPool([c], 10**4)["swa"]


# -- fits() against a brute-force boundary sweep --------------------------------------


def sweep_fits(pool: UnifiedPool, demand: dict) -> bool:
    """Is there a split sink <= x <= y <= total with the up band's pages in
    [sink, x), the float band's in [x, y) and the down band's in [y, total)?"""
    up, flt, down = (pool.by_grow(g) for g in (Grow.UP, Grow.FLOAT, Grow.DOWN))

    def ok(sub, lo, hi):
        if sub is None or not demand.get(sub.name, 0):
            return True
        have = max(0, hi // sub.page_bytes - -(-lo // sub.page_bytes))
        return have >= demand[sub.name]

    lo, hi = pool.sink_bytes, pool.total_bytes
    xs = [x for x in range(lo, hi + 1) if ok(up, lo, x)]
    ys = [y for y in range(lo, hi + 1) if ok(down, y, hi)]
    return any(ok(flt, x, y) for x in xs for y in ys if x <= y)


@settings(max_examples=300, deadline=None)
@given(
    full_dims=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    swa_dims=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    mamba_size=st.integers(1, 40),
    page_sizes=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])),
    kinds=st.sampled_from(
        [("full", "swa"), ("full", "mamba"), ("full", "swa", "mamba"), ("full",)]
    ),
    total=st.integers(40, 400),
    demand=st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(0, 5)),
)
def test_fits_matches_a_boundary_sweep(
    full_dims, swa_dims, mamba_size, page_sizes, kinds, total, demand
):
    specs = {
        "full": (MHASpec(full_dims[0], 1, full_dims[1], dtype=U8), page_sizes[0]),
        "swa": (MHASpec(swa_dims[0], 1, swa_dims[1], dtype=U8, sliding_window=4), page_sizes[1]),
        "mamba": (MambaSpec(1, (StatePart((mamba_size,), U8),), StatePart((2,), U8)), 1),
    }
    configs = [SubPoolConfig(k, *specs[k]) for k in kinds]
    try:
        pool = UnifiedPool(configs, total)
    except ValueError as error:
        assume("fits no real page" not in str(error))
        raise
    want = dict(zip(("full", "swa", "mamba"), demand))
    want = {k: v for k, v in want.items() if k in kinds}
    expected = sweep_fits(pool, want)
    event(f"fits={expected}")
    assert pool.fits(want) == expected


# -- move_pages ----------------------------------------------------------------------


def seeded_pool(seed: int = 0) -> UnifiedPool:
    configs = [
        SubPoolConfig("full", FULL, 4),
        SubPoolConfig("swa", SWA, 2),
        SubPoolConfig("mamba", MAMBA),
    ]
    pool = UnifiedPool(configs, 12_000)
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=U8, generator=gen))
    return pool


def expected_after_moves(before: bytes, page_bytes: int, src: list, dst: list) -> bytes:
    out = bytearray(before)
    for s, d in zip(src, dst):  # every source read from the state before any write
        out[d * page_bytes : (d + 1) * page_bytes] = before[s * page_bytes : (s + 1) * page_bytes]
    return bytes(out)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(["full", "swa", "mamba"]))
def test_move_pages_moves_exactly_the_named_envelopes(data, name) -> None:
    pool = seeded_pool(data.draw(st.integers(0, 1000)))
    sub = pool[name]
    pages = list(range(sub.first_page, sub.num_pages))
    dst = data.draw(st.lists(st.sampled_from(pages), unique=True, max_size=6))
    src = data.draw(st.lists(st.sampled_from(pages), min_size=len(dst), max_size=len(dst)))
    before = bytes(pool.buffer.numpy())

    def ids(pages: list) -> PhysicalPageIds:
        return PhysicalPageIds(torch.tensor(pages, dtype=torch.int64), name)

    pool.move_pages(name, ids(src), ids(dst))
    assert bytes(pool.buffer.numpy()) == expected_after_moves(before, sub.page_bytes, src, dst)


def test_move_pages_swaps_and_cycles_read_sources_first() -> None:
    pool = seeded_pool(1)
    sub = pool["full"]
    p = sub.first_page
    src, dst = [p, p + 1, p + 2, p + 3], [p + 1, p + 2, p, p + 4]  # a 3-cycle plus a copy
    before = bytes(pool.buffer.numpy())
    old_row = sub.paged_views[1][1][p + 2, 3].clone()  # layer 1 V, page p+2, last slot
    pool.move_pages(
        "full",
        PhysicalPageIds(torch.tensor(src)),
        PhysicalPageIds(torch.tensor(dst, dtype=torch.int32)),
    )
    assert bytes(pool.buffer.numpy()) == expected_after_moves(before, sub.page_bytes, src, dst)
    assert torch.equal(sub.paged_views[1][1][p, 3], old_row)  # the data followed its page


def test_move_pages_rejects_bad_ids_and_leaves_the_buffer_unchanged() -> None:
    pool = seeded_pool(2)
    sub = pool["swa"]
    ok = PhysicalPageIds(torch.tensor([sub.first_page]))
    before = pool.buffer.clone()
    type_errors = [
        (torch.tensor([sub.first_page]), ok, "takes PhysicalPageIds, got Tensor"),
        (
            VirtualPageIds(torch.tensor([sub.first_page])),
            ok,
            "takes PhysicalPageIds, got VirtualPageIds",
        ),
        (
            PhysicalPageIds(torch.tensor([sub.first_page]), "full"),
            ok,
            "ids of sub-pool 'swa', got ids of 'full'",
        ),
    ]
    for src, dst, message in type_errors:
        with pytest.raises(TypeError, match=message):
            pool.move_pages("swa", src, dst)
    f = sub.first_page
    value_errors = [
        ([0], [f], "src pages must lie in"),  # the sink is never moved
        ([f], [sub.num_pages], "dst pages must lie in"),
        ([f, f + 1], [f + 2, f + 2], "dst pages must be distinct"),
        ([f, f + 1], [f + 2], "two 1-D page lists of one length"),
    ]
    for src, dst, message in value_errors:
        with pytest.raises(ValueError, match=message):
            pool.move_pages(
                "swa", PhysicalPageIds(torch.tensor(src)), PhysicalPageIds(torch.tensor(dst))
            )
    assert torch.equal(pool.buffer, before)
    pool.move_pages(
        "swa",
        PhysicalPageIds(torch.tensor([], dtype=torch.int64)),
        PhysicalPageIds(torch.tensor([], dtype=torch.int64)),
    )
    assert torch.equal(pool.buffer, before)


def test_page_moves_run_the_backend_copy_chosen_at_construction() -> None:
    """``backend=`` supplies ``copy_pages``; the result equals the default pool's."""
    calls = []

    def spy(buffer, src, dst, page_bytes):
        calls.append((src.tolist(), dst.tolist(), page_bytes))
        get_backend("cpu").copy_pages(buffer, src, dst, page_bytes)

    config = [SubPoolConfig("full", FULL, page_size=4)]
    backend = dataclasses.replace(get_backend("cpu"), copy_pages=spy)
    pools = [UnifiedPool(config, 4096, backend=backend), UnifiedPool(config, 4096)]
    p = pools[0]["full"].first_page
    for pool in pools:
        pool.buffer.copy_(torch.arange(pool.buffer.numel()).to(U8))
        pool.move_pages(
            "full", PhysicalPageIds(torch.tensor([p])), PhysicalPageIds(torch.tensor([p + 1]))
        )
    assert calls == [([p], [p + 1], pools[0]["full"].page_bytes)]
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    with pytest.raises(ValueError, match="either backend= or copy_pages="):
        UnifiedPool(config, 4096, backend=backend, copy_pages=spy)
