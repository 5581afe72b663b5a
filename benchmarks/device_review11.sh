#!/bin/bash
# The eleventh session's review check: the kernels whose rotation now shares one helper
# (rope_qk, rope + store, the fused decode rope) and the engine's bf16 tests on the GPU.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_review11.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/review11_res /tmp/review11_out
step kernel_tests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_rope_decode.py tests/test_kernels_elementwise.py tests/test_kernels_gpu.py
step e2e_b1 45 python3 benchmarks/bench_e2e.py --device cuda --models llama --paths unikv \
  --requests 1 --out $R/e2e_b1.json
step engine_tests 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_engine_gpu.py
device_finish
