#!/bin/bash
# The seventeenth session: the Hopper MXFP4 MoE in Gluon (weights decoded in registers
# into wgmma's A operand) against the installed Triton kernel, gpt-oss's shape; then its
# GPU tests (kernel against the reference, the gpt-oss checkpoint on it).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_s17.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/s17_res /tmp/s17_out
step moe_hopper ${MOE_CAP:-150} python3 benchmarks/bench_moe_hopper.py --batches ${BATCHES:-1,8,16,64,256,2048,8192} \
  --out $R/moe_hopper.json
[ -n "$TESTS" ] && step hopper_tests 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_moe_hopper.py
device_finish
