#!/bin/bash
# The eighteenth session: the Hopper fresh-prompt attention in Gluon (warp-specialised,
# TMA + wgmma) against SDPA and the Triton fresh kernel, the long-prefill table at the
# defaults; then its GPU tests (the kernel, a long prompt through the engine).
#   UNIKV_GIT_COMMIT=<sha> [TESTS=1] [LONG=1] [MOE=1 BATCHES=..] [SHAPES=.. D64=..] bash benchmarks/device_s18.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/s18_res /tmp/s18_out
step extend_hopper ${CAP:-120} python3 benchmarks/bench_extend_hopper.py \
  --shapes ${SHAPES:-1x16384,1x4096,8x2048,4x1000} --d64 ${D64:-1x8192,16x512} \
  --out $R/extend_hopper.json
[ -n "$MOE" ] && step moe_hopper 150 python3 benchmarks/bench_moe_hopper.py --batches ${BATCHES:-64,256} \
  --out $R/moe_hopper.json
[ -n "$LONG" ] && step extend_long 150 python3 benchmarks/bench_extend_long.py --out $R/extend_long.json
[ -n "$TESTS" ] && step extend_tests 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_extend_hopper.py tests/test_engine_long_prefill_gpu.py
device_finish
