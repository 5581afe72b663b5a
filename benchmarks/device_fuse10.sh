#!/bin/bash
# The tenth session's third call: the engine's GPU tests (fp32 token-exact, bf16
# teacher-forced, one request on the GEMV with the pre-norms and SwiGLU fused into it);
# one request's e2e and breakdown with programmatic dependent launch on and off
# (UNIKV_GEMV_PDL); Llama's full-batch e2e (the cuBLAS path, for regressions).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_fuse10.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/fuse10_res /tmp/fuse10_out
step engine_gpu_tests 180 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_engine_gpu.py
for pdl in 1 0; do
  step e2e_b1_pdl$pdl 45 env UNIKV_GEMV_PDL=$pdl python3 benchmarks/bench_e2e.py --device cuda \
    --models llama --paths unikv --requests 1 --out $R/e2e_b1_pdl$pdl.json
  step breakdown_b1_pdl$pdl 35 env UNIKV_GEMV_PDL=$pdl python3 benchmarks/bench_breakdown.py \
    --device cuda --models llama --requests 1 --out $R/breakdown_b1_pdl$pdl.json
done
step e2e_llama 70 python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv \
  --models llama --out $R/e2e_llama.json
device_finish
