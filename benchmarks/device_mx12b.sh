#!/bin/bash
# The twelfth session's second call: the MoE GPU tests after the per-byte scale fix (the
# four bytes of an inline-PTX pack need not share a group: 0be8cf9 used the first byte's
# scale for all four and was wrong in layouts that pack two rows), then the two-halves
# MXFP4 sweep at every bucket.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_mx12b.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/mx12b_res /tmp/mx12b_out
step moe_gpu_tests 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_moe.py
step sweep_halves 300 env MOE_SWEEP_FORMATS=mxfp4 MOE_SWEEP_TAG=_halves python3 \
  benchmarks/bench_moe.py --sweep --batches 256,64,16,8,1,2048,8192 --budget 280
device_finish
