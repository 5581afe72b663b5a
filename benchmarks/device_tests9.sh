#!/bin/bash
# The ninth session's last call: the GPU tests device_final9.sh's 110 s cap cut short,
# verbose: decode attention at realistic sizes and the engine's GPU file.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_tests9.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/tests9_res /tmp/tests9_out
pt="python3 -m pytest -m gpu -v -rfE -p no:cacheprovider"
step gpu_kernels 60 $pt tests/test_kernels_gpu.py -k "decode or store"
step gpu_engine 170 $pt tests/test_engine_gpu.py
device_finish
