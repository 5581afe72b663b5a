#!/bin/bash
# One device call over the measurements still pending (see the README's "What is not done"),
# each step capped, skipped when the call's deadline is near, its log and JSON kept.
#
# Usage (from a `git archive` snapshot carrying .whl/, .whl/serve/, .whl/fi/):
#   UNIKV_GIT_COMMIT=<sha> BUDGET=560 bash benchmarks/device_pending.sh STEP[,STEP...]
# Steps (in the order given): tests, tests_b, breakdown, moe_sweep, mla_sweep, prefix,
# mla_prefill, e2e. TESTS / TESTS_B: the test files of each tests step (TEST_CAP, TEST_B_CAP
# seconds); MOE_BATCHES: the moe_sweep's B list (all buckets when empty).
# What comes back under $OUT: results.tgz (every JSON and log), summary.txt, and the tail of
# the tests' log. A step killed by its cap still leaves its log; the summary line says so.
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/pending_res /tmp/pending_out
# -x stops at the first failure so its report is written before any cap can kill the run
# the GPU tests of what changed after the last suite run: the host path under CUDA graphs
# (smoke, engine), the MoE rewrite, the fused MLA variants, the wide MiMo
TESTS=${TESTS:-"tests/test_gpu_smoke.py tests/test_kernels_moe.py tests/test_kernels_mla_decode.py tests/test_engine_gpu.py tests/test_engine_mimo_gpu.py"}
for s in ${1//,/ }; do
  case $s in
    tests) step tests ${TEST_CAP:-330} python3 -m pytest -m gpu -x -q -rA -p no:cacheprovider --timeout=120 $TESTS ;;
    tests_b) step tests_b ${TEST_B_CAP:-200} python3 -m pytest -m gpu -q -rA -p no:cacheprovider --timeout=150 --durations=15 $TESTS_B ;;
    breakdown) step breakdown 90 python3 benchmarks/bench_breakdown.py --device cuda --out $R/breakdown.json ;;
    moe_sweep) step moe_sweep 120 python3 benchmarks/bench_moe.py --sweep --batches "${MOE_BATCHES:-}" ;;
    mla_sweep) step mla_sweep 130 python3 benchmarks/bench_mla_decode.py --sweep --budget 100 --out $R/mla_sweep.json ;;
    prefix) step prefix 160 python3 benchmarks/bench_prefix.py --device cuda --out $R/prefix.json ;;
    mla_prefill) step mla_prefill 90 python3 benchmarks/bench_mla_prefill.py --out $R/mla_prefill.json ;;
    e2e) step e2e 150 python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv,hf_dynamic,hf_static --out $R/e2e.json ;;
    *) echo "unknown step $s" | tee -a $R/summary.txt ;;
  esac
done
tail -80 $R/logs/tests.log $R/logs/tests_b.log > "$FINAL/tests_tail.txt" 2>/dev/null
device_finish
