"""Prefix-cache hit rate against pool occupancy: a CPU scheduler-level simulation.

NO MODEL RUNS. The engine's own ``Scheduler`` (``prefix_caching=True``: match at
admission, insert of prompt chunks and finished requests, chunked prefill,
admission by the capacity oracle, preemption by recompute, out-of-window frees)
drives the real ``PoolAllocator`` and its ``PrefixCache`` over a real CPU
``UnifiedPool`` of one byte budget, exactly as ``LLM(enable_prefix_caching=True)``
builds them. Tokens are simulated: every prompt and every "sampled" token is a
seeded random id, fed to ``Scheduler.complete`` as if a model had produced it.

Models (page 16; sub-pools from ``unikv/presets/*.json`` via
``model_specs_from_hf_config``, as ``bench_capacity.py``): gpt-oss-20b (full +
sliding window 128) and Llama-3.2-1B (full only).

Workloads (seeded):
- ``system``: one round of requests sharing a 2048-token system prompt, each with
  a random 64-256-token user suffix and 64-256 new tokens;
- ``chat``: N conversations, turns interleaved round-robin (round t sends turn t
  of every conversation, after round t-1 finished); turn t's prompt is turn t-1's
  prompt + its output + a new 64-256-token message; 64-256 new tokens per turn.

Per workload, ``need`` is the peak of (live + cached) bytes with nothing evicted
(a calibration run on a roomy pool). The sweep sets the pool to ``need / x`` for
demand occupancy x = need / pool (x <= 1: everything fits; x = 4: the pool is a
quarter of the working set). Reported per point: hit rate (hit tokens / looked-up
tokens over every admission, recompute re-admissions included, as the scheduler
admits them; the allocator's raw counters are saved too, but they also count
admissions the scheduler opened and gave up), prefill tokens saved (those hit
tokens), pages evicted, preemptions, mean measured occupancy ((live + cached)
bytes / pool bytes, per step), and the first-admission hit rate over requests
whose reusable prefix is longer than the window (128; 0 for Llama), plus that hit
as a share of the ideal (whole pages of the reusable prefix).

Usage: ``python benchmarks/bench_prefix_sim.py [--quick]`` ->
``benchmarks/results/prefix_sim_cpu.json`` and ``docs/prefix_hit_rate.png``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from unikv.allocator import PoolAllocator
from unikv.engine.request import Request
from unikv.engine.sampling import SamplingParams
from unikv.engine.scheduler import Scheduler
from unikv.hf_config import model_specs_from_hf_config
from unikv.pool import UnifiedPool

PAGE = 16
CHUNK = 2048  # max_num_batched_tokens
MAX_NUM_SEQS = 8
VOCAB = 1 << 20  # simulated token ids: random, so no prefix is shared by chance
MODELS = {"gpt-oss-20b": "gpt-oss-20b.json", "llama-3.2-1b": "llama-3.2-1b.json"}
DEMAND = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0)  # need / pool
MAX_POOL_BYTES = 3 << 30  # CPU memory: larger pools are skipped (they evict nothing anyway)


@dataclass(frozen=True)
class Turn:
    """One request: prompt and planned output (host ints), ``reusable``: its first
    tokens already written by an earlier request of the workload."""

    prompt: list[int]
    output: list[int]
    reusable: int


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1, VOCAB, n).tolist()


def system_workload(num: int, seed: int, system_len: int = 2048) -> list[list[Turn]]:
    """One round of ``num`` requests: a shared system prompt + a 64-256-token suffix."""
    rng = np.random.default_rng(seed)
    system = _ids(rng, system_len)
    turns = []
    for _ in range(num):
        suffix = _ids(rng, int(rng.integers(64, 257)))
        turns.append(Turn(system + suffix, _ids(rng, int(rng.integers(64, 257))), system_len))
    return [turns]


def chat_workload(convs: int, rounds: int, seed: int) -> list[list[Turn]]:
    """``rounds`` rounds of one turn per conversation (64-256-token messages and outputs)."""
    rng = np.random.default_rng(seed)
    history = [[] for _ in range(convs)]  # prompt + output of the last turn
    out = []
    for _ in range(rounds):
        turns = []
        for c in range(convs):
            prompt = history[c] + _ids(rng, int(rng.integers(64, 257)))
            turn = Turn(prompt, _ids(rng, int(rng.integers(64, 257))), len(history[c]))
            history[c] = prompt + turn.output
            turns.append(turn)
        out.append(turns)
    return out


def _live_bytes(alloc: PoolAllocator) -> dict[str, int]:
    """Bytes of the bound pages (request-held and cached) per sub-pool name."""
    return {n: b.num_live * b.page_bytes for n, b in alloc.parts.books.items()}


def _engine(specs, budget: int, max_len: int) -> tuple[UnifiedPool, PoolAllocator, Scheduler]:
    """The pool, allocator and scheduler as ``LLM(enable_prefix_caching=True)`` builds them."""
    pool = UnifiedPool(list(specs.subpools), budget, max_request_tokens=max_len, chunk_tokens=CHUNK)
    alloc = PoolAllocator(pool, max_requests=MAX_NUM_SEQS, max_context=max_len)
    sched = Scheduler(
        alloc,
        pool.subpools.values(),
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=CHUNK,
        prefix_caching=True,
    )
    return pool, alloc, sched


@dataclass
class _Trace:
    """Per-run tallies: admissions (count, hit tokens, looked-up tokens), the
    (live + cached) share of the pool per step, the per-sub-pool bytes at the peak."""

    admit: list[int] = field(default_factory=lambda: [0, 0, 0])
    occupancy: list[float] = field(default_factory=list)
    peak: dict[str, int] = field(default_factory=dict)


def _step(pool: UnifiedPool, alloc: PoolAllocator, sched: Scheduler, plans, trace: _Trace) -> None:
    """One scheduler step; each request "samples" the next token of its plan."""
    before = {r.request_id for r in sched.running}
    batch = sched.schedule()
    for r in sched.running:  # admitted now: num_cached is its hit until complete()
        if r.request_id not in before:
            trace.admit[0] += 1
            trace.admit[1] += r.num_cached
            trace.admit[2] += r.seq_len - 1
    plan = [plans[r.request_id] for r in batch.requests]
    sched.complete(
        batch, [p[min(len(r.output_ids), len(p) - 1)] for r, p in zip(batch.requests, plan)]
    )
    live = _live_bytes(alloc)
    trace.occupancy.append(sum(live.values()) / pool.total_bytes)
    if sum(live.values()) > sum(trace.peak.values()):
        trace.peak = live


def simulate(specs, budget: int, rounds: list[list[Turn]], window: int | None) -> dict:
    """Run every round (after the previous one finished) through one Scheduler with
    prefix caching on a ``budget``-byte pool; the figures of the module docstring."""
    turns = [t for r in rounds for t in r]
    max_len = max(len(t.prompt) + len(t.output) for t in turns) + 1
    pool, alloc, sched = _engine(specs, budget, max_len)
    plans = [t.output for t in turns]  # by request id
    requests, trace, start = [], _Trace(), time.perf_counter()
    for round_ in rounds:
        for turn in round_:
            params = SamplingParams(max_tokens=len(turn.output), ignore_eos=True, temperature=0.0)
            requests.append(
                Request(len(requests), list(turn.prompt), params, 0, frozenset(), max_len)
            )
            sched.add(requests[-1])
        while sched.has_work():
            _step(pool, alloc, sched, plans, trace)
    for r, t in zip(requests, turns):
        assert r.output_ids == t.output, "simulation: a request's outputs differ from its plan"
    counters, admit = alloc.parts.prefix.counters(), trace.admit
    return {
        "budget_bytes": budget,
        "hit_rate": admit[1] / max(admit[2], 1),
        "prefill_tokens_saved": admit[1],
        "admissions": admit[0],
        "prefill_tokens_total": sum(len(t.prompt) for t in turns),
        "evicted_pages": counters["evicted_pages"],
        "cached_pages": counters["cached_pages"],
        "preemptions": sched.num_preemptions,
        "mean_occupancy": float(np.mean(trace.occupancy)),
        "peak_live_bytes": sum(trace.peak.values()),
        "peak_live_bytes_by_subpool": trace.peak,
        "steps": len(trace.occupancy),
        "sim_seconds": time.perf_counter() - start,
        "counters": counters,  # raw: also counts admissions opened and given up
        "counter_hit_rate": counters["hit_tokens"] / max(counters["query_tokens"], 1),
        **_first_admission(requests, turns, window or 0),
    }


def _first_admission(requests: list[Request], turns: list[Turn], window: int) -> dict:
    """First-admission hits (``num_cached_tokens``) over requests whose reusable
    prefix exceeds ``window`` tokens: share of looked-up tokens and of the ideal."""
    long = [(r, t) for r, t in zip(requests, turns) if t.reusable > window]
    hit = sum(r.num_cached_tokens for r, _ in long)
    query = sum(len(t.prompt) - 1 for _, t in long)
    ideal = sum(min(t.reusable, len(t.prompt) - 1) // PAGE * PAGE for _, t in long)
    return {
        "long_prefix_window": window,
        "long_prefix_requests": len(long),
        "long_prefix_hit_rate": hit / max(query, 1),
        "long_prefix_hit_of_ideal": hit / max(ideal, 1),
    }


HEADER = (
    f"{'model':12s} {'load':6s} {'need/pool':>9s} {'pool MiB':>8s} {'hit':>6s} "
    f"{'long hit':>8s} {'of ideal':>8s} {'saved':>7s} {'evicted':>7s} {'preempt':>7s} "
    f"{'mean occ':>8s} {'sim s':>5s}"
)


def _row(name: str, workload: str, res: dict) -> str:
    return (
        f"{name:12s} {workload:6s} {res['demand_occupancy']:9.2f} "
        f"{res['budget_bytes'] / 2**20:8.1f} {res['hit_rate']:6.1%} "
        f"{res['long_prefix_hit_rate']:8.1%} {res['long_prefix_hit_of_ideal']:8.1%} "
        f"{res['prefill_tokens_saved']:7d} {res['evicted_pages']:7d} {res['preemptions']:7d} "
        f"{res['mean_occupancy']:8.1%} {res['sim_seconds']:5.1f}"
    )


def sweep(name: str, specs, workload: str, rounds, demands) -> dict:
    """Calibrate ``need`` on a roomy pool, then one run per demand occupancy."""
    window = next((c.spec.sliding_window for c in specs.subpools if c.spec.sliding_window), None)
    tokens = sum(len(t.prompt) + len(t.output) for r in rounds for t in r)
    roomy = int(tokens * sum(c.spec.entry_bytes for c in specs.subpools) * 1.25) + (64 << 20)
    calib = simulate(specs, roomy, rounds, window)
    assert calib["evicted_pages"] == 0 and calib["preemptions"] == 0, "calibration pool too small"
    need = calib["peak_live_bytes"]
    points, skipped = [], []
    for x in demands:
        budget = int(need / x)
        if budget > MAX_POOL_BYTES:
            skipped.append(
                {"demand_occupancy": x, "why": f"pool {budget} > {MAX_POOL_BYTES} bytes"}
            )
            continue
        try:
            res = {"demand_occupancy": x, **simulate(specs, budget, rounds, window)}
        except ValueError as err:  # the pool cannot hold one worst-case request alone
            skipped.append({"demand_occupancy": x, "why": str(err)})
            print(f"{name:12s} {workload:6s} {x:9.2f} skipped: {str(err)[:60]}...")
            continue
        finally:
            gc.collect()
        points.append(res)
        print(_row(name, workload, res))
    return {
        "model": name,
        "workload": workload,
        "window": window,
        "need_bytes": need,
        "subpools": {
            c.name: {
                "kind": c.spec.kind,
                "layers": c.spec.num_layers,
                "entry_bytes": c.spec.entry_bytes,
                "window": c.spec.sliding_window,
            }
            for c in specs.subpools
        },
        "no_eviction": calib,
        "points": points,
        "skipped": skipped,
    }


def plot(results: dict, path: Path) -> None:
    """Hit rate against demand occupancy (need / pool), one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in results["runs"]}, reverse=True)
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for run in (r for r in results["runs"] if r["workload"] == workload):
            x = [100 * p["demand_occupancy"] for p in run["points"]]
            label = f"{run['model']} ({'SWA ' + str(run['window']) if run['window'] else 'full'})"
            line = ax.plot(x, [100 * p["hit_rate"] for p in run["points"]], "o-", label=label)[0]
            if run["window"]:
                long = [100 * p["long_prefix_hit_rate"] for p in run["points"]]
                ax.plot(x, long, "s--", color=line.get_color(), alpha=0.7,
                        label=f"{run['model']}: prefix > window only")  # fmt: skip
        ax.axvline(25, color="grey", ls=":", lw=1)
        ax.text(27, 92, "vLLM #48435: SWA hits\ncollapse at ~25 %", fontsize=7, color="grey")
        ax.axvline(100, color="black", ls=":", lw=0.8)
        ax.text(105, 92, "working set\n= pool", fontsize=7)
        ax.set_xscale("log")
        ticks = [25, 50, 100, 200, 400, 1000]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("demand occupancy: working set / pool bytes (%)")
        ax.set_ylabel("prefix hit rate (hit / looked-up tokens, %)")
        ax.set_ylim(0, 100)
        ax.set_title(f"{workload} workload (simulated tokens, page {PAGE})")
        ax.legend(fontsize=7, loc="center left")
        ax.grid(alpha=0.3)
    fig.suptitle("unikv prefix cache, scheduler-level CPU simulation (no model runs)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads, fewer points")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/prefix_sim_cpu.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs/prefix_hit_rate.png"))
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    num, convs, rounds = (16, 6, 3) if args.quick else (48, 12, 4)
    demands = (0.25, 1.0, 2.0, 4.0) if args.quick else DEMAND
    workloads = {
        "system": system_workload(num, args.seed),
        "chat": chat_workload(convs, rounds, args.seed + 1),
    }
    results = {
        "kind": "scheduler-level CPU simulation (no model runs): the engine's Scheduler with "
        "prefix_caching=True drives the real PoolAllocator and PrefixCache over a real CPU "
        "UnifiedPool; prompt and output token ids are seeded random ids (simulated)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "page_size": PAGE,
        "chunk_tokens": CHUNK,
        "max_num_seqs": MAX_NUM_SEQS,
        "seed": args.seed,
        "quick": args.quick,
        "workloads": {
            "system": {
                "requests": num,
                "system_tokens": 2048,
                "suffix": [64, 256],
                "new_tokens": [64, 256],
            },
            "chat": {
                "conversations": convs,
                "rounds": rounds,
                "message": [64, 256],
                "new_tokens": [64, 256],
                "order": "round-robin, round t after t-1",
            },
        },
        "x_axis": "demand occupancy = need / pool bytes; need = peak (live + cached) bytes "
        "of the same workload on a pool where nothing is evicted",
        "runs": [],
    }
    start = time.perf_counter()
    print(HEADER)
    for name, preset in MODELS.items():
        specs = model_specs_from_hf_config(ROOT / "unikv/presets" / preset, page_size=PAGE)
        for workload, rounds_ in workloads.items():
            results["runs"].append(sweep(name, specs, workload, rounds_, demands))
    results["total_seconds"] = time.perf_counter() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"saved {args.out} ({results['total_seconds']:.0f} s)")
    if not args.no_plot:
        plot(results, Path(args.plot))
        print(f"saved {args.plot}")
    return results


if __name__ == "__main__":
    main()
