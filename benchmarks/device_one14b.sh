#!/bin/bash
# The split merge in one pass (decode.MERGE_TILE 16384) against 16 splits a pass (1024,
# the earlier kernel), alternating twice, one request's e2e; the decode and MLA GPU
# tests (the merge is theirs).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_one14b.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/one14b_res /tmp/one14b_out
for round in 1 2; do
  e2e_b1 tile16k_$round UNIKV_DECODE_MERGE_TILE=16384
  e2e_b1 tile1k_$round UNIKV_DECODE_MERGE_TILE=1024
done
step kernel_tests 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_decode_preload_gpu.py tests/test_kernels_rope_decode.py \
  tests/test_kernels_mla_gpu.py tests/test_kernels_gpu.py -k "preload or merge or rope or decode or mla"
itl_summary
device_finish
