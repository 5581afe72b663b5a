#!/bin/bash
# The allocator's uploads on a side stream (allocator.device.SIDE_COPY) on and off,
# alternating twice, one request's e2e; the breakdown at the defaults; the full-batch
# Llama e2e (B 256, the decode step against its roofline); the allocator's and the
# engine's GPU tests.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_one14d.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/one14d_res /tmp/one14d_out
for round in 1 2; do
  e2e_b1 up1_$round UNIKV_SIDE_UPLOAD=1
  e2e_b1 up0_$round UNIKV_SIDE_UPLOAD=0
done
step alloc_tests 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_allocator_gpu.py
breakdown_b1
step e2e_b256 90 python3 benchmarks/bench_e2e.py --device cuda --quick --models llama --paths unikv \
  --out $R/e2e_b256.json
step engine_tests 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_engine_gpu.py
itl_summary
device_finish
