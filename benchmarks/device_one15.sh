#!/bin/bash
# The fifteenth session's first calls (the fused merge was removed after them, slower): the split merge inside decode attention's split
# launch (decode.FUSED_MERGE) on and off, alternating twice, one request's e2e; the
# decode GPU test of the chain (fused and not, preload and not, graphs); the breakdown
# at the defaults; the engine's GPU tests (fp32 token-exact, graphs on and off).
#   UNIKV_GIT_COMMIT=<sha> [SHORT=1: the tests of the chain and the A/B only] bash benchmarks/device_one15.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/one15_res /tmp/one15_out
step chain_tests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_decode_preload_gpu.py
for round in 1 2; do
  e2e_b1 fm1_$round UNIKV_DECODE_FUSED_MERGE=1
  e2e_b1 fm0_$round UNIKV_DECODE_FUSED_MERGE=0
done
[ "${SHORT:-0}" = 1 ] && { itl_summary; device_finish; exit 0; }
breakdown_b1
step engine_tests 240 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_engine_gpu.py
itl_summary
device_finish
