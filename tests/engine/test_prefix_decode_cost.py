"""Decode steps cost the same with prefix caching on as off (issue 41).

With the GPU's one-step-ahead pipeline (step N+1 is planned while step N runs), a
compaction during planning must not wait for the forward on the host, and a decode
step must not make more table writes (each an upload and a launch) than the rows
that changed need. On CPU there are no done-events, so the engine runs here with
GPU-like ones (``LagEvent``: a step's event fires once the next step has been
planned and launched, as the loop settles it; ``synchronize`` is a host wait,
``wait`` the device-side ordering ``torch.cuda.Event.wait`` gives):

- tiny Qwen3.5 (Gated DeltaNet), fp32, a pool tight enough to evict pages and state
  checkpoints while requests decode: greedy tokens equal transformers' ``generate``
  and the run without the cache, twice with the cache (the second run hits);
- no decode step waits for a forward on the host (today's code synchronised in
  compaction), and each decode step makes at most one table write for itself, one
  per request it finished (its token and state frees together), one per sub-pool
  whose pages compaction moved (the bound the run without the cache keeps), and one
  more with the cache: the step's checkpoint copies, with the checkpoints and pages
  it dropped or evicted. Counted from the finished requests and page moves of each
  step, not from the writer's own bookkeeping.

Allocator level: a reserve under pressure with a forward in flight orders after it
(``order_forward``) and never synchronises, and the pages compaction moved keep
their bytes (a naive per-page record is the oracle); on CUDA (``-m gpu``) the
allocation returns while a long kernel standing for the forward still runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import CHAINS, build
from allocator_fixtures import PAGES as FIXTURE_PAGES
from engine_fixtures import (
    VOCAB,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_hybrid,
)
from prefix_fixtures import pool_budget, prefix_llm

from unikv.allocator import PoolAllocator
from unikv.engine import SamplingParams
from unikv.hf_config import specs_from_hf_config
from unikv.pool import UnifiedPool, pool_bytes_for

pytestmark = pytest.mark.usefixtures("one_thread")

PS, MAX_LEN, NEW_TOKENS = 4, 48, 14
PAGES, SLOTS = 30, 20  # tight: checkpoints are evicted while requests decode


class LagEvent:
    """A GPU-like forward done-event: fires when the loop settles its step."""

    def __init__(self, log: dict) -> None:
        self.fired, self.log = False, log

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:  # a host wait
        self.log["syncs"] += not self.fired
        self.fired = True

    def wait(self) -> None:  # the current stream waits on the device: no host wait
        self.log["orders"] += 1


class StepCounts:
    """Per engine step: table writes, host waits, finished requests, checkpoint
    flushes that wrote, sub-pools whose pages compaction moved."""

    def __init__(self, llm) -> None:
        parts = llm.alloc.parts
        self.log = {"syncs": 0, "orders": 0}
        self.events: list[LagEvent] = []
        self.steps: list[dict] = []
        self.now = {"writes": 0, "flushes": 0, "moves": 0}
        writer, states = parts.writer, parts.prefix.states
        write, move, flush, mark = writer.write, writer.move, states.flush, llm.alloc.mark_in_flight

        def counted_write(*args, **kwargs):
            self.now["writes"] += 1
            return write(*args, **kwargs)

        def counted_move(*args, **kwargs):
            self.now["moves"] += 1
            return move(*args, **kwargs)

        def counted_flush() -> None:
            self.now["flushes"] += bool(states.queued)
            flush()

        def lagging(event=None) -> None:
            self.events.append(LagEvent(self.log))
            mark(self.events[-1])

        writer.write, writer.move, states.flush = counted_write, counted_move, counted_flush
        llm.alloc.mark_in_flight = lagging

    def on_step(self, llm, batch, logits) -> None:
        finished = sum(r.finish_reason is not None for r in batch.requests)
        self.steps.append({**self.now, "decode": batch.is_decode, "finished": finished})
        self.now = dict.fromkeys(self.now, 0)
        for event in self.events[:-1]:  # the loop settled the step before this one
            event.fired = True

    def settle_all(self) -> None:
        for event in self.events:
            event.fired = True


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, VOCAB, (17,), generator=g).tolist()
    out = [system + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 5, 14)]
    return out + [torch.randint(0, VOCAB, (19,), generator=g).tolist() for _ in "ab"]


def _run(path: str, caching: bool, prompts, params, runs: int) -> tuple:
    """(the LLM, its StepCounts, each run's outputs)."""
    configs = specs_from_hf_config(path, page_size=PS, dtype=torch.float32)
    kw = {
        "kv_cache_bytes": pool_budget(configs, PAGES, state_slots=SLOTS),
        "max_model_len": MAX_LEN, "max_num_batched_tokens": 128, "debug": False,
    }  # fmt: skip
    llm = prefix_llm(path, PS, caching, **kw)
    counts = StepCounts(llm)
    outs = []
    for _ in range(runs):
        counts.settle_all()
        outs.append([o.output_ids for o in llm.generate(prompts, params, on_step=counts.on_step)])
    return llm, counts, outs


def _over(counts: StepCounts, extra: int) -> list[dict]:
    """Decode steps with more table writes than one for the step, one per request
    it finished, one per sub-pool compaction moved pages of, and ``extra``."""
    return [
        s for s in counts.steps
        if s["decode"] and s["writes"] > 1 + s["finished"] + s["moves"] + extra
    ]  # fmt: skip


def test_cached_decode_steps_never_wait_and_write_only_what_changed(tmp_path):
    path = str(tmp_path / "qwen3_5")
    hf = save_tiny_hybrid("qwen3_5", path)
    prompts = _prompts(seed=4)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    _, plain, outs = _run(path, False, prompts, params, runs=1)
    assert outs == [want]
    assert plain.log["syncs"] == 0 and not _over(plain, 0), "without the cache (the baseline)"
    llm, counts, outs = _run(path, True, prompts, params, runs=2)
    assert outs == [want, want]
    states = llm.alloc.parts.prefix.states
    stats = llm.alloc.prefix.counters()
    assert stats["hit_tokens"] > 0
    assert stats["evicted_pages"] + states.evicted > 0, "the pool is tight enough to evict"
    decode = [s for s in counts.steps if s["decode"]]
    assert sum(s["flushes"] for s in decode) > 0, "decode steps took checkpoints"
    assert counts.log["syncs"] == 0, f"{counts.log['syncs']} host waits for a forward"
    # at most one write more than without the cache: the step's checkpoint copies,
    # with the checkpoints and pages it dropped or evicted
    assert not _over(counts, 1), _over(counts, 1)
    llm.alloc.check_integrity()


# -- allocator level -------------------------------------------------------------------


class OrderEvent:
    """A forward done-event that can order a stream (``wait``) or be waited for."""

    def __init__(self) -> None:
        self.fired, self.syncs, self.orders = False, 0, 0

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.syncs += 1
        self.fired = True

    def wait(self) -> None:
        self.orders += 1


def _fill(alloc, slot: int) -> int:
    held = 0
    while alloc.can_admit({n: 1 for n in alloc.parts.roles.token_names})[0]:
        alloc.alloc_extend(np.array([slot]), np.array([held]), np.array([1]))
        held += 1
    return held


def _under_pressure(pool, alloc, event, launch=lambda: None) -> dict:
    """Fill the pool, free a request while ``event``'s forward runs (``launch``
    enqueues it), then allocate what only its pages can hold: the allocation must
    succeed. Returns a naive record {(sub-pool, virtual page): mark} of the bytes
    of a request that stays (each of its pages filled with its own mark first)."""
    a, keep = alloc.new_request(), alloc.new_request()
    _fill(alloc, keep)
    alloc.free_request(keep)  # holes below the next request's pages
    keep = alloc.new_request()
    alloc.alloc_extend(np.array([keep]), np.array([0]), np.array([3]))
    _fill(alloc, a)
    marks = {}
    for name in alloc.parts.roles.token_names:
        vpages = alloc.parts.requests.pages[keep, :3]
        for v, p in zip(vpages.tolist(), alloc.parts.books[name].physical(vpages).tolist()):
            pool.page_envelope(name, p).fill_(v % 251)
            marks[name, v] = v % 251
    launch()
    alloc.mark_in_flight(event)
    alloc.free_request(a)  # held by the forward fence
    b = alloc.new_request()
    ids = alloc.alloc_extend(np.array([b]), np.array([0]), np.array([4]))
    assert ids is not None, "the pages the forward held serve the allocation"
    return marks


def _check_marks(pool, alloc, marks: dict) -> None:
    for (name, v), mark in marks.items():
        p = int(alloc.parts.books[name].physical(np.array([v], np.int32))[0])
        assert bool((pool.page_envelope(name, p) == mark).all()), (name, v)


@pytest.mark.parametrize("chain", ["full+swa", "full+swa+mamba"])
def test_reserve_under_pressure_orders_after_the_forward_and_keeps_bytes(chain):
    """The reserve orders after the forward (no host wait) and compacts; every page
    that stays bound keeps its bytes wherever it moved."""
    pool, alloc = build(chain, 1, requests=4, context=24)
    event = OrderEvent()
    marks = _under_pressure(pool, alloc, event)
    assert event.syncs == 0 and event.orders >= 1, (event.syncs, event.orders)
    _check_marks(pool, alloc, marks)
    alloc.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reserve_under_pressure_does_not_wait_for_a_running_forward_gpu():
    """CUDA: a long kernel stands for the forward; the allocation that needs the
    pages it fences returns while that kernel still runs (the host did not wait),
    and once it is done every kept page holds its bytes and the tables mirror the
    host."""
    configs = CHAINS["full+swa"](1)
    total = pool_bytes_for(configs, {c.name: FIXTURE_PAGES[c.name] for c in configs})
    pool = UnifiedPool(configs, total, "cuda")
    alloc = PoolAllocator(pool, max_requests=4, max_context=24)
    event = torch.cuda.Event()
    # ~10 s of spinning: longer than compiling the copy kernels on first use
    launch = lambda: (torch.cuda._sleep(20_000_000_000), event.record())
    marks = _under_pressure(pool, alloc, event, launch)
    assert not event.query(), "the allocation returned before the forward finished"
    torch.cuda.synchronize()
    _check_marks(pool, alloc, marks)
    alloc.check_integrity()
