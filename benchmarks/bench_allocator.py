"""Host time per decode step of the allocator and its tables.

For B in (1, 64, 256) requests with contexts drawn from 1k-4k tokens, a
gpt-oss-shaped chain (full attention + SWA, window 128) runs decode steps and
times, on the host (time.perf_counter, no synchronisation inside the loop):

    alloc_decode        one new token per request
    free_out_of_window  SWA pages leaving the window (tombstones)
    block_table         kernel page entries for both sub-pools (kernels backend)
    translate           write locations (kernel ids) for both sub-pools

then the same step through ``decode_step``, which does all four in one call
(one upload, two launches): the path an engine takes.

Targets (README.md, Allocator): <= 2 us of host time per request and <= 0.3 ms per
step at B = 256. Prints a table and saves JSON to
benchmarks/results/allocator_<device>.json. It also counts the device ops of
each part (aten ops that launch a kernel, plus Triton launches) over a few
untimed steps: a CPU-measurable proxy of the GPU host cost. ``--backend triton``
on CPU counts the CUDA path's ops (the Triton interpreter runs them).

    python benchmarks/bench_allocator.py --device cpu|cuda [--page-sizes 1,16]

An A/B against another checkout (``git worktree add /tmp/base COMMIT``) runs this
tree's bench and that tree's, each in a process of its own, in turn for ``--rounds``
rounds (the order flipped each round, so drift hits both), and prints each part's
time ratio this/base: the median of the per-round ratios and their range:

    python benchmarks/bench_allocator.py --vs /tmp/base --rounds 8 --page-sizes 16
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this tree's unikv

from unikv.allocator import PoolAllocator
from unikv.kernels import get_backend
from unikv.pool import SubPoolConfig, UnifiedPool, pool_bytes_for
from unikv.specs import MHASpec

PARTS = ("alloc_decode", "free_out_of_window", "block_table", "translate")


def build(
    batch: int,
    ps: int,
    steps: int,
    device: str,
    rng: np.random.Generator,
    backend: str | None = None,
):
    """An allocator holding ``batch`` requests of 1k-4k tokens, pages shuffled.
    backend: None (by device) or "triton"/"torch" for the allocator's table ops
    and block table (Triton on CPU runs in the interpreter: counts, not times)."""
    configs = [
        SubPoolConfig("full", MHASpec(1, 1, 8), page_size=ps),
        SubPoolConfig("swa", MHASpec(1, 1, 8, sliding_window=128), page_size=ps),
    ]
    context = 4096 + steps + 8  # warm-up steps included
    lens = rng.integers(1024, 4097, size=batch)
    pages = int((lens + steps + 8 + ps).sum() // ps + 2 * batch + 64)
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": pages, "swa": pages}), device)
    ops = get_backend(device, backend)  # backend None: by device
    alloc = PoolAllocator(pool, max_requests=batch, max_context=context, backend=ops)
    slots = np.array([alloc.new_request() for _ in range(batch)])
    for s, n in zip(slots, lens):  # interleave prefills so pages are scattered
        done = 0
        while done < n:
            chunk = int(min(n - done, rng.integers(64, 512)))
            assert (
                alloc.alloc_extend(np.array([s]), np.array([done]), np.array([chunk])) is not None
            )
            done += chunk
    alloc.free_out_of_window(slots, lens)
    return alloc, slots, lens.astype(np.int64)


COUNT_STEPS = 16  # untimed steps whose device ops are counted
NO_LAUNCH = {
    "slice",
    "view",
    "select",
    "unsqueeze",
    "as_strided",
    "lift_fresh",
    "alias",
    "detach",
    "expand",
    "_unsafe_view",
    "t",
    "squeeze",
}  # metadata-only aten ops


class OpCounter(TorchDispatchMode):
    """Counts aten ops that run kernels (views excluded) and Triton launches; the
    host cost of a verb on the GPU is roughly proportional to this count."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__.rstrip("_") not in NO_LAUNCH:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _count_triton(counter: OpCounter) -> list:
    """Wrap the launch entry points (Triton's, and unikv's direct launcher): +1 per
    launch, aten ops and nested entry points inside paused."""
    from triton.runtime import interpreter, jit

    from unikv.kernels.runtime.launch import Launcher

    undo = []
    for cls, name in (
        (jit.JITFunction, "run"),
        (interpreter.InterpretedFunction, "run"),
        (Launcher, "__call__"),
    ):
        original = getattr(cls, name)

        def run(self, *args, _original=original, **kwargs):
            counter.count += not counter.paused
            counter.paused, was = True, counter.paused
            try:
                return _original(self, *args, **kwargs)
            finally:
                counter.paused = was

        setattr(cls, name, run)
        undo.append((cls, name, original))
    return undo


def count_ops(parts: dict, steps: int) -> dict:
    """Device ops (aten kernels + Triton launches) per step of each verb."""
    totals = dict.fromkeys(parts, 0)
    counter = OpCounter()
    undo = _count_triton(counter)
    try:
        for _ in range(steps):
            for name, fn in parts.items():
                counter.count = 0
                with counter:
                    fn()
                totals[name] += counter.count
    finally:
        for cls, name, original in undo:
            setattr(cls, name, original)
    return {name: total / steps for name, total in totals.items()}


def step_parts(alloc, slots: np.ndarray, lens: np.ndarray, device: str) -> dict:
    """One closure per timed part of a decode step (they share ``lens`` and ids)."""
    batch = len(slots)
    table = torch.zeros((batch, alloc.parts.requests.max_pages), dtype=torch.int32, device=device)
    locs = torch.zeros(batch, dtype=torch.int32, device=device)
    slots_dev = torch.from_numpy(slots.astype(np.int32)).to(device)
    state = {}

    def alloc_decode():
        state["ids"] = alloc.alloc_decode(slots, lens)
        lens[:] += 1

    def free_out_of_window():
        alloc.free_out_of_window(slots, lens)

    def block_table():
        lens_dev = alloc.parts.writer.upload(lens.astype(np.int32))
        for name in ("full", "swa"):
            alloc.block_table(slots_dev, lens_dev, name, table)

    def translate():
        for name in ("full", "swa"):
            alloc.translate(state["ids"], name, out=locs)

    return dict(zip(PARTS, (alloc_decode, free_out_of_window, block_table, translate)))


def fused_step(alloc, slots: np.ndarray, lens: np.ndarray, device: str):
    """``decode_step`` into reused buffers (what an engine with CUDA graphs does)."""
    batch, cols = len(slots), alloc.parts.requests.max_pages
    names = alloc.parts.roles.token_names
    tables = {n: torch.zeros((batch, cols), dtype=torch.int32, device=device) for n in names}
    locs = {n: torch.zeros(batch, dtype=torch.int32, device=device) for n in names}

    def decode_step():
        assert alloc.decode_step(slots, lens, block_tables=tables, write_ids=locs) is not None
        lens[:] += 1

    return decode_step


ROUNDS = 3  # the steps are split into rounds: their medians show the run-to-run spread


def run(
    batch: int,
    ps: int,
    steps: int,
    device: str,
    seed: int,
    backend: str | None = None,
) -> dict:
    """Time the separate verbs and decode_step on twin allocators, interleaved step
    by step (alternating which goes first), so both see the same host conditions."""
    total = steps + COUNT_STEPS
    verbs, slots, lens = build(batch, ps, total, device, np.random.default_rng(seed), backend)
    fused, f_slots, f_lens = build(batch, ps, total, device, np.random.default_rng(seed), backend)
    parts = step_parts(verbs, slots, lens, device)
    step = fused_step(fused, f_slots, f_lens, device)
    times = {p: [] for p in (*PARTS, "decode_step")}
    cuda = device == "cuda"

    def timed(name, fn, keep):
        t0 = time.perf_counter()
        fn()
        if keep:
            times[name].append((time.perf_counter() - t0) * 1e6)

    for i in range(steps + 5):
        keep = i >= 5  # warm-up excluded
        if i % 2:
            timed("decode_step", step, keep)
        for part, fn in parts.items():
            timed(part, fn, keep)
        if not i % 2:
            timed("decode_step", step, keep)
        if cuda:
            for alloc in (verbs, fused):
                event = torch.cuda.Event()
                event.record()
                alloc.mark_in_flight(event)
            if i % 16 == 15:
                torch.cuda.synchronize()  # keep the queue short; outside the timed spans
    ops = count_ops({**parts, "decode_step": step}, COUNT_STEPS)
    if cuda:
        torch.cuda.synchronize()
    verbs.check_integrity()
    fused.check_integrity()
    med = {p: float(np.median(t)) for p, t in times.items()}
    separate = sum(med[p] for p in PARTS)
    rounds = [np.array_split(np.array(times[p]), ROUNDS) for p in (*PARTS, "decode_step")]
    by_round = np.array([[float(np.median(r)) for r in part] for part in rounds])  # (5, R)
    return {
        "batch": batch,
        "page_size": ps,
        "steps": steps,
        "us": {p: med[p] for p in PARTS},
        "us_per_step": separate,
        "us_per_request": separate / batch,
        "device_ops": {p: ops[p] for p in PARTS},
        "round_us_per_step": by_round[: len(PARTS)].sum(0).tolist(),
        "decode_step": {
            "us_per_step": med["decode_step"],
            "us_per_request": med["decode_step"] / batch,
            "device_ops": ops["decode_step"],
            "round_us_per_step": by_round[-1].tolist(),
        },
    }


def environment(device: str) -> dict:
    from common import environment as shared  # benchmarks/common.py

    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", **shared()}


AB_PARTS = (*PARTS, "separate", "decode_step")


def _ab_times(row: dict) -> dict:
    """One bench row's median host us per part, with the separate verbs' sum."""
    times = dict(row["us"])
    times["separate"] = row["us_per_step"]
    times["decode_step"] = row["decode_step"]["us_per_step"]
    return times


def ab_ratios(this: list[dict], base: list[dict]) -> list[dict]:
    """Per (page size, batch) and part: the ratio this/base of each round's medians
    (rounds: lists of bench rows, one list per round, in one order); its median and
    range, and both sides' median us."""
    out = []
    for i, first in enumerate(this[0]):
        a = [_ab_times(rows[i]) for rows in this]
        b = [_ab_times(rows[i]) for rows in base]
        parts = {}
        for part in AB_PARTS:
            ratio = np.array([x[part] / y[part] for x, y in zip(a, b)])
            parts[part] = {
                "ratio": float(np.median(ratio)),
                "ratio_range": [float(ratio.min()), float(ratio.max())],
                "us": float(np.median([x[part] for x in a])),
                "base_us": float(np.median([y[part] for y in b])),
            }
        out.append({"batch": first["batch"], "page_size": first["page_size"], "parts": parts})
    return out


def alternate(args: argparse.Namespace) -> None:
    """``--vs``: this tree's bench and the other tree's, in turn, ``--rounds`` times."""
    base = pathlib.Path(args.vs).resolve()
    trees = {"this": pathlib.Path(__file__).resolve().parents[1], "base": base}
    script = pathlib.Path("benchmarks") / "bench_allocator.py"
    if not (base / script).is_file():
        raise SystemExit(f"--vs {args.vs}: expected a checkout holding {script}, found none")
    flags = ["--device", args.device, "--batches", args.batches, "--page-sizes", args.page_sizes]
    flags += ["--steps", str(args.steps), "--seed", str(args.seed)]
    flags += ["--backend", args.backend] if args.backend else []
    runs: dict[str, list] = {"this": [], "base": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("this", "base") if r % 2 == 0 else ("base", "this"):
                out = pathlib.Path(tmp) / f"{side}_{r}.json"
                tree = trees[side]
                cmd = [sys.executable, str(tree / script), *flags, "--out", str(out)]
                env = {**os.environ, "PYTHONPATH": str(tree)}  # each side imports its unikv
                subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
                runs[side].append(json.loads(out.read_text())["rows"])
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    rows = ab_ratios(runs["this"], runs["base"])
    print(
        f"{'B':>4} {'ps':>3} {'part':>19} {'this/base':>9} {'range':>13} {'us':>9} {'base us':>9}"
    )
    for row in rows:
        for part, p in row["parts"].items():
            lo, hi = p["ratio_range"]
            print(
                f"{row['batch']:>4} {row['page_size']:>3} {part:>19} {p['ratio']:>9.3f} "
                f"{lo:>6.3f}..{hi:<6.3f} {p['us']:>9.1f} {p['base_us']:>9.1f}"
            )
    default = pathlib.Path(__file__).parent / "results" / f"allocator_ab_{args.device}.json"
    out = pathlib.Path(args.out) if args.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {**environment(args.device), "vs": str(base), "rounds": args.rounds, "rows": rows}
    out.write_text(json.dumps(record, indent=2))
    print(f"saved {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default=None, help="force 'triton' or 'torch' table ops")
    parser.add_argument(
        "--out", default=None, help="JSON path (default results/allocator_<device>.json)"
    )
    parser.add_argument("--vs", default=None, help="A/B: a checkout of the base commit")
    parser.add_argument("--rounds", type=int, default=6, help="A/B rounds (with --vs)")
    args = parser.parse_args()
    if args.vs:
        alternate(args)
        return
    rows = []
    header = (
        f"{'B':>4} {'ps':>3} "
        + " ".join(f"{p:>19}" for p in PARTS)
        + f" {'us/step':>9} {'us/req':>7}"
    )
    print(header)
    for ps in map(int, args.page_sizes.split(",")):
        for batch in map(int, args.batches.split(",")):
            seed = args.seed + 1000 * ps + batch
            row = run(batch, ps, args.steps, args.device, seed, args.backend)
            rows.append(row)
            cells = " ".join(f"{row['us'][p]:>19.1f}" for p in PARTS)
            print(
                f"{batch:>4} {ps:>3} {cells} {row['us_per_step']:>9.1f} {row['us_per_request']:>7.2f}"
            )
            ops = " ".join(f"{row['device_ops'][p]:>19.1f}" for p in PARTS)
            print(f"{'ops':>8} {ops} {sum(row['device_ops'].values()):>9.1f}")
            fused = row["decode_step"]
            print(
                f"{'':>8} decode_step (all four parts, one call): {fused['us_per_step']:.1f} us/step "
                f"{fused['us_per_request']:.2f} us/req, {fused['device_ops']:.1f} device ops"
            )
            spread = lambda r: "/".join(f"{x:.0f}" for x in r)
            print(
                f"{'':>8} per-round medians, us/step: separate {spread(row['round_us_per_step'])}, "
                f"decode_step {spread(fused['round_us_per_step'])}"
            )
    b256 = [r for r in rows if r["batch"] == 256]
    verdict = {
        "separate_verbs": {
            "max_us_per_request_at_b256": max((r["us_per_request"] for r in b256), default=None),
            "max_us_per_step_at_b256": max((r["us_per_step"] for r in b256), default=None),
        },
        "decode_step": {
            "max_us_per_request_at_b256": max(
                (r["decode_step"]["us_per_request"] for r in b256), default=None
            ),
            "max_us_per_step_at_b256": max(
                (r["decode_step"]["us_per_step"] for r in b256), default=None
            ),
        },
        "targets": {"us_per_request": 2.0, "us_per_step_at_b256": 300.0},
    }
    print(json.dumps(verdict))
    default = pathlib.Path(__file__).parent / "results" / f"allocator_{args.device}.json"
    out = pathlib.Path(args.out) if args.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**environment(args.device), "rows": rows, **verdict}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
