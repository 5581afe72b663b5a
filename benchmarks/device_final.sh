#!/bin/bash
# One device call over what a session changed last (2026-12-01, fourth session): the GPU
# tests of the prefix cache / host tier / swap and the smoke, the MLA decode tests of the
# newly installed tiles, the allocator bench at HEAD and at BEFORE_COMMIT in the same run
# (after, before, after; each tree on its own PYTHONPATH), bench_prefix, and the wide MiMo.
# Run from a snapshot holding .whl/ and before/ (see device_before_after.sh):
#   UNIKV_GIT_COMMIT=<sha> BEFORE_COMMIT=<sha> bash benchmarks/device_final.sh
# Back under $OUT: results.tgz (every log and JSON), summary.txt.
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/final_res /tmp/final_out
after=$PWD before=$PWD/before
pt="python3 -m pytest -m gpu -q -rA -p no:cacheprovider --timeout=120"
step tests 150 $pt -x tests/test_prefix_gpu.py tests/test_gpu_smoke.py
step mla_tests 60 $pt tests/test_kernels_mla_decode.py -k n64
for run in after1 before after2; do
  tree=$after commit=$UNIKV_GIT_COMMIT
  [ "$run" = before ] && tree=$before commit=$BEFORE_COMMIT
  UNIKV_GIT_COMMIT=$commit TREE=$tree step alloc_$run 60 python3 benchmarks/bench_allocator.py \
    --device cuda --out $R/alloc_$run.json
done
step prefix 170 python3 benchmarks/bench_prefix.py --device cuda --out $R/prefix.json
step mimo_wide 150 $pt --durations=10 tests/test_engine_mimo_gpu.py -k wide
device_finish
