#!/bin/bash
# The next session's first device call (written at the end of the seventh session, whose
# budget ran out):
#   0. CUDA-event timelines of whole runs (Llama, gpt-oss): per step kind, host enqueue
#      time, device span, the device's idle gap before each step;
#   1. the host profile of prefill steps (profile_engine.py --new-tokens 2: prefill only,
#      the prefix cache reset after the warm-up): is the eager prefill step host-bound?
#   2. a same-run A/B of the e2e: before/ (707e5f6: the split, 128-row head-dim-64 tiles)
#      against HEAD (64-row tiles), after / before / after, unikv paths only (0216013's
#      lease ran slower than 707e5f6's with no control);
#   3. the prefill breakdown at HEAD (the fresh pointer tile at head dim 64 has not run
#      inside the engine on the GPU).
# Run from a snapshot holding .whl/ and before/ (git archive 707e5f6 | tar -x -C before):
#   UNIKV_GIT_COMMIT=<sha> BEFORE_COMMIT=707e5f6 bash benchmarks/device_next.sh
# (The seventh session's calls: device_sweeps.sh, device_split.sh, device_last.sh.)
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/next_res /tmp/next_out
timelines 70 llama gpt-oss
step host_prefill 80 python3 benchmarks/profile_engine.py --model llama --new-tokens 2
for run in after1 before after2; do
  tree=$PWD commit=$UNIKV_GIT_COMMIT
  [ "$run" = before ] && tree=$PWD/before commit=$BEFORE_COMMIT
  UNIKV_GIT_COMMIT=$commit TREE=$tree step e2e_$run 90 python3 benchmarks/bench_e2e.py \
    --device cuda --quick --paths unikv --out $R/e2e_$run.json
done
step breakdown_prefill 60 python3 benchmarks/bench_breakdown.py --device cuda --phase prefill \
  --out $R/breakdown_prefill.json
device_finish
