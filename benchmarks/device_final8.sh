#!/bin/bash
# The eighth session's closing call: GPU tests of the MoE and gpt-oss paths on the
# K-contiguous experts, the e2e with every transformers path (the ratios), CUDA-event
# timelines with GC and allocator counters, the decode breakdown, and the bf16 MoE sweep
# below 256 tokens on the new layout.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_final8.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/final8_res /tmp/final8_out
pt="python3 -m pytest -m gpu -q -rfE -p no:cacheprovider"
step gpu_tests 120 $pt -k "gpt_oss or gpt-oss or moe or MoE" tests/test_kernels_moe.py \
  tests/test_engine_gpu.py tests/test_gpu_smoke.py
step e2e_all 200 python3 benchmarks/bench_e2e.py --device cuda --quick --out $R/e2e_same_run.json
timelines 55 llama
step breakdown_decode 60 python3 benchmarks/bench_breakdown.py --device cuda \
  --out $R/breakdown_decode.json
MOE_SWEEP_FORMATS=bf16 step moe_sweep_small 70 python3 benchmarks/bench_moe.py --sweep \
  --budget 55 --batches 1,8,16,64
cp benchmarks/results/moe_sweep_h200_B1_8_16_64.json $R/ 2>/dev/null
device_finish
