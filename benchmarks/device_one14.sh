#!/bin/bash
# The fourteenth session's first call: where one request's decode step sits idle on
# the device (bench_breakdown --gaps: the device recorded alone), beside its e2e ITL.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_one14.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/one14_res /tmp/one14_out
e2e_b1 base_1
step gaps_b1 40 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --gaps --out $R/gaps_b1.json
step gaps_b1_steps32 40 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --gaps --steps 32 --out $R/gaps_b1_32.json
device_finish
