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
benchmarks/results/prefix_sim_cpu.json (the last committed one at a3ee091) and ``docs/prefix_hit_rate.png``.

``--compare-vllm``: a policy-level model of unikv's prefix cache against vLLM's hybrid
"align" mode (and its shared-prefix checkpoint) at equal memory, Qwen3.5, NemotronH
and gpt-oss shapes, chat / system prompt / few-shot with branching / agentic 8k-32k
workloads (issue 41, item 5; the comment above ``SIM_MODELS``) ->
benchmarks/results/prefix_sim_vs_vllm_align.json (the last committed one at a3ee091).
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
    """Per-run tallies: admissions (count, hit tokens, looked-up tokens), steps (all,
    those with prefill rows: each an eager extend step on a GPU), the (live + cached)
    share of the pool per step, the per-sub-pool bytes at the peak."""

    admit: list[int] = field(default_factory=lambda: [0, 0, 0])
    steps: list[int] = field(default_factory=lambda: [0, 0])
    occupancy: list[float] = field(default_factory=list)
    peak: dict[str, int] = field(default_factory=dict)


def _step(pool: UnifiedPool, alloc: PoolAllocator, sched: Scheduler, plans, trace: _Trace) -> None:
    """One scheduler step; each request "samples" the next token of its plan."""
    before = {r.request_id for r in sched.running}
    batch = sched.schedule()
    trace.steps[0] += 1
    trace.steps[1] += not batch.is_decode
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
    counters, admit = alloc.prefix.counters(), trace.admit
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
    parser.add_argument(
        "--compare-vllm", action="store_true",
        help="unikv against vLLM's align mode at equal memory (policy model, seconds) -> "
        "benchmarks/results/prefix_sim_vs_vllm_align.json",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.compare_vllm:
        return compare_main(args)
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


# -- policy comparison at equal memory: unikv against vLLM's hybrid "align" mode ---------
#
# A block-level model of both caches (no allocator, no scheduler: requests one at a
# time, so a run's memory is the cache plus the running request), fed the same token
# streams under one byte budget. What each policy keeps and where a hit may end:
#
# unikv (page 16, per-kind page sizes: a state checkpoint does not inflate the page):
#   - attention pages of 16 tokens; a hit ends on a page;
#   - sliding windows: a request holds only its window; bindings that left it are the
#     cache's: evicted alone first when outside every chain end's window suffix, the
#     suffixes go with their nodes (issue 41, item 2);
#   - recurrent state: checkpoints at the end of the cached run a prompt matched (a
#     divergence point), at the last whole page before the prompt's last token (demoted
#     once a decode checkpoint is taken) and, rolling, at the last whole page of the
#     output (``allocator/checkpoints.py``); eviction: demoted checkpoints, then window
#     bindings outside suffixes, then nodes LRU, leaves first, a leaf holding a shared
#     junction checkpoint (taken at a divergence point, or one a hit restored) after
#     every other leaf (``prefix_evict.evict_lru``: a page on a junction's chain goes
#     after every other page; a leaf is on one only if its own node holds it); a turn
#     end (a checkpoint past its prompt) is no junction, hit or not; a leaf holding a
#     turn end taken by a request that opened with a hit (``StateCheckpoints.carried``)
#     goes after the plain leaves and before a junction's. Not modelled: the
#     engine's checkpoint-only evictions (``StateCheckpoints.victims``, when the state
#     slots are short: those a hit restored after the rest) and waiting requests'
#     expected chains (requests come one at a time).
# vLLM align mode (as documented for its hybrid prefix caching): the attention block size
#   is raised (multiple of 16) until one block's bytes are at least one state's; a state
#   snapshot is retained at every block boundary a request passes (prompt and output); a
#   hit ends on a block with a snapshot; with the shared-prefix checkpoint
#   (``vllm-align+spc``) keys are hashed every 64 tokens (its prefix-match unit) and a
#   checkpoint is also stored at the junction where a prompt leaves the cached run it
#   matched, so a hit can end there. Freed blocks keep their hash and are evicted in
#   free order; a finished request frees its blocks tail first, and a sliding window
#   frees its blocks as they leave (vLLM's hybrid allocator). Models without state keep
#   block 16 (gpt-oss): vLLM then differs from unikv in its window rule only.

SIM_MODELS = {
    "qwen3.5-27b": "qwen3.5-27b.json",
    "nemotron-h-8b": "nemotron-h-8b.json",
    "gpt-oss-20b": "gpt-oss-20b.json",
}
MATCH_UNIT = 64  # vLLM's --prefix-match-unit with the shared-prefix checkpoint


@dataclass(frozen=True)
class Shape:
    """Bytes per token of full attention (all such layers) and of sliding-window
    layers, the window, and one recurrent state's bytes (0: none)."""

    name: str
    full: int
    swa: int
    window: int
    state: int


def shape_of(name: str, preset: str) -> Shape:
    specs = model_specs_from_hf_config(ROOT / "unikv/presets" / preset, page_size=PAGE)
    full = sum(c.spec.entry_bytes for c in specs.subpools if c.spec.kind in ("full", "mla"))
    swa = [c.spec for c in specs.subpools if c.spec.kind == "swa"]
    state = [c.spec.page_bytes(1) for c in specs.subpools if c.spec.kind == "mamba"]
    window = swa[0].sliding_window if swa else 0
    return Shape(name, full, sum(s.entry_bytes for s in swa), window, state[0] if state else 0)


@dataclass(frozen=True)
class Policy:
    name: str
    unit: int  # tokens per cached (hashed) block
    block: int  # tokens per allocation block (memory of a partial block is whole)
    every_block_state: bool  # vLLM: a snapshot at every block boundary
    junction: bool  # a checkpoint where a prompt leaves the run it matched
    unikv: bool


def policies(shape: Shape) -> list[Policy]:
    """unikv's policy and vLLM's align mode (with and without its shared-prefix
    checkpoint) for ``shape``."""
    unikv = Policy("unikv", PAGE, PAGE, False, True, True)
    if not shape.state:
        return [unikv, Policy("vllm", PAGE, PAGE, False, False, False)]
    per_token = shape.full + shape.swa
    block = -(-shape.state // per_token // PAGE) * PAGE
    block = max(block, PAGE) if block * per_token >= shape.state else block + PAGE
    spc = -(-block // MATCH_UNIT) * MATCH_UNIT  # the match unit divides the block
    return [
        unikv,
        Policy("vllm-align", block, block, True, False, False),
        Policy("vllm-align+spc", MATCH_UNIT, spc, True, True, False),
    ]


class _Blk:
    __slots__ = (
        "attn", "carried", "children", "demoted", "depth", "end", "parent", "shared", "state",
        "swa", "turn",
    )  # fmt: skip

    def __init__(self, parent, depth: int) -> None:
        self.parent, self.depth = parent, depth
        self.attn = self.swa = self.state = self.demoted = self.end = self.shared = False
        self.turn = False  # its checkpoint is a turn end (taken past its prompt)
        self.carried = False  # a turn end taken by a request that opened with a hit
        self.children = 0


class PolicyCache:
    """The cached blocks of one policy under a byte budget (module comment above)."""

    def __init__(self, shape: Shape, policy: Policy, budget: int) -> None:
        self.shape, self.policy, self.budget = shape, policy, budget
        self.blocks: dict[int, _Blk] = {}
        self.queue: dict[tuple[str, int], None] = {}  # evictable items, oldest first
        self.cached = 0  # bytes
        self.pinned: set[int] = set()
        self.stats = {"hit": 0, "query": 0, "recomputed": 0, "states": 0, "evicted": 0}
        self.held: list[int] = []

    # bytes of one cached unit's items
    def _bytes(self, kind: str) -> int:
        u, s = self.policy.unit, self.shape
        return {"attn": u * s.full, "swa": u * s.swa, "state": s.state}[kind]

    def keys(self, tokens: list[int]) -> list[int]:
        u, keys, key = self.policy.unit, [], 0
        for i in range(len(tokens) // u):
            key = hash((key, tuple(tokens[i * u : (i + 1) * u])))
            keys.append(key)
        return keys

    def _window_ok(self, keys: list[int], k: int) -> bool:
        if not self.shape.window:
            return True
        u = self.policy.unit
        first = max(k * u + 1 - self.shape.window, 0) // u
        return all(self.blocks[keys[i]].swa for i in range(first, k))

    def lookup(self, tokens: list[int]) -> tuple[int, int, list[int]]:
        """(hit tokens, matched run in blocks, keys of ``tokens``'s blocks)."""
        keys = self.keys(tokens[:-1])
        run = 0
        while run < len(keys) and keys[run] in self.blocks and self.blocks[keys[run]].attn:
            run += 1
        k = run
        while k and not (
            self._window_ok(keys, k) and (not self.shape.state or self.blocks[keys[k - 1]].state)
        ):
            k -= 1
        return k * self.policy.unit, run, keys

    def _add(self, kind: str, key: int) -> None:
        self.cached += self._bytes(kind)
        setattr(self.blocks[key], kind, True)

    def _drop(self, kind: str, key: int) -> None:
        blk = self.blocks.get(key)
        if blk is None or not getattr(blk, kind):
            return
        setattr(blk, kind, False)
        self.cached -= self._bytes(kind)
        self.queue.pop((kind, key), None)
        self.stats["evicted"] += kind == "attn"
        if kind == "attn":  # the node goes: its window binding and state with it
            self._drop("swa", key)
            self._drop("state", key)
            if blk.parent in self.blocks:
                self.blocks[blk.parent].children -= 1
            del self.blocks[key]

    def _suffixes(self, ends: bool = True) -> set[int]:
        span = -(-(self.shape.window - 1) // self.policy.unit)
        keep = set()
        for key, blk in self.blocks.items():
            if blk.children == 1 and not blk.state and not (ends and blk.end):
                continue
            walk = key
            for _ in range(span):
                if walk not in self.blocks or walk in keep:
                    break
                keep.add(walk)
                walk = self.blocks[walk].parent
        return keep

    def make_room(self, live: int) -> None:
        """Evict until cached + live bytes fit the budget (or nothing is evictable)."""
        if self.cached + live <= self.budget:
            return
        if not self.policy.unikv:  # free order
            for kind, key in list(self.queue):
                if self.cached + live <= self.budget:
                    return
                if key not in self.pinned and (kind, key) in self.queue:
                    self._drop(kind, key)
            return
        for kind, key in [i for i in self.queue if i[0] == "state"]:  # demoted states
            if self.cached + live <= self.budget:
                return
            if self.blocks[key].demoted and key not in self.pinned:
                self._drop(kind, key)
        if self.shape.window:  # outside every suffix, then in prompt ends' suffixes only
            strong, weak = self._suffixes(False), self._suffixes()
            swa = [i for i in self.queue if i[0] == "swa" and i[1] not in strong]
            swa.sort(key=lambda i: i[1] in weak)  # stable: oldest first within each
            for kind, key in swa:
                if self.cached + live <= self.budget:
                    return
                if key not in self.pinned:
                    self._drop(kind, key)
        while self.cached + live > self.budget:  # nodes, oldest first, leaves only
            leaves = (k for kind, k in self.queue if kind == "attn" and k not in self.pinned
                      and self.blocks[k].children == 0)  # fmt: skip
            # a leaf holding a carried turn end after the plain ones, one holding a
            # junction checkpoint (shared by >= 2 requests) after every other leaf
            victim = min(leaves, key=self._rank, default=None)
            if victim is None:
                return
            self._drop("attn", victim)

    def _rank(self, key: int) -> int:
        """Leaf ``key``'s eviction rank (lowest first; oldest first within a rank): 2
        holding a shared junction checkpoint (``StateCheckpoints.junctions``), 1 a
        carried turn end (``StateCheckpoints.carried``), else 0."""
        blk = self.blocks[key]
        if not blk.state:
            return 0
        return 2 if blk.shared and not blk.turn else int(blk.carried)

    def _release(self, kind: str, key: int) -> None:
        self.queue.pop((kind, key), None)
        self.queue[(kind, key)] = None

    def serve(self, prompt: list[int], output: list[int]) -> None:
        """One request: look up, prefill, decode, cache; evict to fit as it grows."""
        s, p, u = self.shape, self.policy, self.policy.unit
        hit, run, _ = self.lookup(prompt)
        self.stats["hit"] += hit
        self.stats["query"] += len(prompt) - 1
        self.stats["recomputed"] += len(prompt) - hit
        tokens = prompt + output
        keys = self.keys(tokens)
        self.pinned = set(keys[: hit // u])
        if hit:  # a checkpoint that served a hit: shared by two requests
            self.blocks[keys[hit // u - 1]].shared = True
        for key in self.pinned:  # a hit holds its blocks
            for kind in ("attn", "swa", "state"):
                self.queue.pop((kind, key), None)
        # live bytes: the request's own (uncached) blocks, its window, one state
        total = len(tokens)
        own = -(-(total - hit) // p.block) * p.block
        win = min(total, s.window + 2 * PAGE) if s.window else total
        live = own * s.full + win * s.swa + s.state
        self.make_room(live)
        points = self._state_points(prompt, output, hit, run)
        parent = keys[hit // u - 1] if hit else 0
        for i in range(hit // u, len(keys)):  # cache every whole block
            key = keys[i]
            if key not in self.blocks:
                self.blocks[key] = _Blk(parent, i)
                if parent in self.blocks:
                    self.blocks[parent].children += 1
                self._add("attn", key)
                if s.swa:
                    self._add("swa", key)
            parent = key
        if s.window:  # where the engine's inserts end: prompt chunks, the prompt
            for pos in [*range(CHUNK, len(prompt), CHUNK), len(prompt)]:
                if pos // u and keys[pos // u - 1] in self.blocks:
                    self.blocks[keys[pos // u - 1]].end = True
        for pos in points:
            key = keys[pos // u - 1]
            if key in self.blocks and not self.blocks[key].state:
                self._add("state", key)
                self.stats["states"] += 1
                self.blocks[key].turn = pos > len(prompt)
                self.blocks[key].carried = bool(hit) and pos > len(prompt)
            if pos == run * u and run * u > hit and key in self.blocks:  # (a): a junction
                self.blocks[key].shared = True

        if p.unikv and s.state and len(points) > 1:  # the prompt-end one is demoted
            for pos in points[:-1]:
                if pos > run * u and pos // u - 1 < len(keys):
                    self.blocks[keys[pos // u - 1]].demoted = True
        self.pinned = set()
        # release, oldest first: windows left in order; the request's blocks tail first
        # (vLLM frees in reverse; unikv's LRU takes deepest first within one release)
        for i in reversed(range(len(keys))):
            key = keys[i]
            if key not in self.blocks:
                continue
            if s.swa:
                self._release("swa", key)
        for i in reversed(range(len(keys))):
            key = keys[i]
            if key in self.blocks:
                for kind in ("state", "attn"):
                    if getattr(self.blocks[key], kind):
                        self._release(kind, key)
        if s.swa and not p.unikv:  # vLLM: the out-of-window blocks were freed earlier
            gone = max(len(tokens) - s.window, 0) // u
            for i in range(min(gone, len(keys))):
                if ("swa", keys[i]) in self.queue:
                    self.queue.pop(("swa", keys[i]))
                    self.queue = {("swa", keys[i]): None, **self.queue}
        self.make_room(0)
        self.held.append(self.cached)

    def _state_points(self, prompt, output, hit: int, run: int) -> list[int]:
        """Token counts (multiples of the unit) at which a state checkpoint is taken."""
        s, p, u = self.shape, self.policy, self.policy.unit
        if not s.state:
            return []
        total = len(prompt) + len(output)
        if p.every_block_state:
            points = list(range(p.block, total + 1, p.block))
            if p.junction and run * u > hit:  # the junction with the run it matched
                points.append(run * u)
            return sorted(set(points))
        points = []
        if run * u > hit:  # unikv (a): where the prompt leaves the cached run
            points.append(run * u)
        points.append((len(prompt) - 1) // u * u)  # (b) the prompt's last whole page
        points.append(total // u * u)  # (c) the rolling decode checkpoint, at the end
        return sorted({x for x in points if x > hit})


def fewshot_workload(num: int, seed: int) -> list[list[Turn]]:
    """Few-shot with branching: a 1024-token instruction, 4 shot sets of 512 tokens
    branching off it, ``num`` questions of 32-128 tokens over random shot sets."""
    rng = np.random.default_rng(seed)
    head = _ids(rng, 1024)
    shots = [_ids(rng, 512) for _ in range(4)]
    turns = []
    for _ in range(num):
        prompt = head + shots[int(rng.integers(4))] + _ids(rng, int(rng.integers(32, 129)))
        turns.append(Turn(prompt, _ids(rng, int(rng.integers(32, 129))), 1536))
    return [turns]


def agentic_workload(agents: int, steps: int, seed: int, start=8192, limit=32768):
    """Agents (round-robin): an ``start``-token prompt, then each step appends the
    output (128-512) and a tool result (1k-4k tokens), up to ``limit`` tokens."""
    rng = np.random.default_rng(seed)
    history = [_ids(rng, start) for _ in range(agents)]
    out = []
    for _ in range(steps):
        turns = []
        for a in range(agents):
            if len(history[a]) > limit - 4096:
                continue
            output = _ids(rng, int(rng.integers(128, 513)))
            turns.append(Turn(list(history[a]), output, len(history[a])))
            history[a] = history[a] + output + _ids(rng, int(rng.integers(1024, 4097)))
        if turns:
            out.append(turns)
    return out


def policy_workloads(scale: float = 1.0, seed: int = 0) -> dict[str, list[list[Turn]]]:
    n = max(round(scale * 48), 2)
    return {
        "chat": chat_workload(max(int(12 * scale), 2), 4, seed + 1),
        "system": system_workload(n, seed, max(int(2048 * scale), 64)),
        "fewshot": fewshot_workload(n, seed + 2),
        "agentic": agentic_workload(max(int(4 * scale), 1), 6, seed + 3,
                                    max(int(8192 * scale), 256), max(int(32768 * scale), 8192)),
    }  # fmt: skip


def policy_need(shape: Shape, rounds) -> int:
    """The working set: every distinct token's attention bytes (16-token pages) plus
    one state per request."""
    keys, count = set(), 0
    for turn in (t for r in rounds for t in r):
        tokens, key = turn.prompt + turn.output, 0
        for i in range(len(tokens) // PAGE):
            key = hash((key, tuple(tokens[i * PAGE : (i + 1) * PAGE])))
            keys.add(key)
        count += 1
    return len(keys) * PAGE * (shape.full + shape.swa) + count * shape.state


def compare(shape: Shape, rounds, demands=(1.0, 2.0, 4.0)) -> list[dict]:
    """Each policy on the same turns at pools of ``need / x`` bytes (equal memory)."""
    need = policy_need(shape, rounds)
    turns = [t for r in rounds for t in r]
    out = []
    for x in demands:
        budget = int(need / x)
        row = {"demand_occupancy": x, "budget_bytes": budget, "policies": {}}
        for policy in policies(shape):
            cache = PolicyCache(shape, policy, budget)
            for turn in turns:
                cache.serve(turn.prompt, turn.output)
            st = cache.stats
            row["policies"][policy.name] = {
                "block": policy.block,
                "hit_rate": st["hit"] / max(st["query"], 1),
                "prefill_tokens_saved": st["hit"],
                "recomputed_tokens": st["recomputed"],
                "state_checkpoints": st["states"],
                "evicted_blocks": st["evicted"],
                "mean_bytes_held": float(np.mean(cache.held)),
            }
        out.append(row)
    return out


def compare_all(scale: float = 1.0, demands=(1.0, 2.0, 4.0), seed: int = 0) -> dict:
    """unikv against vLLM's align mode on every model and workload; ratios per point."""
    workloads = policy_workloads(scale, seed)
    runs = []
    for name, preset in SIM_MODELS.items():
        shape = shape_of(name, preset)
        for workload, rounds in workloads.items():
            for row in compare(shape, rounds, demands):
                pol = row["policies"]
                rivals = [n for n in pol if n != "unikv"]
                best = max(rivals, key=lambda n: pol[n]["hit_rate"])
                u, v = pol["unikv"], pol[best]
                row.update(
                    model=name,
                    workload=workload,
                    best_vllm=best,
                    hit_rate_ratio=u["hit_rate"] / v["hit_rate"] if v["hit_rate"] else None,
                    recomputed_ratio=u["recomputed_tokens"] / max(v["recomputed_tokens"], 1),
                )
                runs.append(row)
    return {"scale": scale, "seed": seed, "page": PAGE, "runs": runs}


def _ratio_row(run: dict) -> str:
    pol = run["policies"]
    cells = " ".join(f"{n}={p['hit_rate']:6.1%}" for n, p in pol.items())
    ratio = run["hit_rate_ratio"]
    return (
        f"{run['model']:14s} {run['workload']:8s} {run['demand_occupancy']:4.1f} {cells} "
        f"hit x{ratio if ratio is None else round(ratio, 2)} "
        f"recomputed x{run['recomputed_ratio']:.2f}"
    )


def compare_main(args) -> dict:
    scale, demands = (0.25, (1.0, 2.0)) if args.quick else (1.0, (1.0, 2.0, 4.0))
    start = time.perf_counter()
    results = compare_all(scale, demands, args.seed)
    results.update(
        kind="policy-level CPU model (no allocator, no model): unikv's prefix policy "
        "against vLLM's hybrid align mode at equal memory; requests one at a time",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        x_axis="demand occupancy = need / pool bytes; need = every distinct token's "
        "attention bytes (16-token pages) + one state per request",
        ratios="hit_rate_ratio = unikv / the best vLLM variant's hit rate; "
        "recomputed_ratio = unikv / that variant's recomputed prompt tokens",
        seconds=time.perf_counter() - start,
    )
    for run in results["runs"]:
        print(_ratio_row(run))
    out = Path(args.out)
    if out.name == "prefix_sim_cpu.json":
        out = out.with_name("prefix_sim_vs_vllm_align.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"saved {out}")
    return results


if __name__ == "__main__":
    main()
