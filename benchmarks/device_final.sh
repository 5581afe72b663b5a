#!/bin/bash
# One device call over what a session changed last (2026-12-01, fourth session): the GPU
# tests of the prefix cache / host tier / swap and the smoke, the MLA decode tests of the
# newly installed tiles, the allocator bench at HEAD and at BEFORE_COMMIT in the same run
# (after, before, after; each tree on its own PYTHONPATH), bench_prefix, and the wide MiMo.
# Run from a snapshot holding .whl/ and before/ (see device_before_after.sh):
#   UNIKV_GIT_COMMIT=<sha> BEFORE_COMMIT=<sha> bash benchmarks/device_final.sh
# Back under $OUT: results.tgz (every log and JSON), summary.txt.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
FINAL=${OUT:-/tmp/final_out}; R=/tmp/final_res; mkdir -p "$FINAL" $R/logs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl .whl/serve/*.whl >$R/logs/pip.log 2>&1
END=$(($(date +%s) + ${BUDGET:-560}))
step() {  # step NAME CAP TREE CMD...: run CMD in TREE (its own package first on PYTHONPATH)
  local name=$1 cap=$2 tree=$3; shift 3
  local left=$((END - $(date +%s)))
  if [ "$left" -lt 20 ]; then echo "[$(date +%T)] $name SKIPPED (deadline)" | tee -a $R/summary.txt; return; fi
  [ "$cap" -gt "$left" ] && cap=$left
  local t=$(date +%s)
  (cd "$tree" && OUT=$R PYTHONPATH=$tree:/tmp/site timeout "$cap" "$@") >$R/logs/$name.log 2>&1
  local rc=$?
  echo "[$(date +%T)] $name rc=$rc $(($(date +%s) - t))s (cap $cap)$([ $rc = 124 ] && echo ' TIMED OUT')" | tee -a $R/summary.txt
  tar czf "$FINAL/results.tgz" -C $R . 2>/dev/null
}
after=$PWD before=$PWD/before
pt="python3 -m pytest -m gpu -q -rA -p no:cacheprovider --timeout=120"
step tests 150 $after $pt -x tests/test_prefix_gpu.py tests/test_gpu_smoke.py
step mla_tests 60 $after $pt tests/test_kernels_mla_decode.py -k n64
for run in after1 before after2; do
  tree=$after commit=$UNIKV_GIT_COMMIT
  [ "$run" = before ] && tree=$before commit=$BEFORE_COMMIT
  UNIKV_GIT_COMMIT=$commit step alloc_$run 60 $tree python3 benchmarks/bench_allocator.py \
    --device cuda --out $R/alloc_$run.json
done
step prefix 170 $after python3 benchmarks/bench_prefix.py --device cuda --out $R/prefix.json
step mimo_wide 150 $after $pt --durations=10 tests/test_engine_mimo_gpu.py -k wide
cp $R/summary.txt "$FINAL/summary.txt"
tar czf "$FINAL/results.tgz" -C $R .
cat $R/summary.txt
