#!/bin/bash
# (Ran at 97f0529; the merge over the splits holding keys was removed after it.)
# The thirteenth session's last call: the merge over the splits holding keys
# (decode.MERGE_LENS) on and off, alternating twice, one request's e2e; the breakdown;
# the GPU tests of decode attention (merge, pre-wait loads, rope inside) and MLA's
# (its merge kernel's signature changed); the engine's fp32 GPU tests.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_one13d.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/one13d_res /tmp/one13d_out
for round in 1 2; do
  e2e_b1 lens1_$round UNIKV_DECODE_MERGE_LENS=1
  e2e_b1 lens0_$round UNIKV_DECODE_MERGE_LENS=0
done
breakdown_b1
step kernel_tests 120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_decode_preload_gpu.py tests/test_kernels_rope_decode.py \
  tests/test_kernels_mla_gpu.py tests/test_kernels_gpu.py -k "preload or merge or rope or decode or mla"
step engine_tests 120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_engine_gpu.py -k fp32
device_finish
