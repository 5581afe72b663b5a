#!/bin/bash
# The sixteenth session's first call: what decides extend_sdpa's default (the first
# calls of new lengths with and without torch's TORCH_CUDNN_SDPA_AVOID_RECOMPILE;
# bench_extend_long with the op and the switch on; the op's GPU test), then the fused
# argmax's GPU tests and one request's e2e with it (UNIKV_GREEDY_IN_HEAD=1, the
# default) and without (=0), alternating twice.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_s16.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/s16_res /tmp/s16_out
step argmax_tests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_gemv.py -k "argmax or gather"
for round in 1 2; do
  e2e_b1 head1_$round UNIKV_GREEDY_IN_HEAD=1
  e2e_b1 head0_$round UNIKV_GREEDY_IN_HEAD=0
done
itl_summary
step lengths 120 python3 benchmarks/bench_extend_sdpa_lengths.py --out $R/extend_sdpa_lengths.json
grep AVOID "$R/logs/lengths.log" | cut -c1-600 | tee -a "$R/summary.txt"
step extlong_avoid 90 env UNIKV_EXTEND_SDPA=1 TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 \
  python3 benchmarks/bench_extend_long.py --shapes 1x0+16384,1x0+16000 --budget-s 40 \
  --out $R/extend_long_avoid.json
grep -E "SUMMARY|engine|sdpa" "$R/logs/extlong_avoid.log" | tee -a "$R/summary.txt"
step sdpa_tests 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "sdpa"
device_finish
