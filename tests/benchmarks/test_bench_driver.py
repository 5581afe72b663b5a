"""The benchmark driver (benchmarks/run.py): --list names every suite and script, and a
--quick allocator run writes its JSON and regenerates benchmarks/results/LATEST.md (here in a
temporary folder) with that suite's table,
read back against the JSON the script wrote."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import run

ROOT = Path(__file__).resolve().parents[2]


def _driver(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_list_names_every_suite_and_script():
    proc = _driver("--list")
    assert proc.returncode == 0, proc.stderr
    listed = dict(line.split(": ", 1) for line in proc.stdout.strip().splitlines())
    wanted = {"kernels", "e2e", "allocator", "io", "serving", "capacity", "moe", "mla"}
    wanted |= {"recurrent", "prefix", "spec", "elastic", "device"}
    assert wanted <= set(listed)
    assert "bench_breakdown.py" in listed["e2e"] and "bench_families.py" in listed["e2e"]
    assert listed["device"].startswith("device_suite.sh")
    for benches in run.SUITES.values():  # every registered script that exists is listed
        for bench in benches:
            assert bench.script in " ".join(listed.values())
    on_disk = {p.name for p in (ROOT / "benchmarks").glob("bench_*.py")}
    registered = {b.script for benches in run.SUITES.values() for b in benches}
    assert on_disk <= registered, f"bench scripts in no suite: {sorted(on_disk - registered)}"


def test_unknown_suite_is_refused_with_the_choices():
    proc = _driver("no-such-suite")
    assert proc.returncode == 2
    assert "no-such-suite" in proc.stderr and "allocator" in proc.stderr


def test_quick_allocator_writes_json_and_latest(tmp_path):
    latest = tmp_path / run.LATEST
    latest.write_text("stale\n")
    proc = _driver("allocator", "--quick", "--results", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    written = sorted((tmp_path / "allocator").glob("bench_allocator_*.json"))
    assert len(written) == 1
    data = json.loads(written[0].read_text())
    assert data["device"] == "cpu" and {r["batch"] for r in data["rows"]} == {1, 8}
    text = latest.read_text()
    assert "stale" not in text
    section = text.split("## allocator\n", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith("| bench_allocator.py"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"allocator/{written[0].name}"
    assert cells[2] == str(data["git_commit"])[:7] and cells[3] == "cpu"
    want = data["separate_verbs"]["max_us_per_request_at_b256"]  # None: no B=256 in --quick
    assert f"separate_verbs.max_us_per_request_at_b256={want}" in cells[4]
    assert "## kernels" in text  # every suite gets its section
