#!/bin/bash
# The twelfth session's last call: the MoE GPU tests with the decode chosen per table
# entry (interleaved for prefill chunks) and bench_moe's figures at the final table.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_mx12d.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/mx12d_res /tmp/mx12d_out
step moe_gpu_tests 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_moe.py \
  tests/test_gpu_smoke.py -k "moe or mxfp4 or decode_mxfp4"
step bench_moe 60 python3 benchmarks/bench_moe.py --quick --out $R/moe_h200.json
device_finish
