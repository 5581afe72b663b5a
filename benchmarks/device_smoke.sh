#!/bin/bash
# One device call: the two-minute GPU smoke (tests/engine/test_gpu_smoke.py, `-m smoke`), then,
# optionally, the whole GPU suite with a wall-clock cap, one pytest process per file.
#
# Usage: bash benchmarks/device_smoke.sh [SUITE_S]
#   SUITE_S   seconds for the full GPU suite after the smoke (default 0: smoke only)
# Environment:
#   JOBS      test files run at once on the one GPU (default 3; the tiny models are
#             launch-bound, and every engine test sizes its own small pool)
#   FILE_S    cap of one file's process (default 300), TEST_S cap of one test (default 150)
#   SMOKE_S   cap of the smoke's process (default 180; 0 skips the smoke)
#   FILES     test files of the suite (default: every file with GPU tests, longest first)
# Carry .whl (fla-core etc.) to have it installed first, as the other device scripts do.
#
# What comes back under $OUT (at most 8 files): smoke.log (-rA: every test's outcome and
# every failure, written as it runs), smoke.xml (junit), smi.txt, and for the suite
# gpu_suite.log (each file's full -rA log, appended as the file finishes), gpu_summary.txt
# (one line per file, also printed as it finishes) and gpu_junit.tgz. A timeout never
# hides a failure: a file killed by its cap still has its log up to that point, and its
# summary line says "timed out".
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then  # fla-core, and the serve extra (tests/ imports it)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(ls .whl/serve/*.whl 2>/dev/null) || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/device_smoke_out}
mkdir -p "$OUT"
suite_s=${1:-0}
jobs_max=${JOBS:-3}
file_s=${FILE_S:-300}
test_s=${TEST_S:-150}
smoke_s=${SMOKE_S:-180}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/smi.txt"
# pytest-timeout is in the device image; without it, only the outer `timeout` caps a run
if python3 -c "import pytest_timeout" 2>/dev/null; then has_timeout=1; else has_timeout=0; fi
per_test() { [ "$has_timeout" = 1 ] && echo "--timeout=$1"; }

smoke_rc=0
if [ "$smoke_s" -gt 0 ]; then
  echo "=== smoke ($(date +%T))"
  start=$(date +%s)
  timeout "$smoke_s" python3 -m pytest -m smoke -x -q -rA $(per_test 100) -p no:cacheprovider \
    --junitxml="$OUT/smoke.xml" tests/engine/test_gpu_smoke.py 2>&1 | tee "$OUT/smoke.log"
  smoke_rc=${PIPESTATUS[0]}
  echo "=== smoke exit $smoke_rc in $(($(date +%s) - start)) s ($(date +%T))"
  [ "$smoke_rc" = 124 ] && echo "=== smoke TIMED OUT after ${smoke_s}s: see the last test in smoke.log"
fi
[ "$suite_s" -gt 0 ] || exit "$smoke_rc"

# -- the full GPU suite, one process per file --------------------------------------------
logs=/tmp/gpu_logs
rm -rf "$logs" && mkdir -p "$logs"
: >"$OUT/gpu_suite.log"
: >"$OUT/gpu_summary.txt"
first=(test_engine_gpu test_engine_deepseek_gpu test_engine_hybrid_gpu test_engine_gemma_gpu
  test_engine_mimo_gpu test_kernels_mla_decode test_kernels_mla_gpu test_kernels_gpu
  test_kernels_recurrent_gpu)  # longest first, so the cap cuts the short ones last
files=(${FILES:-})
[ -n "${FILES:-}" ] && first=()
for name in "${first[@]}"; do [ -f "tests/$name.py" ] && files+=("tests/$name.py"); done
for f in $([ -n "${FILES:-}" ] || grep -l "mark.gpu" tests/test_*.py | sort); do
  [ "$f" = tests/engine/test_gpu_smoke.py ] && continue
  case " ${files[*]} " in *" $f "*) ;; *) files+=("$f") ;; esac
done

run_file() {  # run_file FILE CAP_S: one pytest process, then its log and one summary line
  local f=$1 cap=$2 name t0 rc line
  name=$(basename "$f" .py)
  t0=$(date +%s)
  timeout "$cap" python3 -m pytest -m gpu -q -rA $(per_test "$test_s") -p no:cacheprovider \
    --junitxml="$logs/$name.xml" "$f" >"$logs/$name.log" 2>&1
  rc=$?
  line=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)" "$logs/$name.log" | tail -1)
  [ "$rc" = 124 ] && line="TIMED OUT after ${cap}s; last: $(tail -1 "$logs/$name.log")"
  line="[$(date +%T)] $f rc=$rc $(($(date +%s) - t0))s: ${line:-no summary (see log)}"
  (
    flock 9 2>/dev/null
    echo "$line" | tee -a "$OUT/gpu_summary.txt"
    grep -E "^(FAILED|ERROR) " "$logs/$name.log" | sed 's/^/    /' | tee -a "$OUT/gpu_summary.txt"
    { echo "===== $f (rc=$rc)"; cat "$logs/$name.log"; } >>"$OUT/gpu_suite.log"
    tar czf "$OUT/gpu_junit.tgz" -C "$logs" $(cd "$logs" && ls ./*.xml 2>/dev/null) 2>/dev/null
  ) 9>"$logs/.lock"
  return "$rc"
}

echo "=== GPU suite: ${#files[@]} files, $jobs_max at a time, cap ${suite_s}s ($(date +%T))"
deadline=$(($(date +%s) + suite_s))
pids=()
for f in "${files[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  left=$((deadline - $(date +%s)))
  if [ "$left" -le 20 ]; then
    echo "[$(date +%T)] $f NOT RUN: the suite's cap was reached" | tee -a "$OUT/gpu_summary.txt"
    continue
  fi
  run_file "$f" $((left < file_s ? left : file_s)) &
  pids+=($!)
done
suite_rc=0
for pid in "${pids[@]}"; do wait "$pid" || suite_rc=1; done
echo "=== GPU suite done ($(date +%T)); failed files: $(grep -c ' rc=[^0]' "$OUT/gpu_summary.txt")"
[ "$smoke_rc" = 0 ] && exit "$suite_rc"
exit "$smoke_rc"
