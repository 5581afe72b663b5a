#!/bin/bash
# One device call: bench_allocator and bench_e2e --quick (unikv path) at two commits in the
# same run, for "performance must not regress" (issue 16). Run from a tree that holds both:
#   git archive HEAD | tar -x -C .snap; mkdir .snap/before; git archive <BEFORE> | tar -x -C .snap/before
#   run: cd .snap && UNIKV_GIT_COMMIT=<after> BEFORE_COMMIT=<before> bash benchmarks/device_before_after.sh
# Each side imports its OWN tree: PYTHONPATH names the tree first (a shared PYTHONPATH=$PWD
# made the 'before' side import HEAD's package on 2026-12-01; the allocator bench then failed
# and the e2e 'before' was HEAD's code).
# Order after, before, after: the spread of the two 'after' runs is the run-to-run noise.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/before_after_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
fi
after=$PWD before=$PWD/before
side() {  # side NAME TREE COMMIT CAP_S ARGS...
  local name=$1 tree=$2 commit=$3 cap=$4; shift 4
  (cd "$tree" && PYTHONPATH=$tree:/tmp/site UNIKV_GIT_COMMIT=$commit timeout "$cap" \
    python3 "$@") >"$OUT/$name.log" 2>&1
  echo "[$(date +%T)] $name rc=$?" | tee -a "$OUT/summary.txt"
}
for run in after1 before after2; do
  tree=$after commit=${UNIKV_GIT_COMMIT:-after}
  [ "$run" = before ] && tree=$before commit=${BEFORE_COMMIT:-before}
  side "alloc_$run" "$tree" "$commit" 90 benchmarks/bench_allocator.py --device cuda \
    --out "$OUT/alloc_$run.json"
done
for run in after before; do
  tree=$after commit=${UNIKV_GIT_COMMIT:-after}
  [ "$run" = before ] && tree=$before commit=${BEFORE_COMMIT:-before}
  side "e2e_$run" "$tree" "$commit" 150 benchmarks/bench_e2e.py --device cuda --quick \
    --paths unikv --out "$OUT/e2e_$run.json"
done
