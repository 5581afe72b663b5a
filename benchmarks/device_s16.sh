#!/bin/bash
# The sixteenth session's first call: the fused argmax and the feedback buffer's GPU
# tests; one request's e2e at the defaults (the argmax inside the LM head's GEMV, the
# one-row graph reading its last token from the feedback buffer), with both off
# (UNIKV_GREEDY_IN_HEAD=0 UNIKV_GRAPH_FEEDBACK=0: the fifteenth session's step), and
# with the argmax only; the engine's bf16 and fp32-graph GPU tests; then the first
# calls of new prompt lengths through extend_sdpa with and without torch's
# TORCH_CUDNN_SDPA_AVOID_RECOMPILE (what decides its default).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_s16.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/s16_res /tmp/s16_out
step gemv_tests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_gemv.py -k "argmax or gather"
for round in 1 2; do
  e2e_b1 on_$round
  e2e_b1 off_$round UNIKV_GREEDY_IN_HEAD=0 UNIKV_GRAPH_FEEDBACK=0
done
e2e_b1 head_only UNIKV_GRAPH_FEEDBACK=0
itl_summary
step engine_tests 170 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_engine_gpu.py -k "bf16 or fp32_greedy"
step lengths 120 python3 benchmarks/bench_extend_sdpa_lengths.py --out $R/extend_sdpa_lengths.json
grep AVOID "$R/logs/lengths.log" | cut -c1-700 | tee -a "$R/summary.txt"
device_finish
