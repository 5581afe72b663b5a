"""Host time per decode step of the engine loop, by phase.

A tiny random-init Llama (bench_e2e's ``--tiny`` shape: the forward costs little)
runs B requests of 16-token prompts through ``LLM.generate``; every engine-loop
step is timed on the host (time.perf_counter) and split into phases, each the
time spent in its functions minus the phases nested inside it:

    schedule     Scheduler.schedule (decode_step excluded)
    decode_step  PoolAllocator.decode_step (allocation, frees, tables, ids)
    plan         StepPlanner.plan (host arrays, one upload, decode plans)
    forward      ModelRunner.forward, or DecodeGraphs.replay (CUDA graphs)
    sample       ModelRunner.sample (argmax, or sample_requests)
    readback     the tokens' device-to-host copy and its event
    wait         Launched.tokens / logprobs waiting for the step's event
    complete     Scheduler.complete_ahead (placeholders for the step in flight)
    settle       EngineLoop._settle (resolve; deltas and detokenisation of
                 watched requests: none here, generate reads text at the end)
    other        the rest of EngineLoop.step

Only full-batch decode steps count (B requests, one token each). On CPU the
forward is the model itself (device work on the host); every other phase is
host time. JSON to benchmarks/results/host_overhead_<device>.json.

    python benchmarks/bench_host_overhead.py [--device cpu|cuda] [--batches 1,64,256]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_e2e as e2e

PHASES = (
    "schedule",
    "decode_step",
    "plan",
    "forward",
    "sample",
    "readback",
    "wait",
    "complete",
    "settle",
    "other",
)


class PhaseClock:
    """Exclusive host time per phase of each step: ``wrap`` replaces a bound
    method by a timed one; nested phases are subtracted from their parent."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # per open phase: time of its nested phases

    def wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                inner = self._stack.pop()
                self.current[phase] += spent - inner
                if self._stack:
                    self._stack[-1] += spent

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        step, self.current = dict(self.current), defaultdict(float)
        return step


def instrument(llm, clock: PhaseClock, steps: list) -> list:
    """Time the phases of ``llm``'s engine loop; one record per step into ``steps``
    (its batch size, whether it was a decode step, wall s, s per phase). Returns
    the class attributes to restore (cls, name, original)."""
    loop, runner, sched = llm.engine, llm.runner, llm.scheduler
    seen = {}
    schedule = sched.schedule

    def schedule_and_note():
        batch = schedule()
        seen["batch"] = batch
        return batch

    sched.schedule = schedule_and_note
    clock.wrap(sched, "schedule", "schedule")
    clock.wrap(llm.alloc, "decode_step", "decode_step")
    clock.wrap(runner.planner, "plan", "plan")
    clock.wrap(runner, "forward", "forward")
    if runner.graphs is not None:
        clock.wrap(runner.graphs, "replay", "forward")
    clock.wrap(runner, "sample", "sample")
    clock.wrap(runner, "_readback", "readback")
    clock.wrap(sched, "complete_ahead", "complete")
    clock.wrap(loop, "_settle", "settle")
    from unikv.engine.runner import Launched

    undo = [(Launched, name, getattr(Launched, name)) for name in ("tokens", "logprobs")]
    for name in ("tokens", "logprobs"):
        original = getattr(Launched, name)

        def timed(self, _original=original):
            clock._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return _original(self)
            finally:
                spent = time.perf_counter() - t0
                clock._stack.pop()
                clock.current["wait"] += spent
                if clock._stack:
                    clock._stack[-1] += spent

        setattr(Launched, name, timed)
    step = loop.step

    def timed_step():
        clock._stack.append(0.0)
        t0 = time.perf_counter()
        result = step()
        spent = time.perf_counter() - t0
        inner = clock._stack.pop()
        record = clock.take()
        record["other"] = spent - inner
        batch = seen.pop("batch", None)
        if result is not None and batch is not None:
            steps.append((len(batch.requests), batch.is_decode, spent, record))
        return result

    loop.step = timed_step
    return undo


def measure(path: pathlib.Path, batch: int, new_tokens: int, device: str, args) -> dict:
    from unikv.engine import SamplingParams

    cfg = e2e.model_config("llama", True)
    prompts = e2e.make_prompts(batch, 16, cfg["vocab_size"], seed=batch)
    llm = e2e._unikv_llm(path, batch, 16 + new_tokens + 8, args)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))  # warm up
    clock, steps = PhaseClock(), []
    undo = instrument(llm, clock, steps)
    try:
        llm.generate(prompts, params)
    finally:
        for cls, name, original in undo:
            setattr(cls, name, original)
    full = [(wall, rec) for b, dec, wall, rec in steps if dec and b == batch]
    med = {p: float(np.median([rec.get(p, 0.0) for _, rec in full])) * 1e6 for p in PHASES}
    walls = [wall for wall, _ in full]
    host = {p: v for p, v in med.items() if p not in ("forward", "wait")}
    return {
        "batch": batch,
        "decode_steps": len(full),
        "us": med,
        "host_us_excluding_forward_and_wait": sum(host.values()),
        "step_wall_us": float(np.median(walls)) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if cli.device == "cpu":
        torch.set_num_threads(1)  # the host's cost, not the CPU forward's threading
    args = argparse.Namespace(
        device=cli.device,
        dtype=torch.float32 if cli.device == "cpu" else torch.bfloat16,
        page_size=cli.page_size,
        chunk=4096,
        no_graphs=cli.no_graphs,
    )
    rows = []
    print(f"{'B':>4} " + " ".join(f"{p:>11}" for p in PHASES) + f" {'host':>8} {'wall':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "llama"
        e2e.save_model("llama", path, cli.device, args.dtype, True)
        for batch in map(int, cli.batches.split(",")):
            row = measure(path, batch, cli.new_tokens, cli.device, args)
            rows.append(row)
            cells = " ".join(f"{row['us'][p]:>11.1f}" for p in PHASES)
            host, wall = row["host_us_excluding_forward_and_wait"], row["step_wall_us"]
            print(f"{batch:>4} {cells} {host:>8.1f} {wall:>8.1f}")
    from common import environment

    out = (
        pathlib.Path(cli.out)
        if cli.out
        else (pathlib.Path(__file__).parent / "results" / f"host_overhead_{cli.device}.json")
    )
    record = {
        **environment(),
        "device": torch.cuda.get_device_name() if cli.device == "cuda" else "cpu",
        "model": "llama tiny (bench_e2e --tiny)",
        "page_size": cli.page_size,
        "cuda_graphs": cli.device == "cuda" and not cli.no_graphs,
        "phases_us_median_per_full_decode_step": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
