#!/bin/bash
# The tenth session's closing call: the engine's bf16 GPU tests (one request on the
# GEMV with the one-pass pre-norm), one request's e2e and breakdown with programmatic
# dependent launch on and off, and the e2e with every transformers path (the ratios).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_final10.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/final10_res /tmp/final10_out
step engine_bf16_tests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_engine_gpu.py -k bf16
for pdl in 1 0; do
  step e2e_b1_pdl$pdl 40 env UNIKV_GEMV_PDL=$pdl python3 benchmarks/bench_e2e.py --device cuda \
    --models llama --paths unikv --requests 1 --out $R/e2e_b1_pdl$pdl.json
  step breakdown_b1_pdl$pdl 30 env UNIKV_GEMV_PDL=$pdl python3 benchmarks/bench_breakdown.py \
    --device cuda --models llama --requests 1 --out $R/breakdown_b1_pdl$pdl.json
done
step e2e_all 220 python3 benchmarks/bench_e2e.py --device cuda --quick --out $R/e2e_same_run.json
device_finish
