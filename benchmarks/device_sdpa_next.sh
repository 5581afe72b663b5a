#!/bin/bash
# Ready for the next session (not run): what decides whether extend_sdpa can be on by
# default. The first call of new prompt lengths with and without torch's
# TORCH_CUDNN_SDPA_AVOID_RECOMPILE (bench_extend_sdpa_lengths.py); the SDPA op's GPU test
# in its current form; the engine's bf16 GPU tests with the op on; one request's e2e with
# it on (TTFT) and off.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_sdpa_next.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/sdpa_next_res /tmp/sdpa_next_out
step lengths 120 python3 benchmarks/bench_extend_sdpa_lengths.py --out $R/extend_sdpa_lengths.json
step extlong_avoid 100 env UNIKV_EXTEND_SDPA=1 TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 \
  python3 benchmarks/bench_extend_long.py --shapes 1x0+16384,1x0+16000,1x0+4096 --budget-s 45 \
  --out $R/extend_long_avoid.json
grep -E "SUMMARY|engine|sdpa" "$R/logs/extlong_avoid.log" | tee -a "$R/summary.txt"
step sdpa_tests 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "sdpa"
step engine_bf16 150 env UNIKV_EXTEND_SDPA=1 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_engine_gpu.py -k "bf16 or mixed"
e2e_b1 sdpa1 UNIKV_EXTEND_SDPA=1
e2e_b1 sdpa0 UNIKV_EXTEND_SDPA=0
itl_summary
device_finish
