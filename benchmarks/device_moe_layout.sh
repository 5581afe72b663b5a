#!/bin/bash
# gpt-oss's dense experts stored K-contiguous (eighth session): the MoE sweep at decode,
# chunk and full-chunk T on the new layout beside the old (MOE_SWEEP_N_MAJOR=1), then a
# same-run e2e A/B of gpt-oss (before/ holds the tree before the change).
#   UNIKV_GIT_COMMIT=<sha> BEFORE_COMMIT=<sha> bash benchmarks/device_moe_layout.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/moel_res /tmp/moel_out
MOE_SWEEP_N_MAJOR=1 step moe_sweep 150 python3 benchmarks/bench_moe.py --sweep --budget 130 \
  --batches 256,2048,8192
cp benchmarks/results/moe_sweep_h200_B256_2048_8192.json $R/ 2>/dev/null
for run in after before; do
  tree=$PWD commit=$UNIKV_GIT_COMMIT
  [ "$run" = before ] && tree=$PWD/before commit=$BEFORE_COMMIT
  UNIKV_GIT_COMMIT=$commit TREE=$tree step e2e_$run 80 python3 benchmarks/bench_e2e.py \
    --device cuda --quick --paths unikv --models gpt-oss --out $R/e2e_$run.json
done
device_finish
