#!/bin/bash
# The ninth session's MoE alignment call: GPU tests of the MoE and gpt-oss paths on the
# one-program alignment, gpt-oss's e2e (unikv) and its decode breakdown at B 256.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_align9.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/align9_res /tmp/align9_out
step gpu_tests 130 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  -k "gpt_oss or gpt-oss or moe or MoE" tests/test_kernels_moe.py tests/test_engine_gpu.py \
  tests/test_gpu_smoke.py
step e2e_gpt_oss 60 python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv \
  --models gpt-oss --out $R/e2e_gpt_oss.json
step breakdown_gpt_oss 40 python3 benchmarks/bench_breakdown.py --device cuda --models gpt-oss \
  --out $R/breakdown_gpt_oss.json
device_finish
