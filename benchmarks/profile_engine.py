"""Where the engine's host time goes: cProfile over decode-heavy ``LLM.generate``.

Builds bench_e2e's random-init model (Llama-3.2-1B shape by default), runs one
warm-up generate, then profiles ``--requests`` x 512-token prompts x
``--new-tokens`` and prints the 35 most expensive functions by own time and by
cumulative time, with the full-batch decode step time (median) for scale and
the device time of the largest decode CUDA graph replayed alone.

    python benchmarks/profile_engine.py [--model llama] [--requests 256] [--new-tokens 64]

``--timeline`` replaces cProfile (which inflates host time several-fold) by CUDA
events around every ``runner.launch``: per step kind (prefill / decode), the host
time of the launch, the device span of its work, and the device's idle gap before
it (the previous step's end event to this one's start: the host was late), so
the question "is the eager prefill step host-bound?" gets a direct answer.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_e2e as e2e
from common import GcWatch, JitWatch, allocator_counts


def graph_replay_ms(llm, reps: int = 30) -> float:
    """Median device time (CUDA events) of replaying the largest decode graph: the
    forward of a full decode step without the host in the way (its buffers hold
    the last step's inputs)."""
    graph = llm.runner.graphs.graphs[llm.runner.graphs.sizes[-1], False][0]
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


class Timeline:
    """Wraps ``llm.runner.launch``: CUDA events before and after each step's
    enqueue, the host time of the enqueue, the step's kind and token count."""

    def __init__(self, llm, layers: bool = False) -> None:
        self.llm, self.inner, self.rows = llm, llm.runner.launch, []
        self.watch = self.gc = None
        llm.runner.launch = self
        self.phases: dict[str, float] = {}  # host ms inside this launch, by phase
        self.step_phases: list[dict] = []
        self.layer_ms: list[float] = []  # host ms of each module call in this launch
        self.step_layers: list[list[float]] = []
        self.hooks = []
        if layers:  # eager forwards only (a graph replay calls no module)
            model = llm.model
            mods = [model.model.embed_tokens, *model.model.layers, model.lm_head]
            for mod in mods:
                self.hooks.append(mod.register_forward_pre_hook(self._enter))
                self.hooks.append(mod.register_forward_hook(self._leave))
        runner = llm.runner
        self.wrapped = ((runner.planner, "plan"), (runner, "forward"), (runner, "sample"),
                        (runner, "_readback"))  # fmt: skip
        for obj, name in self.wrapped:
            setattr(obj, name, self._timed(getattr(obj, name), name.strip("_")))

    def _enter(self, _mod, _args) -> None:
        self._t = time.perf_counter()

    def _leave(self, _mod, _args, _out) -> None:
        self.layer_ms.append(round((time.perf_counter() - self._t) * 1e3, 3))

    def _timed(self, fn, phase: str):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.phases[phase] = (time.perf_counter() - t) * 1e3

        return timed

    def __call__(self, batch, prev=None):
        if self.watch is not None:
            self.watch.tag = self.gc.tag = len(self.rows)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self.phases, self.layer_ms = {}, []
        t = time.perf_counter()
        launched = self.inner(batch, prev)
        host = time.perf_counter() - t
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.rows.append((t, host, start, end, batch.is_decode, sum(batch.num_new)))
        self.step_phases.append({k: round(v, 3) for k, v in self.phases.items()})
        self.step_layers.append(self.layer_ms)
        return launched

    def close(self) -> None:
        """Unwrap the launch and the phases (instance attributes over the methods)."""
        self.llm.runner.launch = self.inner
        for obj, name in self.wrapped:
            delattr(obj, name)
        for hook in self.hooks:
            hook.remove()

    def report(self) -> dict:
        """Per kind: steps, and medians / sums (ms) of the step's wall (launch to
        next launch), host enqueue, device span and the idle gap before it; each
        step's record in ``per_step``."""
        torch.cuda.synchronize()
        nan = float("nan")
        self.per_step = [
            {"decode": dec, "tokens": tokens,
             "wall_ms": (self.rows[i + 1][0] - t) * 1e3 if i + 1 < len(self.rows) else nan,
             "host_ms": host * 1e3, "span_ms": start.elapsed_time(end),
             "idle_before_ms": self.rows[i - 1][3].elapsed_time(start) if i else nan,
             "host_phases_ms": self.step_phases[i]}
            | ({"modules_host_ms": self.step_layers[i]} if self.step_layers[i] else {})
            for i, (t, host, start, end, dec, tokens) in enumerate(self.rows)
        ]  # fmt: skip
        out = {}
        for step in self.per_step:
            out.setdefault("decode" if step["decode"] else "prefill", []).append(step)
        return {
            name: {"steps": len(steps)}
            | {f"{k}_p50": float(np.nanmedian([s[f] for s in steps])) for k, f in KEYS}
            | {f"{k}_sum": float(np.nansum([s[f] for s in steps])) for k, f in KEYS[:-1]}
            for name, steps in out.items()
        }


# (the report's name, the per-step record's key); tokens last: a median, no sum
KEYS = (
    ("wall", "wall_ms"),
    ("host_launch", "host_ms"),
    ("device_span", "span_ms"),
    ("idle_before", "idle_before_ms"),
    ("tokens", "tokens"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny model, 32-token prompts")
    parser.add_argument("--timeline", action="store_true", help="CUDA events, not cProfile")
    parser.add_argument("--out", help="JSON of the timeline report")
    parser.add_argument(
        "--layers",
        action="store_true",
        help="timeline: host ms of each module call (embedding, layers, lm_head)",
    )
    parser.add_argument(
        "--no-warm-gemms",
        action="store_true",
        help="skip the engine's start-up GEMM warm-up (engine/warmup.py): the A/B",
    )
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="timeline: torch.cuda sync debug mode; each synchronising call's stack",
    )
    cli = parser.parse_args()
    tiny = ["--tiny"] if cli.tiny else []
    args = e2e.parse_args(["--device", cli.device, "--models", cli.model, *tiny])
    from unikv.engine import SamplingParams

    if cli.no_warm_gemms:
        import unikv.engine.build as llm_module  # build_engine warms the linears

        llm_module.warm_linears = lambda *a, **k: 0

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / cli.model
        e2e.save_model(cli.model, path, args.device, args.dtype, cli.tiny)
        cfg = e2e.model_config(cli.model, cli.tiny)
        prompts = e2e.make_prompts(cli.requests, args.prompt_len, cfg["vocab_size"])
        llm = e2e._unikv_llm(path, cli.requests, args.prompt_len + cli.new_tokens + 8, args)
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        llm.reset_prefix_cache()  # else the profiled run's prefills are all cache hits
        clock = e2e._StepClock()
        if cli.timeline:
            return run_timeline(llm, prompts, cli, SamplingParams)
        prof = cProfile.Profile()
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        prof.enable()
        llm.generate(
            prompts,
            SamplingParams(max_tokens=cli.new_tokens, ignore_eos=True, temperature=0.0),
            on_step=clock,
        )
        prof.disable()
        wall = time.perf_counter() - start
        full = [s for s, dec, b in clock.steps if dec and b == cli.requests]
        # the graph's buffers hold the last step's inputs: a full-batch decode only
        # (after a prefill-only run they hold a smaller step's lanes, out of range)
        replay = graph_replay_ms(llm) if llm.runner.graphs is not None and full else None
    p50 = f"{np.median(full) * 1e3:.2f} ms" if full else "- (none ran)"
    print(f"wall {wall:.2f} s under cProfile, {len(clock.steps)} steps, full-batch decode step "
          f"p50 {p50}")  # fmt: skip
    if replay is not None:
        print(f"GPU time of the largest decode graph's replay alone: {replay:.2f} ms (median)")
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(35)
    print(buf.getvalue())


class SyncWatch:
    """torch.cuda's sync debug mode ("warn") over a run: every synchronising call
    torch makes (``.item()``, a pageable copy, ``nonzero``...) is recorded with the
    step index and its Python stack, once per distinct stack."""

    def __init__(self, timeline) -> None:
        self.timeline, self.seen = timeline, {}

    def __enter__(self):
        self._show = warnings.showwarning
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        stack = "".join(traceback.format_stack(limit=14)[:-2])
        entry = self.seen.setdefault(stack, {"message": str(message)[:200], "steps": []})
        entry["steps"].append(len(self.timeline.rows))

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._show

    def summary(self) -> list[dict]:
        return [{"stack": k, **v} for k, v in self.seen.items()]


def run_timeline(llm, prompts, cli, params_type) -> None:
    timeline = Timeline(llm, layers=cli.layers)
    syncs = SyncWatch(timeline) if cli.sync_debug else contextlib.nullcontext()
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        alloc_before = allocator_counts()
        with JitWatch() as watch, GcWatch() as gcs, syncs:
            timeline.watch, timeline.gc = watch, gcs
            llm.generate(prompts, params_type(max_tokens=cli.new_tokens, ignore_eos=True))
        alloc = {k: v - alloc_before[k] for k, v in allocator_counts().items()}
    finally:
        timeline.close()
    wall = time.perf_counter() - start
    report = {"model": cli.model, "requests": cli.requests, "new_tokens": cli.new_tokens,
              "warm_gemms": not cli.no_warm_gemms,
              "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING")}  # fmt: skip
    report |= {"wall_s": wall} | timeline.report()
    report["jit_compiles_in_run"] = watch.summary()  # "at": the step index
    report["gc_in_run"] = gcs.summary()  # "max_at": the step index
    report["allocator_in_run"] = alloc
    if cli.sync_debug:
        report["syncs_in_run"] = syncs.summary()  # "steps": the step index of each call
    report["steps"] = timeline.per_step
    print(json.dumps(report, indent=1))
    if cli.out:
        Path(cli.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
