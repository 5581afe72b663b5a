#!/bin/bash
# The fifteenth session's second part: one fresh prompt's attention through SDPA
# (kernels/extend_sdpa.py). The GPU tests of the fresh paths; bench_extend_long (the
# Triton tiles, SDPA flash / default, and the engine's op); the engine's bf16 GPU tests
# (one request's prefill takes SDPA); one request's e2e twice at the defaults.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_ext15.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/ext15_res /tmp/ext15_out
step fresh_tests 120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "fresh"
step extend_long 150 python3 benchmarks/bench_extend_long.py --out $R/extend_long.json
grep SUMMARY "$R/logs/extend_long.log" | tee -a "$R/summary.txt"
step engine_bf16 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_engine_gpu.py \
  -k "bf16 or mixed"
e2e_b1 def_1
e2e_b1 def_2
itl_summary
device_finish
