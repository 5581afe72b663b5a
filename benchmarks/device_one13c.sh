#!/bin/bash
# The thirteenth session's closing call: one request's e2e, the pre-wait loads and the
# GEMV table each on and off, in the order on-on, off-off, on-off, off-on, twice (same
# lease); the breakdown at the defaults; the GPU tests of the pre-wait loads, rope
# inside decode, decode attention and the engine (fp32 token-exact, bf16 teacher-forced).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_one13c.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/one13c_res /tmp/one13c_out
for round in 1 2; do
  e2e_b1 p1t1_$round UNIKV_DECODE_PRELOAD=1
  e2e_b1 p0t0_$round UNIKV_DECODE_PRELOAD=0 UNIKV_GEMV_TABLE='{}'
  e2e_b1 p1t0_$round UNIKV_DECODE_PRELOAD=1 UNIKV_GEMV_TABLE='{}'
  e2e_b1 p0t1_$round UNIKV_DECODE_PRELOAD=0
done
breakdown_b1
step kernel_tests 120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_decode_preload_gpu.py tests/test_kernels_rope_decode.py \
  tests/test_kernels_gpu.py -k "preload or rope or decode"
step engine_tests 240 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_engine_gpu.py
device_finish
