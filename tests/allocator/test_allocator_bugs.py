"""Regression tests of the five allocator bugs of issue 16, each against an
independent derivation:

1. compaction asserted under pressure when forward done-events fired in another
   order than recorded (or between the drain and the wait): reserve must wait for
   the right fence, keep can_admit's promise and never assert (fake events on
   CPU, and the issue's engine setup with GPU-like lagging events);
2. truncate accepted cuts into sliding-window pages already freed (oracle: the
   SWA pages the next query needs, read from the host tables);
3. decode_step accepted one tensor as two sub-pools' outputs (oracle: a twin
   allocator with separate buffers);
4. band growth handed out new pages before older holes (oracle: the live pages
   of a sub-pool that freed nothing are one run at the far end);
5. an empty UP (or DOWN) band still cost bytes in can_admit (oracle: a
   brute-force enumeration of byte placements).
"""

from __future__ import annotations

import itertools
from typing import ClassVar

import numpy as np
import pytest
import torch
from allocator_fixtures import FakeEvent, build, snapshot
from engine_fixtures import assert_pages_returned, one_thread  # noqa: F401  (a fixture)

from unikv.allocator import PoolAllocator
from unikv.allocator.pages import LIVE
from unikv.ids import VirtualPageIds
from unikv.pool import Grow, SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MambaSpec, MHASpec, StatePart

F32 = torch.float32


# -- 1. compaction under pressure ---------------------------------------------------


class ClockEvent:
    """A GPU-like done-event: every query is a tick of one shared clock and an
    event fires ``lag`` ticks after it was recorded, so events fire in record
    order but possibly between two queries of the allocator."""

    clock: ClassVar[list[int]] = [0]

    def __init__(self, lag: int) -> None:
        self.at = self.clock[0] + lag

    def query(self) -> bool:
        self.clock[0] += 1
        return self.clock[0] > self.at

    def synchronize(self) -> None:
        self.clock[0] = max(self.clock[0], self.at)


def _fill(alloc, slot) -> int:
    held = 0
    while alloc.can_admit({n: 1 for n in alloc.parts.roles.token_names})[0]:
        alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([1]))
        held += 1
    return held


def test_an_older_forward_fence_that_fires_last_is_waited_for():
    """Pages freed under forward 1; forward 2's event fires first. The packing
    that counts forward-held pages as free is feasible, so reserve must wait for
    forward 1 (not assert) and succeed, as can_admit promised."""
    _, alloc = build("full+swa", 1, requests=4, context=24)
    a = alloc.new_request()
    first = FakeEvent()
    alloc.mark_in_flight(first)
    _fill(alloc, a)
    alloc.free_request(a)
    second = FakeEvent()
    alloc.mark_in_flight(second)
    second.fired = True  # out of order: the newer forward is done, the older is not
    b = alloc.new_request()
    assert alloc.can_admit({"full": 3, "swa": 3}) == (False, True)
    ids = alloc.alloc_extend(np.array([b]), np.array([0]), np.array([3]))
    assert ids is not None and first.fired, "reserve waited for the fence holding the pages"
    alloc.check_integrity()


def test_a_fence_that_fires_between_the_drain_and_the_wait_is_drained():
    """The GPU race: the forward completes after reserve drained the fence queue
    but before compaction looked at it."""
    for lag in range(1, 13):  # the event fires after 1, 2, ... allocator queries
        _, alloc = build("full+swa", 1, requests=4, context=24)
        a = alloc.new_request()
        ClockEvent.clock[0] = 0
        alloc.mark_in_flight(ClockEvent(lag))
        _fill(alloc, a)
        alloc.free_request(a)
        b = alloc.new_request()
        ids = alloc.alloc_extend(np.array([b]), np.array([0]), np.array([3]))
        assert ids is not None, lag
        alloc.check_integrity()


def _churn_out_of_order(chain: str, ps: int, seed: int, steps: int = 300) -> None:
    rng = np.random.default_rng(seed)
    _, alloc = build(chain, ps, requests=4, context=10 * ps)
    open_, events = [], []
    for _ in range(steps):
        op = rng.integers(0, 5)
        if op == 0 and len(open_) < 4:
            open_.append(alloc.new_request())
        elif op == 1 and open_:
            slot = int(rng.choice(open_))
            held = int(alloc.parts.requests.lens[slot])
            ext = int(min(rng.integers(1, 3 * ps + 1), alloc.parts.requests.max_context - held))
            demand = alloc.parts.tokens.demand_for(np.array([slot]), np.array([ext]))
            _, after = alloc.can_admit(demand)
            got = alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([ext]))
            assert (got is not None) == after, (seed, demand, after)
        elif op == 2 and open_:
            alloc.free_request(open_.pop(int(rng.integers(len(open_)))))
        elif op == 3:
            events.append(FakeEvent())
            alloc.mark_in_flight(events[-1])
        elif op == 4 and events:  # any outstanding event may fire first
            events.pop(int(rng.integers(len(events)))).fired = True
    alloc.check_integrity()


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("chain", ["full+swa", "full+swa+mamba"])
def test_out_of_order_fences_keep_can_admit_promises(chain, ps):
    """Random churn under pressure with forward events fired in random order: an
    allocation that can_admit said compaction meets succeeds, one it refused
    returns None, and nothing asserts."""
    for seed in range(6):
        _churn_out_of_order(chain, ps, seed)


@pytest.mark.usefixtures("one_thread")
def test_the_issue_setup_runs_with_lagging_forward_events(tmp_path):
    """Issue 16's setup through the engine on CPU (GQA 6/3, head_dim 40, 3 layers,
    page 16, max_model_len 160, chunk 32, a pool for one worst-case request, 10
    prompts of 1-100 tokens, 40 new tokens each), with every forward's done-event
    firing a few allocator queries late, as a GPU's does. Before the fix it
    asserted in planner._compact_for; the tokens must equal transformers'."""
    from engine_fixtures import hf_greedy, save_tiny_model

    from unikv.engine import LLM, SamplingParams

    ref = save_tiny_model(
        "llama",
        str(tmp_path),
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=40,
        num_hidden_layers=3,
    )
    spec = MHASpec(3, 3, 40, dtype=F32)
    total = pool_bytes_for([SubPoolConfig("full", spec, 16)], {"full": 160 // 16})
    llm = LLM(
        str(tmp_path),
        device="cpu",
        page_size=16,
        max_model_len=160,
        max_num_batched_tokens=32,
        max_num_seqs=10,
        kv_cache_bytes=total,
    )
    mark = llm.alloc.mark_in_flight
    llm.alloc.mark_in_flight = lambda event=None: mark(ClockEvent(lag=3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 101, 10)]
    out = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0))
    assert llm.stats.preemptions > 0, "the setup is meant to run under pressure"
    for prompt, result in zip(prompts, out):
        assert list(result.outputs[0].token_ids) == hf_greedy(ref, prompt, 40)
    assert_pages_returned(llm)


# -- 2. truncate into freed window pages -----------------------------------------------


def _windowed(ps: int, window: int, tokens: int) -> PoolAllocator:
    configs = [
        SubPoolConfig("full", MHASpec(1, 1, 2, dtype=F32), ps),
        SubPoolConfig("swa", MHASpec(1, 1, 3, dtype=F32, sliding_window=window), ps),
    ]
    pages = -(-tokens // ps) + 2
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages, "swa": pages}))
    return PoolAllocator(pool, max_requests=2, max_context=tokens + 2 * ps)


def _needed_pages_bound(alloc, slot: int, keep: int) -> bool:
    """Whether, after a cut to ``keep`` tokens, the next token (position ``keep``)
    can be written and its query sees its whole window: every position
    max(0, keep + 1 - W) .. keep that lies on a page the request keeps has its SWA
    page bound (read from the host tables)."""
    window, ps = alloc.parts.roles.windows["swa"], alloc.parts.roles.page_size
    positions = np.arange(max(0, keep + 1 - window), keep + 1)
    positions = positions[positions < -(-keep // ps) * ps]  # on pages still held
    vpages = alloc.parts.requests.pages[slot, positions // ps]
    return bool((alloc.parts.books["swa"].v2p_host[vpages] >= 0).all())


def test_truncate_into_freed_window_pages_is_refused():
    """The issue's example: page 4, window 5, 20 tokens, free_out_of_window(20)."""
    alloc = _windowed(4, 5, 20)
    slot = alloc.new_request()
    alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([20]))
    alloc.free_out_of_window(np.array([slot]), np.array([20]))
    before = snapshot(alloc)
    for keep in (9, 12):
        with pytest.raises(ValueError, match="window"):
            alloc.truncate(np.array([slot]), np.array([keep]))
        assert snapshot(alloc) == before
    alloc.truncate(np.array([slot]), np.array([16]))
    alloc.check_integrity()


@pytest.mark.parametrize("ps", [1, 2, 4, 16])
def test_truncate_accepts_exactly_the_cuts_whose_window_is_bound(ps):
    rng = np.random.default_rng(ps)
    for _ in range(12):
        window = int(rng.integers(1, 3 * ps + 4))
        tokens = int(rng.integers(1, 6 * ps + 8))
        seen = int(rng.integers(0, tokens + 1))  # the length the frees were made for
        for keep in range(tokens + 1):
            alloc = _windowed(ps, window, tokens)
            slot = alloc.new_request()
            alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([tokens]))
            alloc.free_out_of_window(np.array([slot]), np.array([seen]))
            expect = _needed_pages_bound(alloc, slot, keep)
            if expect:
                alloc.truncate(np.array([slot]), np.array([keep]))
                alloc.check_integrity()
            else:
                before = snapshot(alloc)
                with pytest.raises(ValueError, match="window"):
                    alloc.truncate(np.array([slot]), np.array([keep]))
                assert snapshot(alloc) == before


# -- 3. aliased decode_step outputs ------------------------------------------------------


def _busy_step_alloc():
    _, alloc = build("full+swa", 4, requests=3)
    slots = np.array([alloc.new_request() for _ in range(2)])
    alloc.alloc_extend(slots, np.zeros(2, np.int64), np.array([9, 4]))
    return alloc, slots


def test_aliased_decode_step_outputs_are_refused_and_state_unchanged():
    alloc, slots = _busy_step_alloc()
    lens = alloc.parts.requests.lens[slots].copy()
    cols = alloc.parts.requests.max_pages
    table, wide = (
        torch.zeros((2, cols), dtype=torch.int32),
        torch.zeros((2, cols + 1), dtype=torch.int32),
    )
    loc, loc2 = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    both = torch.zeros(4, dtype=torch.int32)
    cases = [
        ({"full": table, "swa": table}, {"full": loc, "swa": loc2}),  # one table twice
        ({"full": table, "swa": table.clone()}, {"full": loc, "swa": loc}),  # one write-id twice
        ({"full": wide[:, :cols], "swa": wide[:, 1:]}, {"full": loc, "swa": loc2}),  # overlap
        ({"full": table, "swa": table.clone()}, {"full": both[:2], "swa": both[1:3]}),
        ({"full": table, "swa": table.clone()}, {"full": table[0, :2], "swa": loc2}),
        ({n: torch.zeros(1, cols, dtype=torch.int32).expand(2, cols) for n in ("full", "swa")},
         {"full": loc, "swa": loc2}),  # rows of one table alias each other
        ({"full": table, "swa": table.clone()}, {"full": loc, "swa": alloc.parts.books["swa"].v2p[:2]}),
    ]  # fmt: skip
    before = snapshot(alloc)
    for tables, locs in cases:
        with pytest.raises(ValueError, match="overlap"):
            alloc.decode_step(slots, lens, block_tables=tables, write_ids=locs)
        assert snapshot(alloc) == before


def test_disjoint_views_of_one_tensor_equal_separate_buffers():
    """Two sub-pools' tables as the column halves of one tensor (and write ids as
    halves of one vector) are legal, and give what separate buffers give."""
    alloc, slots = _busy_step_alloc()
    twin, _ = _busy_step_alloc()
    cols = alloc.parts.requests.max_pages
    wide = torch.full((2, 2 * cols), -7, dtype=torch.int32)
    ids = torch.full((4,), -7, dtype=torch.int64)
    tables = {"full": wide[:, :cols], "swa": wide[:, cols:]}
    locs = {"full": ids[:2], "swa": ids[2:]}
    lens = alloc.parts.requests.lens[slots].copy()
    got = alloc.decode_step(slots, lens, block_tables=tables, write_ids=locs)
    want = twin.decode_step(slots, lens)
    for name in ("full", "swa"):
        table, ref = got.block_tables[name].data, want.block_tables[name].data
        assert torch.equal(table[:, : ref.shape[1]], ref) and not table[:, ref.shape[1] :].any()
        assert torch.equal(got.write_ids[name].data.int(), want.write_ids[name].data)


# -- 4. band growth order --------------------------------------------------------------------


def _grow_pool(chain_grows: dict[str, Grow], pages: int):
    configs = [
        SubPoolConfig("full", MHASpec(1, 1, 2, dtype=F32), 1, grow=chain_grows["full"]),
        SubPoolConfig(
            "swa", MHASpec(1, 1, 3, dtype=F32, sliding_window=10**6), 1, grow=chain_grows["swa"]
        ),
    ]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages, "swa": pages}))
    return PoolAllocator(pool, max_requests=4, max_context=2 * pages)


def _live_run(sub) -> tuple[int, int]:
    live = np.flatnonzero(sub.state == LIVE)
    return (int(live.min()), int(live.max()) + 1) if len(live) else (0, 0)


@pytest.mark.parametrize(
    "grows",
    [{"full": Grow.DOWN, "swa": Grow.UP}, {"full": Grow.UP, "swa": Grow.DOWN}],
    ids=["full-down", "full-up"],
)
def test_a_subpool_that_freed_nothing_has_no_holes_after_growth(grows):
    """Allocate past several frontier moves without freeing: each sub-pool's live
    pages are one run at its far end (UP: from its first page; DOWN: up to its
    last), so the farthest pages went first and no hole lies between."""
    alloc = _grow_pool(grows, 120)
    slot = alloc.new_request()
    held, moves = 0, 0
    bands = {n: s.band for n, s in alloc.parts.books.items()}
    for ext in [3, 30, 1, 40, 7, 25]:
        assert alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([ext])) is not None
        held += ext
        moves += sum(s.band != bands[n] for n, s in alloc.parts.books.items())
        bands = {n: s.band for n, s in alloc.parts.books.items()}
        for sub in alloc.parts.books.values():
            lo, hi = _live_run(sub)
            assert hi - lo == sub.num_live == held, f"{sub.name}: holes between live pages"
            far = sub.first_page if sub.grow == Grow.UP else sub.num_pages - held
            assert lo == far, f"{sub.name}: live pages do not start at the far end"
    assert moves >= 4, "the scenario is meant to move frontiers several times"


def test_holes_go_before_fresh_pages_and_compaction_moves_only_the_side_that_freed():
    """SGLang's pin: after SWA-only frees, compaction moves no full-attention page."""
    alloc = _grow_pool({"full": Grow.DOWN, "swa": Grow.UP}, 120)
    slots = [alloc.new_request() for _ in range(3)]
    for s in slots:
        alloc.alloc_extend(np.array([s]), np.array([0]), np.array([20]))
    full = alloc.parts.books["full"]
    swa = alloc.parts.books["swa"]
    freed = swa.v2p_host[alloc.parts.requests.pages[slots[1], :20]].copy()
    alloc.io.release_physical(
        "swa", VirtualPageIds(torch.from_numpy(alloc.parts.requests.pages[slots[1], :20]))
    )
    assert (swa.state[freed] != LIVE).all()
    # the next allocation reuses exactly the freed holes, not fresh pages
    new = alloc.new_request()
    alloc.alloc_extend(np.array([new]), np.array([0]), np.array([20]))
    assert set(swa.v2p_host[alloc.parts.requests.pages[new, :20]].tolist()) == set(freed.tolist())
    alloc.free_request(new)
    v2p_full = full.v2p_host.copy()
    alloc.compact()
    assert np.array_equal(full.v2p_host, v2p_full), "the side that freed nothing moved"
    lo, hi = _live_run(swa)
    assert hi - lo == swa.num_live and lo == swa.first_page
    alloc.check_integrity()


# -- 5. empty bands cost nothing -----------------------------------------------------------------


def _brute_force(pool: UnifiedPool, demand: dict[str, int]) -> bool:
    """Some placement of every non-empty band as a run of pages on its own grid,
    above the sink, below total_bytes, in byte order UP, FLOAT, DOWN without
    overlap (an empty band takes no bytes)."""
    runs = []
    for grow in (Grow.UP, Grow.FLOAT, Grow.DOWN):
        sub = pool.by_grow(grow)
        pages = demand.get(sub.name, 0) if sub else 0
        if pages == 0:
            continue
        pb = sub.page_bytes
        starts = [
            lo
            for lo in range(pool.total_bytes // pb + 1)
            if lo * pb >= pool.sink_bytes and (lo + pages) * pb <= pool.total_bytes
        ]
        runs.append([(lo * pb, (lo + pages) * pb) for lo in starts])
    return any(
        all(a[1] <= b[0] for a, b in itertools.pairwise(placement))
        for placement in itertools.product(*runs)
    )


def _up_mamba_pool(total: int) -> UnifiedPool:
    """Full attention (64-byte pages, DOWN) and Mamba (28-byte slots, UP): the
    slot does not divide the 64-byte sink, and total_bytes need not be a
    multiple of the full page, so both empty-band roundings show."""
    configs = [
        SubPoolConfig("full", MHASpec(1, 1, 2, dtype=F32), 4),
        SubPoolConfig("mamba", MambaSpec(1, (StatePart((3,)),), StatePart((4,)))),
    ]
    return UnifiedPool(configs, total)


@pytest.mark.parametrize("total", [660, 704, 641, 900])
def test_can_admit_and_fits_agree_with_brute_force_on_an_empty_pool(total):
    pool = _up_mamba_pool(total)
    alloc = PoolAllocator(pool, max_requests=40, max_context=64)
    assert pool["mamba"].grow == Grow.UP and pool.sink_bytes % pool["mamba"].page_bytes
    most = {"full": 0, "mamba": 0}
    for full in range(pool["full"].num_pages + 2):
        for mamba in range(pool["mamba"].num_pages + 2):
            demand = {"full": full, "mamba": mamba}
            want = _brute_force(pool, demand)
            assert pool.fits(demand) == want, demand
            assert alloc.can_admit(demand)[1] == want, demand
            if want and not mamba:
                most["full"] = max(most["full"], full)
            if want and not full:
                most["mamba"] = max(most["mamba"], mamba)
    assert most["full"] == pool["full"].usable_pages  # the empty Mamba band costs nothing
    assert most["mamba"] == pool["mamba"].usable_pages  # nor does the empty full band


def test_a_pool_that_passes_start_up_admits_its_worst_case_request():
    """The start-up check (UnifiedPool.fits) and the allocator agree at the
    boundary: the smallest pool that accepts a 40-token request can run it."""
    full, mamba = MHASpec(1, 1, 2, dtype=F32), MambaSpec(1, (StatePart((3,)),), StatePart((4,)))
    configs = [SubPoolConfig("full", full, 4), SubPoolConfig("mamba", mamba)]
    total = next(t for t in range(64, 4096) if _passes(configs, t))
    pool = UnifiedPool(configs, total, max_request_tokens=40)
    alloc = PoolAllocator(pool, max_requests=2, max_context=40)
    slot = alloc.new_request()
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([40])) is not None
    alloc.free_request(slot)
    slot = alloc.new_request()
    assert alloc.alloc_mamba(np.array([slot])) is not None
    assert alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([40])) is not None
    alloc.check_integrity()


def _passes(configs, total: int) -> bool:
    try:
        UnifiedPool(configs, total, max_request_tokens=40)
    except ValueError:
        return False
    return True
