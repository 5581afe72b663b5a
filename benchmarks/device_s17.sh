#!/bin/bash
# The seventeenth session's first call: the Hopper MXFP4 MoE in Gluon (weights decoded in
# registers into wgmma's A operand) against the installed Triton kernel, gpt-oss's shape.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_s17.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/s17_res /tmp/s17_out
step moe_hopper ${MOE_CAP:-240} python3 benchmarks/bench_moe_hopper.py --batches ${BATCHES:-256,64,1,1024} \
  --out $R/moe_hopper.json
device_finish
