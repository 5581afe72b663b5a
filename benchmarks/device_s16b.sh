#!/bin/bash
# The sixteenth session's second call: one request's breakdown at the defaults (the
# argmax inside the LM head, the feedback buffer), the GEMV's GPU tests (the planted
# maxima's set-up mended), the engine's bf16 and fp32-graph GPU tests.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_s16b.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/s16b_res /tmp/s16b_out
breakdown_b1
step gemv_tests 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_gemv.py -k "argmax or gather"
step engine_tests 300 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_engine_gpu.py -k "bf16 or (fp32_greedy and True and 16)"
device_finish
