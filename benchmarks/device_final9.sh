#!/bin/bash
# The ninth session's closing call: GPU tests of decode attention (heads-first grid,
# 64-token splits, the no-split tile), the fused kernels and the engine's fp32 greedy
# path; the e2e with every transformers path (the ratios); one request's e2e; the
# decode breakdowns; a Llama timeline (with the GEMM warm-up).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_final9.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/final9_res /tmp/final9_out
step gpu_tests 110 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_fused_step_gpu.py "tests/test_kernels_gpu.py" -k "decode or fused or argmax or rope or fp32_greedy" \
  tests/test_engine_gpu.py
step e2e_all 220 python3 benchmarks/bench_e2e.py --device cuda --quick --out $R/e2e_same_run.json
step e2e_b1 40 python3 benchmarks/bench_e2e.py --device cuda --models llama --paths unikv \
  --requests 1 --out $R/e2e_b1.json
step breakdown_decode 55 python3 benchmarks/bench_breakdown.py --device cuda \
  --out $R/breakdown_b256.json
step breakdown_b1 35 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --out $R/breakdown_b1.json
timelines 40 llama
device_finish
