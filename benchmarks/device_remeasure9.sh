#!/bin/bash
# The ninth session's re-measure: the fused kernels' GPU tests at HEAD (the rotation helper
# moved), issue 15's two targets not re-measured since the seventh / eighth sessions
# (the 16k fresh extend against SDPA, the fused MoE at B 256 with MXFP4 experts).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_remeasure9.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/remeasure9_res /tmp/remeasure9_out
step gpu_fused 40 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_fused_step_gpu.py
step extend_long 90 python3 benchmarks/bench_extend_long.py --budget-s 60 --out $R/extend_long.json
step moe 80 python3 benchmarks/bench_moe.py --quick --out $R/moe.json
device_finish
