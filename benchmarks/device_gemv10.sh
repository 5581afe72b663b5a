#!/bin/bash
# The tenth session's second call: GPU tests of the MoE (dot_scaled among them) and of
# the engine's bf16 paths (one-request steps now run the Triton GEMV); the MXFP4 sweep
# with and without dot_scaled (B 256 first); the GEMV benchmark; one request's e2e
# and decode breakdown.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_gemv10.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/gemv10_res /tmp/gemv10_out
step moe_gpu_tests 70 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_moe.py
step engine_bf16_tests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_engine_gpu.py -k "bf16"
step gemv 60 python3 benchmarks/bench_gemv.py --out $R/gemv.json
step e2e_b1 45 python3 benchmarks/bench_e2e.py --device cuda --models llama --paths unikv \
  --requests 1 --out $R/e2e_b1.json
step breakdown_b1 35 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --out $R/breakdown_b1.json
step sweep_mxfp4 170 env MOE_SWEEP_FORMATS=mxfp4 python3 benchmarks/bench_moe.py --sweep \
  --batches 256,64,16,8,1 --budget 140
device_finish
