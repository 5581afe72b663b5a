#!/bin/bash
# The ninth session's first call: the new fused kernels on the GPU (tests), the decode
# ops at the e2e's shapes (attention tiles x splits, fused rope + store, argmax), the
# decode breakdowns at B 256 and B 1, one request's e2e ITL without a profiler, and a
# Llama timeline with each module's host time and torch's sync debug mode.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_decode9.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/decode9_res /tmp/decode9_out
step gpu_fused 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_fused_step_gpu.py
step decode_ops 120 python3 benchmarks/bench_decode_ops.py --out $R/decode_ops.json
step breakdown_b256 60 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --out $R/breakdown_b256.json
step breakdown_b1 45 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --out $R/breakdown_b1.json
step e2e_b1 60 python3 benchmarks/bench_e2e.py --device cuda --models llama --paths unikv \
  --requests 1 --out $R/e2e_b1.json
step timeline_sync 70 python3 benchmarks/profile_engine.py --model llama --new-tokens 64 \
  --timeline --layers --sync-debug --out $R/timeline_llama_sync.json
device_finish
