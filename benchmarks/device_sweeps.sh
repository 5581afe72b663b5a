#!/bin/bash
# Sweeps and host figures in one device call (sixth session):
#   1. the fused-MoE sweep over every bucket with the swapped-operand tiles and the
#      integer MXFP4 decode (``moe.CANDIDATES``), checked against the torch reference;
#   2. the MLA decode sweep at 64 and 16 heads with split fills of 1, 2 and 4 programs
#      an SM;
#   3. the engine loop's host time per phase on CUDA (B 1 and 256);
#   4. the GPU tests of both kernels (the new MLA table entries and MoE tiles).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_sweeps.sh   (from a snapshot with .whl/)
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/sweep_res /tmp/sweep_out
step moe_sweep 240 python3 benchmarks/bench_moe.py --sweep --budget 210 \
  --batches 1,8,16,64,256,2048
cp benchmarks/results/moe_sweep_h200_B1_8_16_64_256_2048.json $R/ 2>/dev/null
step mla_sweep_64_16 130 python3 benchmarks/bench_mla_decode.py --sweep --heads 64,16 \
  --budget 110 --out $R/mla_decode_sweep_64_16.json
step host_overhead 60 python3 benchmarks/bench_host_overhead.py --device cuda --batches 1,256 \
  --out $R/host_overhead_cuda.json
step gpu_kernel_tests 150 python3 -m pytest -q -m gpu tests/test_kernels_moe.py \
  tests/test_kernels_mla_decode.py -x
device_finish
