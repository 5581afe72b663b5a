#!/bin/bash
# The twelfth session's first call: the MoE GPU tests (the two-halves MXFP4 decode's
# inline PTX bit-exact, the fused MoE against its reference), then the MXFP4 sweep with
# the two-halves decode at every bucket and the interleaved decode before it at B 256
# and 64 (the same-run A/B).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_mx12.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/mx12_res /tmp/mx12_out
step moe_gpu_tests 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_moe.py
step sweep_halves 260 env MOE_SWEEP_FORMATS=mxfp4 MOE_SWEEP_TAG=_halves python3 \
  benchmarks/bench_moe.py --sweep --batches 256,64,16,8,1,2048,8192 --budget 240
step sweep_interleave 110 env MOE_SWEEP_FORMATS=mxfp4 MOE_SWEEP_TAG=_interleave \
  UNIKV_MXFP4_DECODE=interleave python3 benchmarks/bench_moe.py --sweep --batches 256,64 \
  --budget 95
device_finish
