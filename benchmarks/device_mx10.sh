#!/bin/bash
# The tenth session's first call: the MoE GPU tests (tl.dot_scaled on packed MXFP4
# tiles among them), the MXFP4 sweep with and without dot_scaled (B 256 first), and
# the one-request GEMV benchmark (cuBLAS against the Triton GEMV).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_mx10.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/mx10_res /tmp/mx10_out
step moe_gpu_tests 120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_moe.py
step sweep_mxfp4 200 env MOE_SWEEP_FORMATS=mxfp4 python3 benchmarks/bench_moe.py --sweep \
  --batches 256,64,16,8,1 --budget 170
step gemv 90 python3 benchmarks/bench_gemv.py --out $R/gemv.json
device_finish
