#!/bin/bash
# The eleventh session's closing call (defaults: PDL with triggers, no early GEMV tiles,
# rope + store inside decode attention compiled without fp fusion): the fused decode's
# GPU test, one request's e2e with the fusion on and off, its breakdown, Llama's
# full-batch e2e (regressions at B 256) and the engine's bf16 GPU tests.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_final11.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/final11_res /tmp/final11_out
step rope_decode_test 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_rope_decode.py
for rope in 1 0; do
  step e2e_b1_rope$rope 45 env UNIKV_ROPE_DECODE=$rope python3 benchmarks/bench_e2e.py \
    --device cuda --models llama --paths unikv --requests 1 --out $R/e2e_b1_rope$rope.json
done
step breakdown_b1 35 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --out $R/breakdown_b1.json
step e2e_b256 60 python3 benchmarks/bench_e2e.py --device cuda --quick --models llama \
  --paths unikv --out $R/e2e_b256.json
step engine_bf16_tests 100 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_engine_gpu.py -k bf16
device_finish
