#!/bin/bash
# The fifteenth session's third call: one fresh prompt through SDPA with 4-D views
# (3fa3841's 3-D ones ran SDPA's math path): its GPU test (no softmax kernel, a fused
# one), bench_extend_long's fresh shapes (the engine's op, KV heads repeated and
# enable_gqa).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_ext15b.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/ext15b_res /tmp/ext15b_out
step sdpa_tests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "sdpa"
step extend_long 100 python3 benchmarks/bench_extend_long.py --shapes 1x0+16384,1x0+4096 \
  --budget-s 40 --out $R/extend_long.json
grep -E "SUMMARY|engine" "$R/logs/extend_long.log" | tee -a "$R/summary.txt"
device_finish
