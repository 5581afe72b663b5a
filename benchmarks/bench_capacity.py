"""Pool capacity under one byte budget: unified vs static split vs equal page bytes.

A SCHEDULER-LEVEL SIMULATION: no model runs. The engine's own ``Scheduler``
(chunked prefill, decode batching, admission by the capacity oracle,
preemption by recompute, freeing of out-of-window SWA pages) drives the real
``PoolAllocator`` over real ``UnifiedPool`` buffers (CPU); every "sampled"
token is a dummy. A step is one scheduler step, so throughput is requests and
tokens completed per simulated step, not per second.

Schemes (same budget, same workload, same loop):

- ``unified``: one pool, every sub-pool in it, boundaries move at run time.
- ``static_split``: one pool per sub-pool, each a fixed byte region sized the
  usual way: SGLang's defaults ``swa_full_tokens_ratio = 0.8`` (SWA tokens =
  0.8 x full tokens) and ``mamba_full_memory_ratio = 0.9`` (Mamba bytes = 0.9 x
  full-attention bytes).
- ``equal_pages``: every sub-pool's page made the same bytes, as vLLM's hybrid
  allocator does. Token sub-pools are padded to the largest layer count
  (vLLM pads layer groups); with Mamba, the attention page size is raised to
  the smallest multiple of 16 tokens whose per-layer page holds one layer's
  Mamba state, each Mamba layer is padded to that page, and the Mamba layers
  to a multiple of the attention layer count. It runs on the unified allocator
  (pages of any kind are interchangeable after compaction, as in one shared
  page pool), so the only difference to ``unified`` is the padding.

Layout schemes (``capacity_models.py``), same pool policies over transformed specs:
``unified_padded`` / ``static_split_padded`` (K and V rows padded to
``max(D, Dv)``, MiMo-V2-Flash) and ``expanded_kv`` (per-head K/V instead of the
MLA latent row, DeepSeek-V3).

Usage: ``python benchmarks/bench_capacity.py [--quick] [--models a,b]`` ->
``benchmarks/results/capacity.json`` (entries of models not run are kept) and
``docs/occupancy_<model>_<scheme>.png`` (via ``plot_results.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.capacity_models import (
    MAMBA_FULL_MEMORY_RATIO,
    MODELS,
    SCHEME_RULES,
    SWA_FULL_TOKENS_RATIO,
    ModelCase,
    equal_page_configs,
    mixed_workload,
    static_shares,
)
from unikv.allocator import DecodeStep, PoolAllocator
from unikv.engine.request import Request
from unikv.engine.sampling import SamplingParams
from unikv.engine.scheduler import Scheduler
from unikv.hf_config import model_specs_from_hf_config
from unikv.pool import UnifiedPool

SCHEMES = ("unified", "static_split", "equal_pages")


class SchemeAllocator:
    """What the engine's ``Scheduler`` calls, over one PoolAllocator (unified,
    equal pages) or several (static split: one per sub-pool).

    A request holds one slot in every allocator; a Mamba slot is taken with
    admission (or its first chunk). A step that fails in one allocator is rolled back in the
    others (``truncate`` / ``free_mamba``), so state stays unchanged on None.
    """

    def __init__(self, allocs: list[PoolAllocator], max_requests: int) -> None:
        self.allocs = allocs
        self.inner = np.full((max_requests, len(allocs)), -1, np.int64)  # outer -> inner slots
        self.has_mamba = np.zeros(max_requests, bool)
        self.free_slots = list(range(max_requests - 1, -1, -1))
        self.token_allocs = [a for a in allocs if a.parts.roles.token_names]
        self.mamba_alloc = next((a for a in allocs if a.parts.roles.mamba_name), None)

    @property
    def view(self):
        """The read-only view the ``Scheduler`` reads (``draft_k``: no speculation here)."""
        return self.allocs[0].view

    def _slots(self, slots: np.ndarray, alloc: PoolAllocator) -> np.ndarray:
        return self.inner[np.asarray(slots, np.int64), self.allocs.index(alloc)]

    def new_request(self) -> int:
        slot = self.free_slots.pop()
        self.inner[slot] = [a.new_request() for a in self.allocs]
        return slot

    def free_request(self, slots: int | object, defer: bool = False) -> None:
        """Free request ``slots`` (an int, or host ints: those finishing in one step,
        as ``PoolAllocator.free_request`` takes them) in every scheme's allocator."""
        many = np.atleast_1d(np.asarray(slots, np.int64))
        for i, a in enumerate(self.allocs):
            a.free_request(self.inner[many, i], defer=defer)
        self.inner[many] = -1
        self.has_mamba[many] = False
        self.free_slots.extend(int(s) for s in many)

    def can_admit(self, demand: dict[str, int]) -> tuple[bool, bool]:
        now = after = True
        for a in self.allocs:
            part = {n: d for n, d in demand.items() if n in a.parts.books}
            ok_now, ok_after = a.can_admit(part)
            now, after = now and ok_now, after and ok_after
        return now, after

    def _mamba_for(self, slots: np.ndarray) -> np.ndarray | None:
        """Take Mamba slots for requests lacking one; the requests that got one."""
        if self.mamba_alloc is None:
            return slots[:0]
        need = slots[~self.has_mamba[slots]]
        if len(need) and self.mamba_alloc.alloc_mamba(self._slots(need, self.mamba_alloc)) is None:
            return None
        self.has_mamba[need] = True
        return need

    def alloc_mamba(self, slots) -> np.ndarray | None:
        """The scheduler's admission verb for a state slot (None: no room)."""
        return self._mamba_for(np.asarray(slots, np.int64))

    def _undo_mamba(self, taken: np.ndarray) -> None:
        if len(taken):
            self.mamba_alloc.parts.mamba.free(self._slots(taken, self.mamba_alloc))
            self.has_mamba[taken] = False

    def _grow(self, slots, lens, verb):
        """Run ``verb(alloc, inner_slots)`` in every token allocator, all or nothing."""
        slots = np.asarray(slots, np.int64)
        taken = self._mamba_for(slots)
        if taken is None:
            return None
        done, ids = [], None
        for a in self.token_allocs:
            out = verb(a, self._slots(slots, a))
            if out is None:
                for b in done:
                    b.truncate(self._slots(slots, b), np.asarray(lens, np.int64))
                self._undo_mamba(taken)
                return None
            done.append(a)
            ids = out if ids is None else ids
        return ids

    def alloc_extend(self, slots, prefix_lens, extend_lens):
        return self._grow(
            slots, prefix_lens, lambda a, s: a.alloc_extend(s, prefix_lens, extend_lens)
        )

    def alloc_decode(self, slots, seq_lens):
        return self._grow(slots, seq_lens, lambda a, s: a.alloc_decode(s, seq_lens))

    def decode_step(self, slots, seq_lens, *, block_tables=None, write_ids=None):
        """The scheduler's decode verb: allocate, then free out-of-window pages at the
        new lengths. No tables: the simulation runs no forward."""
        ids = self.alloc_decode(slots, seq_lens)
        if ids is None:
            return None
        self.free_out_of_window(slots, np.asarray(seq_lens) + 1)
        return DecodeStep(ids, None, None, {}, {})

    def free_out_of_window(self, slots, seq_lens) -> None:
        for a in self.token_allocs:
            if a.parts.roles.windows:
                a.free_out_of_window(self._slots(slots, a), seq_lens)

    def usage(self) -> dict[str, tuple[int, int]]:
        """(live bytes, band bytes) per sub-pool name."""
        out = {}
        for a in self.allocs:
            for name, sub in a.parts.books.items():
                out[name] = (sub.num_live * sub.page_bytes, (sub.hi - sub.lo) * sub.page_bytes)
        return out


# -- schemes ---------------------------------------------------------------------------


def build_scheme(
    scheme: str,
    configs,
    budget: int,
    max_requests: int,
    max_context: int,
    *,
    device: str = "cpu",
    max_request_tokens: int | None = None,
    chunk: int = 1,
):
    """(SchemeAllocator, the sub-pools the scheduler sizes demand with, region bytes).

    device: ``"meta"`` builds buffers that take no memory (the simulation reads no
    data; page copies are skipped). max_request_tokens: ValueError at build time
    unless one request of that many tokens (prefilled ``chunk`` at a time) fits
    alone, instead of a scheduler assertion mid-run."""
    configs = [dataclasses.replace(c, layers=()) for c in configs]
    kw = {"max_requests": max_requests, "max_context": max_context}
    pool_kw = {"device": device, "max_request_tokens": max_request_tokens, "chunk_tokens": chunk}
    if device == "meta":
        pool_kw["copy_pages"] = _skip_copy
    if scheme == "static_split":
        shares = static_shares(configs)
        pools = [UnifiedPool([c], int(budget * shares[c.name]), **pool_kw) for c in configs]
        regions = {c.name: int(budget * shares[c.name]) for c in configs}
    elif scheme in ("unified", "equal_pages"):
        cfgs = equal_page_configs(configs) if scheme == "equal_pages" else configs
        pools, regions = [UnifiedPool(cfgs, budget, **pool_kw)], {}
    else:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if device == "meta":  # no bytes to zero either (a fresh state slot's zero fill)
        for p in pools:
            p.zero_pages = _skip_zero
    allocs = [PoolAllocator(p, **kw) for p in pools]
    subpools = [s for p in pools for s in p.subpools.values()]
    return SchemeAllocator(allocs, max_requests), subpools, regions


def _skip_copy(buffer, src, dst, page_bytes, *, disjoint: bool = False) -> None:
    """Page copy on a meta buffer (``CopyPages``' signature): there are no bytes to move."""


def _skip_zero(name, pages) -> None:
    """Zero fill on a meta buffer: there are no bytes to clear."""


# -- workload and loop -----------------------------------------------------------------


def simulate(
    scheme_alloc,
    subpools,
    workload,
    *,
    max_context: int,
    chunk: int,
    max_num_seqs: int,
    on_step=None,
) -> dict:
    """Drive the engine's Scheduler over ``scheme_alloc`` until every request is
    done; per-step trace and summary counters. ``on_step(sched)`` runs after
    every step (tests check invariants there)."""
    sched = Scheduler(
        scheme_alloc, subpools, max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk
    )
    requests = [
        Request(
            i,
            [1] * p,
            SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0),
            0,
            frozenset(),
            max_context,
        )
        for i, (p, o) in enumerate(workload)
    ]
    for r in requests:
        sched.add(r)
    trace = {
        "running": [],
        "tokens_held": [],
        "live": {s.name: [] for s in subpools},
        "band": {s.name: [] for s in subpools},
    }
    done_steps, start = [], time.perf_counter()
    while sched.has_work():
        batch = sched.schedule()
        finished = sched.complete(batch, [1] * len(batch.requests))
        if on_step is not None:
            on_step(sched)
        done_steps.extend([len(trace["running"])] * len(finished))
        trace["running"].append(len(sched.running))
        trace["tokens_held"].append(sum(r.num_cached for r in sched.running))
        for name, (live, band) in scheme_alloc.usage().items():
            trace["live"][name].append(live)
            trace["band"][name].append(band)
    steps = len(trace["running"])
    out_tokens = sum(len(r.output_ids) for r in requests)
    assert all(len(r.output_ids) == o for r, (_, o) in zip(requests, workload)), (
        "simulation: a request ended early"
    )
    return {
        "steps": steps,
        "max_concurrent": max(trace["running"]),
        "mean_concurrent": float(np.mean(trace["running"])),
        "max_tokens_held": max(trace["tokens_held"]),
        "mean_tokens_held": float(np.mean(trace["tokens_held"])),
        "preemptions": sched.num_preemptions,
        "requests_per_step": len(requests) / steps,
        "output_tokens_per_step": out_tokens / steps,
        "half_done_step": int(np.median(done_steps)),
        "sim_seconds": time.perf_counter() - start,
        "trace": trace,
    }


def run_model(
    case: ModelCase, budget: int, workload, *, chunk: int, max_num_seqs: int, device: str
) -> dict:
    """Every scheme of ``case`` at ``budget`` bytes over ``workload``; ratios vs its baseline."""
    specs = model_specs_from_hf_config(case.preset, page_size=16)
    hf = case.hf()
    max_context = max(p + o for p, o in workload) + 1
    result = {
        "model": case.name,
        "budget_bytes": budget,
        "baseline": case.baseline,
        "subpools": {},
        "schemes": {},
    }
    for c in specs.subpools:
        result["subpools"][c.name] = {
            "kind": c.spec.kind,
            "layers": c.spec.num_layers,
            "entry_bytes": c.spec.entry_bytes,
            "page_size": c.page_size,
        }
    for scheme in case.schemes:
        policy, transform = SCHEME_RULES[scheme]
        configs = list(specs.subpools)
        configs = transform(configs, hf) if transform is not None else configs
        alloc, subpools, regions = build_scheme(
            policy,
            configs,
            budget,
            max_num_seqs,
            max_context,
            device=device,
            max_request_tokens=max_context,
            chunk=chunk,
        )
        res = simulate(
            alloc,
            subpools,
            workload,
            max_context=max_context,
            chunk=chunk,
            max_num_seqs=max_num_seqs,
        )
        res["regions"] = regions
        res["page_bytes"] = {s.name: s.page_bytes for s in subpools}
        res["entry_bytes"] = {s.name: s.spec.entry_bytes for s in subpools}
        result["schemes"][scheme] = res
        del alloc, subpools  # free this scheme's buffers before the next is built
        gc.collect()
        print(
            f"{case.name:13s} {scheme:19s} max_conc {res['max_concurrent']:4d} "
            f"mean_conc {res['mean_concurrent']:7.1f} max_tok {res['max_tokens_held']:8d} "
            f"preempt {res['preemptions']:5d} steps {res['steps']:6d} "
            f"tok/step {res['output_tokens_per_step']:7.1f} ({res['sim_seconds']:.1f} s)"
        )
    keys = ("mean_concurrent", "mean_tokens_held", "output_tokens_per_step", "max_concurrent")
    for suffix, base_name in (("static", "static_split"), ("baseline", case.baseline)):
        base = result["schemes"].get(base_name)
        for res in result["schemes"].values() if base is not None else ():
            for key in keys:
                res[f"{key}_vs_{suffix}"] = res[key] / base[key]
    return result


def _downsample(res: dict, points: int = 1500) -> None:
    trace = res["trace"]
    n = len(trace["running"])
    idx = np.unique(np.linspace(0, n - 1, min(points, n)).astype(int)).tolist()
    trace["step"] = idx
    trace["running"] = [trace["running"][i] for i in idx]
    trace["tokens_held"] = [trace["tokens_held"][i] for i in idx]
    for key in ("live", "band"):
        trace[key] = {k: [v[i] for i in idx] for k, v in trace[key].items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, smaller budgets")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument(
        "--models",
        default=",".join(c.name for c in MODELS),
        help="comma-separated models to run; the others' entries in --out are kept",
    )
    parser.add_argument(
        "--device",
        default="meta",
        choices=("meta", "cpu"),
        help="pool buffers: meta takes no memory (same results: no data is read)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/capacity.json"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    by_name = {c.name: c for c in MODELS}
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise ValueError(f"--models must name some of {list(by_name)}, got {args.models!r}")
    num = args.requests or (64 if args.quick else 256)
    results = {
        "kind": "scheduler-level simulation (no model runs): the engine's Scheduler and the real "
        "PoolAllocator over real UnifiedPool buffers; throughput is per simulated step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "static_split_rule": f"SGLang defaults: swa_full_tokens_ratio {SWA_FULL_TOKENS_RATIO}, "
        f"mamba_full_memory_ratio {MAMBA_FULL_MEMORY_RATIO}",
        "chunk_tokens": 2048,
        "num_requests": num,
        "quick": args.quick,
        "models": [],
    }
    out = Path(args.out)
    kept = json.loads(out.read_text()).get("models", []) if out.exists() else []
    for name in names:
        case = by_name[name]
        workload = mixed_workload(num, **case.workload)
        res = run_model(
            case,
            case.budget(args.quick),
            workload,
            chunk=2048,
            max_num_seqs=512,
            device=args.device,
        )
        res["num_requests"], res["quick"] = num, args.quick
        res["workload"] = {
            "prompt_lens": [p for p, _ in workload],
            "output_lens": [o for _, o in workload],
        }
        for scheme in res["schemes"].values():
            _downsample(scheme)
        results["models"].append(res)
    new = {m["model"] for m in results["models"]}
    order = [c.name for c in MODELS]
    merged = [m for m in kept if m["model"] not in new] + results["models"]
    results["models"] = sorted(
        merged, key=lambda m: order.index(m["model"]) if m["model"] in order else len(order)
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"saved {out}")
    if not args.no_plots:
        from benchmarks.plot_results import plot_occupancy

        plot_occupancy(
            {**results, "models": [m for m in results["models"] if m["model"] in new]},
            ROOT / "docs",
        )
    return results


if __name__ == "__main__":
    main()
