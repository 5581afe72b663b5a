#!/bin/bash
# The fifteenth session's last call: the SDPA path's GPU test with enable_gqa (the
# default since 5ff46ff's A/B), one request's e2e twice at the defaults.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_ext15c.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/ext15c_res /tmp/ext15c_out
step sdpa_tests 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "sdpa"
e2e_b1 def_3
e2e_b1 def_4
itl_summary
device_finish
