#!/bin/bash
# Where the prefill stalls come from (eighth session): CUDA-event timelines with a Triton
# compile watch, per step (Llama, gpt-oss), then the e2e twice (unikv paths, its timed run
# watched for compiles too).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_stall.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/stall_res /tmp/stall_out
timelines 70 llama gpt-oss
for run in 1 2; do
  step e2e_$run 90 python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv \
    --out $R/e2e_$run.json
done
device_finish
