#!/bin/bash
# Sweeps and host figures in one device call (sixth session):
#   1. the fused-MoE sweep over every bucket with the swapped-operand tiles and the
#      integer MXFP4 decode (``moe.CANDIDATES``), checked against the torch reference;
#   2. the MLA decode sweep at 64 and 16 heads with split fills of 1, 2 and 4 programs
#      an SM;
#   (the order: 1, 3, 2, 4; a deadline cut drops the tail)
#   3. bench_capacity_real (issue 13: capacity with real forwards; never run on a GPU);
#   4. the engine loop's host time per phase on CUDA (B 1 and 256).
# Not run yet (the device was not lent after the sixth session's first call). The next
# call: install the sweeps' picks, then the GPU tests of both kernels and the e2e.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_sweeps.sh   (from a snapshot with .whl/)
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/sweep_res /tmp/sweep_out
step moe_sweep 210 python3 benchmarks/bench_moe.py --sweep --budget 180 \
  --batches 1,8,16,64,256,2048  # JSON: $R/moe_sweep.json
step capacity_real 180 python3 benchmarks/bench_capacity_real.py --device cuda \
  --out $R/capacity_real_h200.json
step mla_sweep_64_16 120 python3 benchmarks/bench_mla_decode.py --sweep --heads 64,16 \
  --budget 100 --out $R/mla_decode_sweep_64_16.json
step host_overhead 50 python3 benchmarks/bench_host_overhead.py --device cuda --batches 1,256 \
  --out $R/host_overhead_cuda.json
device_finish
