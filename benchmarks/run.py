"""The one benchmark driver: named suites over the ``bench_*.py`` scripts.

    python -m benchmarks --list
    python -m benchmarks SUITE [SUITE ...] [--device] [--quick] [--results DIR]
    python benchmarks/run.py SUITE ...

A suite is a list of scripts (registered by file name, so a script that is not in
this tree yet is reported as missing and skipped) with their arguments. Each script
runs in its own process with this tree first on ``PYTHONPATH``; its JSON goes to
``DIR/<suite>/<script>_<UTC stamp>.json`` (``DIR`` defaults to
``benchmarks/results``), and after the run DIR's LATEST is regenerated
(``benchmarks/results/LATEST.md`` by default): one
table per suite from the newest JSON of each script, with file, commit, device and
the headline scalar fields.

``--device`` runs on the GPU (``--device cuda`` to the scripts that take it);
``--quick`` runs tiny models on the CPU where a script supports ``--tiny`` or
``--quick`` (or has quick arguments of its own here) and skips the others.
The ``device`` suite is the GPU test suite (``benchmarks/device_suite.sh``) and
``smoke`` the two-minute GPU smoke (``benchmarks/device_smoke.sh``); both are for
the device machine and write under ``$OUT``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
LATEST = Path("LATEST").with_suffix(".md").name  # the table file in the results folder


@dataclass(frozen=True)
class Bench:
    """One script of a suite. ``args`` always; ``quick`` instead of the script's own
    ``--tiny``/``--quick`` under ``--quick``; ``legacy`` is the glob of its
    results written before the driver (in ``results/``), so benchmarks/results/LATEST.md
    still shows them until the suite is run again."""

    script: str
    args: tuple[str, ...] = ()
    quick: tuple[str, ...] | None = None
    legacy: str | None = None

    @property
    def stem(self) -> str:
        return Path(self.script).stem


B = Bench
SUITES: dict[str, tuple[Bench, ...]] = {
    "kernels": (
        B("bench_kernels.py", legacy="kernels_*.json"),
        B("bench_decode_ops.py", legacy="decode_ops_*.json"),
        B("bench_gemv.py", legacy="gemv_*.json"),
        B("bench_extend_hopper.py", legacy="extend_hopper_*.json"),
        B("bench_extend_long.py", legacy="extend_long_*.json"),
        B("bench_extend_sdpa_lengths.py", legacy="extend_sdpa_lengths_*.json"),
        B("bench_fp8_gemm.py", legacy="fp8_gemm_*.json"),
    ),
    "e2e": (
        B("bench_e2e.py", legacy="e2e_*.json"),
        B("bench_breakdown.py", legacy="breakdown_*.json"),
        B("bench_families.py", legacy="families_*.json"),
        B("bench_host_overhead.py", legacy="host_overhead_*.json"),
    ),
    "allocator": (
        B(
            "bench_allocator.py",
            quick=("--device", "cpu", "--batches", "1,8", "--page-sizes", "16", "--steps", "10"),
            legacy="allocator_*.json",
        ),
    ),
    "io": (
        B("bench_io.py", legacy="io_*.json"),
        B("bench_pd_transfer.py", legacy="pd_transfer_*.json"),
    ),
    "serving": (
        B("bench_serving.py", legacy="serving_h*.json"),
        B("bench_serving_overhead.py", legacy="serving_overhead_*.json"),
        B("bench_detokenize.py", legacy="detokenize_*.json"),
    ),
    "capacity": (
        B("bench_capacity.py", args=("--no-plots",), legacy="capacity.json"),
        B("bench_capacity_real.py", legacy="capacity_real_*.json"),
        B("bench_hybrid.py", legacy="hybrid_*.json"),
    ),
    "moe": (
        B("bench_moe.py", legacy="moe_h[0-9]*.json"),
        B("bench_moe_hopper.py", legacy="moe_hopper_*.json"),
    ),
    "mla": (
        B("bench_mla.py", legacy="mla_h*.json"),
        B("bench_mla_decode.py", legacy="mla_decode_*.json"),
        B("bench_mla_prefill.py", legacy="mla_prefill_*.json"),
    ),
    "recurrent": (B("bench_recurrent.py", legacy="recurrent_*.json"),),
    "prefix": (
        B("bench_prefix.py", legacy="prefix_h*.json"),
        B("bench_prefix_sim.py", legacy="prefix_sim_*.json"),
    ),
    "spec": (B("bench_spec.py", legacy="spec_*.json"),),
    "elastic": (B("bench_elastic.py", legacy="elastic_*.json"),),
}
SHELL_SUITES = {"device": "device_suite.sh", "smoke": "device_smoke.sh"}
ENV_KEYS = {"gpu", "device", "torch", "triton", "python", "date", "git_commit", "commit"}
ENV_KEYS |= {"env", "environment", "transformers", "machine", "tokenizers", "benchmark"}


def flags(script: Path) -> set[str]:
    """The ``--flags`` a script's argument parser declares (read from its source)."""
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9_-]+)\"", script.read_text()))


def command(bench: Bench, out: Path, device: bool, quick: bool) -> list[str] | None:
    """The script's command line, or None when ``--quick`` has nothing quick to run."""
    path = HERE / bench.script
    have = flags(path)
    cmd = [sys.executable, str(path), *bench.args]
    if quick:
        if bench.quick is not None:
            cmd += bench.quick
        elif "--tiny" in have or "--quick" in have:
            cmd.append("--tiny" if "--tiny" in have else "--quick")
            if "--device" in have:
                cmd += ["--device", "cpu"]
        else:
            return None
    elif device and "--device" in have:
        cmd += ["--device", "cuda"]
    if "--out" in have:
        cmd += ["--out", str(out)]
    return cmd


def run_suite(name: str, results: Path, device: bool, quick: bool) -> int:
    """Runs one suite's scripts in turn; the number that failed."""
    if name in SHELL_SUITES:
        rc = subprocess.run(
            ["bash", str(HERE / SHELL_SUITES[name])], cwd=ROOT, check=False
        ).returncode
        print(f"[{name}] {SHELL_SUITES[name]}: rc {rc}")
        return int(rc != 0)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    failed = 0
    for bench in SUITES[name]:
        if not (HERE / bench.script).exists():
            print(f"[{name}] {bench.script}: not in this tree, skipped")
            continue
        out = results / name / f"{bench.stem}_{stamp}.json"
        cmd = command(bench, out, device, quick)
        if cmd is None:
            print(f"[{name}] {bench.script}: no --tiny/--quick mode, skipped under --quick")
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode
        if rc != 0 or not out.exists():
            print(f"[{name}] {bench.script}: rc {rc}, {'no JSON' if not out.exists() else ''}")
            failed += 1
    return failed


def headline(payload: dict, limit: int = 8) -> str:
    """The first ``limit`` scalar fields (numbers, booleans, short strings), nested
    dicts flattened one level as ``outer.inner``; the environment fields left out."""
    cells = []
    for key, value in payload.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            if key in ENV_KEYS or sub in ENV_KEYS or isinstance(v, (dict, list)):
                continue
            if isinstance(v, str) and len(v) > 24:
                continue
            v = f"{v:.4g}" if isinstance(v, float) else v
            cells.append(f"{key}.{sub}={v}" if sub is not None else f"{key}={v}")
            if len(cells) == limit:
                return "; ".join(cells)
    return "; ".join(cells)


def newest(bench: Bench, suite: str, results: Path) -> Path | None:
    """The newest JSON of a script: the driver's own runs first (their names sort by
    time), else its results from before the driver (newest by their ``date``)."""
    runs = sorted((results / suite).glob(f"{bench.stem}_*.json"))
    if runs:
        return runs[-1]
    if bench.legacy is None:
        return None
    old = [p for p in results.glob(bench.legacy)]
    return max(old, key=lambda p: (str(_env(_load(p)).get("date", "")), p.name), default=None)


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {"entries": len(data)}


def _env(data: dict) -> dict:
    """The run's environment fields, at the top level or under ``env``/``environment``."""
    nested = [data.get(k) for k in ("env", "environment")]
    return {**data, **{k: v for d in nested if isinstance(d, dict) for k, v in d.items()}}


def latest_md(results: Path) -> str:
    """The text of benchmarks/results/LATEST.md: one table per suite, a row per script with a result."""
    lines = [
        "# Latest benchmark results",
        "",
        "Regenerated by `python -m benchmarks SUITE` (benchmarks/run.py): for each suite, the",
        "newest JSON of each script under this folder. Older results are in git history",
        "(docs/history.md says how to read them).",
    ]
    for suite, benches in SUITES.items():
        rows = []
        for bench in benches:
            path = newest(bench, suite, results)
            if path is None:
                continue
            data = _load(path)
            env = _env(data)
            commit = str(env.get("git_commit", env.get("commit", "?")))[:7]
            device = env.get("gpu", env.get("device", "?"))
            rel = path.relative_to(results).as_posix()
            rows.append(f"| {bench.script} | {rel} | {commit} | {device} | {headline(data)} |")
        lines += ["", f"## {suite}", ""]
        if rows:
            lines += ["| script | file | commit | device | headline |", "|---|---|---|---|---|"]
            lines += rows
        else:
            lines.append("No result yet.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    names = [*SUITES, *SHELL_SUITES]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="*", help=f"one or more of: {', '.join(names)}")
    parser.add_argument("--list", action="store_true", help="list the suites and their scripts")
    parser.add_argument("--device", action="store_true", help="run on the GPU (--device cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny models on the CPU")
    parser.add_argument("--results", default=str(RESULTS), help="results folder")
    args = parser.parse_args(argv)
    if args.list:
        for name, benches in SUITES.items():
            print(f"{name}: {' '.join(b.script for b in benches)}")
        for name, script in SHELL_SUITES.items():
            print(f"{name}: {script} (device machine)")
        return 0
    unknown = [s for s in args.suites if s not in names]
    if unknown or not args.suites:
        parser.error(
            f"expected one or more suites of {', '.join(names)}; got {args.suites or 'none'}"
            + (f" ({', '.join(unknown)} unknown)" if unknown else "")
            + "; see --list"
        )
    if args.device and args.quick:
        parser.error("--device and --quick exclude each other: pick the GPU or the tiny CPU run")
    results = Path(args.results)
    failed = sum(run_suite(s, results, args.device, args.quick) for s in args.suites)
    (results / LATEST).write_text(latest_md(results))
    print(f"wrote {results / LATEST}; {failed} script(s) failed")
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
