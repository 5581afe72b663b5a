#!/bin/bash
# The eleventh session's second call: one request's e2e with the GEMV's early weight
# tiles (UNIKV_GEMV_EARLY 0 / 1 / 2) and rope + store inside decode attention
# (UNIKV_ROPE_DECODE), all with PDL's triggers; the default's breakdown; the engine's
# GPU tests and the GPU kernel tests (the fused decode's fp32 and bf16 paths).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_fuse11.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/fuse11_res /tmp/fuse11_out
e2e_b1() {  # NAME ENV...: one request's e2e under the given switches
  local name=$1; shift
  step e2e_b1_$name 45 env "$@" python3 benchmarks/bench_e2e.py --device cuda \
    --models llama --paths unikv --requests 1 --out $R/e2e_b1_$name.json
}
e2e_b1 base UNIKV_GEMV_EARLY=0 UNIKV_ROPE_DECODE=0
e2e_b1 early1 UNIKV_GEMV_EARLY=1 UNIKV_ROPE_DECODE=0
e2e_b1 early2 UNIKV_GEMV_EARLY=2 UNIKV_ROPE_DECODE=0
e2e_b1 rope UNIKV_GEMV_EARLY=0 UNIKV_ROPE_DECODE=1
e2e_b1 both UNIKV_GEMV_EARLY=1 UNIKV_ROPE_DECODE=1
e2e_b1 both2 UNIKV_GEMV_EARLY=2 UNIKV_ROPE_DECODE=1
step breakdown_b1 35 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --out $R/breakdown_b1.json
step engine_tests 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_engine_gpu.py
step kernel_tests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_gpu.py \
  tests/test_kernels_fused_step_gpu.py tests/test_kernels_rope_decode.py
device_finish
