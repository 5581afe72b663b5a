#!/bin/bash
# The eighth session's last call: the sampled-token slots pinned once at construction
# (GPU test: a generate pins nothing), the Llama timeline with host phases inside each
# launch, and the e2e (unikv paths) after it.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_pin8.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/pin8_res /tmp/pin8_out
step gpu_tests 70 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -k pin_no_host \
  tests/test_engine_gpu.py
timelines 45 llama
step e2e 85 python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv \
  --out $R/e2e.json
device_finish
