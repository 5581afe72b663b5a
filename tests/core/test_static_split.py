"""The static-split option: each sub-pool confined to a fixed share of the bytes.

(a) Random churn (extends, decodes, Mamba slots, frees, window frees, fenced
    frees, compaction) under a static split: after EVERY operation each band lies
    inside the byte range computed here from the fractions and the page sizes
    (UP from the sink floor, FLOAT next, DOWN ending at the top), and the bands
    do reach their ranges' ends (the limit binds). The same churn without the
    split does cross those boundaries (the check is not vacuous).
(b) A tiny pool, numbers worked out by hand: unified admits 9 short (or 4 long)
    requests where SGLang's static split admits 7 (or 3).
(c) Through ``LLM`` on a tiny Qwen3.5: greedy tokens of both schemes equal
    transformers' ``generate``; the static run stays inside its ranges at every
    step and runs fewer requests at once than the unified one.
Plus the validation errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from allocator_fixtures import FakeEvent, full_config, swa_config
from engine_fixtures import hf_greedy, one_thread, save_tiny_hybrid  # noqa: F401

from unikv.allocator import PoolAllocator
from unikv.ids import VirtualPageIds
from unikv.pool import Grow, SubPoolConfig, UnifiedPool
from unikv.specs import MambaSpec, StatePart

SGLANG = {"mamba": 0.9 / 1.9, "full": 1 / 1.9}  # mamba bytes = 0.9 x full-attention bytes


def byte_ranges(pool: UnifiedPool, split: dict[str, float]) -> dict[str, tuple[float, float]]:
    """The fixed byte range of every sub-pool, from the fractions alone: UP from the
    sink floor, FLOAT right after it, DOWN ending at total_bytes."""
    usable = pool.total_bytes - pool.sink_bytes
    grow = {s.grow: n for n, s in pool.subpools.items()}
    out, start = {}, pool.sink_bytes
    for g in (Grow.UP, Grow.FLOAT):
        if g in grow:
            out[grow[g]] = (start, start + split[grow[g]] * usable)
            start += split[grow[g]] * usable
    down = grow[Grow.DOWN]
    out[down] = (pool.total_bytes - split[down] * usable, pool.total_bytes)
    return out


def inside(alloc: PoolAllocator, ranges) -> dict[str, bool]:
    """Whether each non-empty band's bytes lie in its range (1 byte of slack for
    the integer rounding of a fraction)."""
    ok = {}
    for name, (lo, hi) in ranges.items():
        sub = alloc.parts.books[name]
        band_lo, band_hi = sub.lo * sub.page_bytes, sub.hi * sub.page_bytes
        ok[name] = sub.lo == sub.hi or (band_lo >= lo - 1 and band_hi <= hi)
    return ok


# -- (a) churn ----------------------------------------------------------------------------


def big_mamba() -> SubPoolConfig:
    """128-byte slots (12 + 20 fp32), so a few requests fill the Mamba range."""
    return SubPoolConfig("mamba", MambaSpec(1, (StatePart((12,)),), StatePart((20,))))


CHAINS = {
    "full+mamba": (lambda ps: [full_config(ps), big_mamba()], SGLANG),
    "full+swa+mamba": (
        lambda ps: [full_config(ps), swa_config(ps), big_mamba()],
        {"full": 0.3, "swa": 0.35, "mamba": 0.3},  # sums to 0.95: a gap stays unused
    ),
}


def churn_step(alloc: PoolAllocator, rng, open_: list[int], events: list) -> bool | None:
    """One random operation; returns False when an allocation was refused."""
    op = rng.integers(0, 9)
    ps = alloc.parts.roles.page_size
    if op == 0 and len(open_) < alloc.parts.requests.max_requests:
        open_.append(alloc.new_request())
    elif op in (1, 2) and open_:
        slot = int(rng.choice(open_))
        held = int(alloc.parts.requests.lens[slot])
        ext = int(rng.integers(1, 3 * ps + 1))
        if held + ext <= alloc.parts.requests.max_context:
            return alloc.alloc_extend([slot], [held], [ext]) is not None
    elif op == 3 and open_:
        slot = int(rng.choice(open_))
        if alloc.parts.books["mamba"].v2p_host[slot + 1] < 0:
            return alloc.alloc_mamba([slot]) is not None
    elif op == 4 and open_:
        slots = np.array([s for s in open_ if 0 < alloc.parts.requests.lens[s] < 10 * ps])
        if len(slots):
            return alloc.alloc_decode(slots, alloc.parts.requests.lens[slots]) is not None
    elif op == 5 and open_:
        alloc.free_request(open_.pop(int(rng.integers(len(open_)))))
    elif op == 6 and open_ and alloc.parts.roles.windows:
        slots = np.array(open_)
        alloc.free_out_of_window(slots, alloc.parts.requests.lens[slots])
    elif op == 7 and open_:  # a fenced release of one owner page, then its event fires later
        slot = int(rng.choice(open_))
        sub = alloc.parts.books[alloc.parts.roles.owner]
        vpages = alloc.parts.requests.pages[
            slot, : int(alloc.parts.requests.num_pages(np.array([slot]))[0])
        ]
        bound = [int(v) for v in vpages if sub.v2p_host[v] >= 0]
        if bound:
            events.append(FakeEvent())
            alloc.io.release_physical(
                sub.name, VirtualPageIds(torch.tensor(bound[-1:])), fence=events[-1]
            )
    elif op == 8:
        for event in events:
            event.fired = True
        events.clear()
        alloc.compact()
    return None


def run_churn(chain: str, ps: int, seed: int, split, steps: int = 400):
    """Churn a small pool; returns (pool, per-step inside-maps, refusals, max band bytes)."""
    configs, fractions = CHAINS[chain][0](ps), CHAINS[chain][1]
    sink = max(c.spec.page_bytes(c.page_size) for c in configs)
    total = sink + int(5.5 * 128 / fractions["mamba"])  # the Mamba range holds 5 slots
    pool = UnifiedPool(configs, total, static_split=split)
    alloc = PoolAllocator(pool, max_requests=8, max_context=12 * ps if ps > 1 else 24)
    ranges = byte_ranges(pool, fractions)
    rng = np.random.default_rng(seed)
    open_, events, trace, refused = [], [], [], 0
    reach = {n: [math.inf, 0] for n in ranges}  # lowest band byte, highest band byte
    for _ in range(steps):
        refused += churn_step(alloc, rng, open_, events) is False
        alloc.check_integrity()
        trace.append(inside(alloc, ranges))
        for name, sub in alloc.parts.books.items():
            if sub.lo < sub.hi:
                reach[name][0] = min(reach[name][0], sub.lo * sub.page_bytes)
                reach[name][1] = max(reach[name][1], sub.hi * sub.page_bytes)
    return pool, ranges, trace, refused, reach


SEEDS = range(4)


@pytest.mark.parametrize(("chain", "ps"), [("full+mamba", 4), ("full+swa+mamba", 1)])
def test_churn_stays_inside_static_ranges(chain, ps):
    refused, reach = 0, {}
    for seed in SEEDS:
        pool, ranges, trace, n, got = run_churn(chain, ps, seed, CHAINS[chain][1])
        for step, ok in enumerate(trace):
            assert all(ok.values()), f"seed {seed} step {step}: a band left its range: {ok}"
        refused += n
        for name, (lo, hi) in got.items():
            old = reach.get(name, (math.inf, 0))
            reach[name] = (min(old[0], lo), max(old[1], hi))
    assert refused > 0, "the churn never hit a limit: the pool is too large for the test"
    for name, (lo, hi) in ranges.items():  # the limits bind: bands reach their range's end
        pb = pool.subpools[name].page_bytes
        if pool.subpools[name].grow == Grow.DOWN:
            assert reach[name][0] < lo + pb, f"{name}: never grew down to {lo}"
        else:  # UP, and FLOAT (placed as low as it goes)
            assert reach[name][1] > hi - pb, f"{name}: never grew up to {hi}"


@pytest.mark.parametrize(("chain", "ps"), [("full+mamba", 4), ("full+swa+mamba", 1)])
def test_unified_churn_crosses_the_static_boundaries(chain, ps):
    """Control: without the split the same churn moves bands across those ranges."""
    crossed = False
    for seed in SEEDS:
        _, _, trace, _, _ = run_churn(chain, ps, seed, None)
        crossed |= any(not all(ok.values()) for ok in trace)
    assert crossed


# -- (b) admission, worked by hand ------------------------------------------------------


def tiny_pool(split):
    """full: 1 layer x 1 head x D 2, fp32 -> 16 B/token, page 4 -> 64 B pages.
    mamba: 12 + 20 fp32 -> 128 B slots. sink = 128 B; usable = 1900 B; total 2028 B."""
    pool = UnifiedPool([full_config(4), big_mamba()], 128 + 1900, static_split=split)
    return PoolAllocator(pool, max_requests=16, max_context=64)


def admit_until_refused(alloc: PoolAllocator, prompt_len: int) -> int:
    """Admit requests (a Mamba slot + the prompt's pages) until one is refused."""
    count = 0
    while True:
        pages = -(-prompt_len // alloc.parts.roles.page_size)
        fits = alloc.can_admit({"mamba": 1, "full": pages})[1]
        slot = alloc.new_request()
        ok = alloc.alloc_mamba([slot]) is not None
        ok = ok and alloc.alloc_extend([slot], [0], [prompt_len]) is not None
        assert ok == fits, "can_admit disagrees with what the allocator then did"
        alloc.check_integrity()
        if not ok:
            return count
        count += 1


# Static (SGLang): mamba range [128, 128 + 900) holds slots 1..7 (7 slots); full
# range [1028, 2028) holds 64-B pages 17..30 (14 pages).
# Unified: k requests of p pages fit while (1 + k) * 128 <= (31 - p k) * 64.
@pytest.mark.parametrize(
    ("prompt_len", "unified", "static"),
    [
        (4, 9, 7),  # p = 1: 2 + 2k <= 31 - k -> k = 9; static: min(7 slots, 14 pages)
        (16, 4, 3),  # p = 4: 2 + 2k <= 31 - 4k -> k = 4; static: min(7, 14 // 4)
    ],
)
def test_unified_admits_more_than_static(prompt_len, unified, static):
    assert admit_until_refused(tiny_pool(None), prompt_len) == unified
    assert admit_until_refused(tiny_pool(SGLANG), prompt_len) == static


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "match"),
    [
        ({"mamba": 0.5}, "exactly the pool's sub-pools"),
        ({"mamba": 0.4, "full": 0.4, "swa": 0.1}, "exactly the pool's sub-pools"),
        ({"mamba": 0.0, "full": 0.5}, "positive fraction"),
        ({"mamba": -0.1, "full": 0.5}, "positive fraction"),
        ({"mamba": float("nan"), "full": 0.5}, "positive fraction"),
        ({"mamba": True, "full": 0.5}, "positive fraction"),
        ({"mamba": 0.6, "full": 0.5}, "sum to at most 1"),
        ({"mamba": 0.01, "full": 0.99}, "less than one 128-byte page"),
    ],
)
def test_bad_splits_are_refused(split, match):
    with pytest.raises(ValueError, match=match):
        tiny_pool(split)


def test_split_must_be_a_mapping():
    with pytest.raises(TypeError, match="mapping"):
        tiny_pool([0.5, 0.5])


def test_worst_case_request_must_fit_its_range():
    full, mamba = full_config(4), big_mamba()
    # 60 tokens = 15 pages; the static full range holds 14: refused, naming the fix
    with pytest.raises(ValueError, match="raise the fraction of 'full' to at least"):
        UnifiedPool([full, mamba], 2028, static_split=SGLANG, max_request_tokens=60)
    UnifiedPool([full, mamba], 2028, static_split=SGLANG, max_request_tokens=56)  # 14 pages
    UnifiedPool([full, mamba], 2028, max_request_tokens=60)  # unified: fits


# -- (c) through LLM on a tiny Qwen3.5 -----------------------------------------------------

NEW_TOKENS = 12
PROMPT_LENS = [3, 9, 14, 20, 27, 31]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, one_thread):  # noqa: F811
    path = str(tmp_path_factory.mktemp("qwen3_5_static"))
    hf = save_tiny_hybrid("qwen3_5", path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return path, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def _generate(path, prompts, split):
    from unikv.engine import LLM, SamplingParams

    # full: 2 layers x 2 heads x (24 + 24) fp32 = 768 B/token, 3072 B pages of 4;
    # mamba: 3 layers x (128 x 4 + 4 x 12 x 20) fp32 = 17,664 B slots. A 64-token
    # request needs 16 full pages (49,152 B): under SGLang's split the full range
    # must hold that, so ~100 KB leaves the mamba range 2 slots.
    llm = LLM(
        path,
        device="cpu",
        page_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        max_model_len=64,
        kv_cache_bytes=17_664 + 100_000,
        static_split=split,
    )
    running, ranges = [], byte_ranges(llm.pool, split) if split else None

    def on_step(llm, batch, logits):
        running.append(len(llm.scheduler.running))
        if ranges is not None:
            ok = inside(llm.alloc, ranges)
            assert all(ok.values()), f"a band left its static range: {ok}"

    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), on_step=on_step
    )
    return [o.output_ids for o in outs], max(running), llm


def test_llm_static_split_tokens_match_transformers(qwen):
    path, prompts, reference = qwen
    unified, unified_max, _ = _generate(path, prompts, None)
    static, static_max, llm = _generate(path, prompts, SGLANG)
    assert unified == reference
    assert static == reference
    slots = llm.pool.band_limits["mamba"][1] - llm.pool.band_limits["mamba"][0]
    assert static_max <= slots < unified_max, (static_max, slots, unified_max)


def test_llm_refuses_a_bad_split(qwen):
    from unikv.engine import LLM

    with pytest.raises(ValueError, match="exactly the pool's sub-pools"):
        LLM(qwen[0], device="cpu", max_model_len=64, static_split={"full": 1.0})
