#!/bin/bash
# The seventh session's last device call: mixed prefill steps split their joining
# prompts off to the fresh extend kernel (engine/plan.FreshSplit), measured against the
# tree before it (before/, 5b782ee) in the same run:
#   1. GPU tests: the split's engine test (4 architectures, fp32, tokens equal to
#      transformers') and the fresh kernel's candidates (the new 64-row tile);
#   2. extend at Llama-3.2-1B's heads (D 64) on its e2e prefill shapes, paged and fresh;
#   3. e2e: Llama unikv before the split, then both models at HEAD with transformers'
#      paths (the headline ratios, one run);
#   4. the prefill breakdown at HEAD, and the engine's host profile of prefill steps.
#   UNIKV_GIT_COMMIT=<sha> BEFORE_COMMIT=5b782ee bash benchmarks/device_split.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/split_res /tmp/split_out
pt="python3 -m pytest -m gpu -q -rfE -p no:cacheprovider"
step gpu_tests 110 $pt -k "mixed_steps or fresh" tests/test_engine_gpu.py tests/test_kernels_gpu.py
step extend_d64 60 python3 benchmarks/bench_extend_long.py --dim 64 --budget-s 45 \
  --shapes 16x0+512,1x0+8192,8x512+512 --out $R/extend_d64.json
UNIKV_GIT_COMMIT=$BEFORE_COMMIT TREE=$PWD/before step e2e_llama_before 60 python3 \
  benchmarks/bench_e2e.py --device cuda --quick --paths unikv --models llama \
  --out $R/e2e_llama_before.json
step e2e_hf 200 python3 benchmarks/bench_e2e.py --device cuda --quick --out $R/e2e_same_run.json
step breakdown_prefill 60 python3 benchmarks/bench_breakdown.py --device cuda --phase prefill \
  --out $R/breakdown_prefill.json
step host_prefill 50 python3 benchmarks/profile_engine.py --model llama --new-tokens 2
device_finish
