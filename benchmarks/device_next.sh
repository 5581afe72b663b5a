#!/bin/bash
# The first device call of the next session (written 2026-12-01, after the device budget
# ran out): what this session changed or found and could not run.
#   1. the fused MoE's unpacked fp32 / bf16 path on CUDA (the suspect of the tiny gpt-oss
#      discrepancy: `logs/diag_swa_0b50c91.log`), then the smoke and the engine GPU suite;
#   2. the prefix-cache GPU tests (hits, host reloads, swaps under CUDA graphs);
#   3. bench_prefix's hybrid chat after the checkpoint fixes (decode-time checkpoint,
#      checkpoints never evicting cached pages) and the asynchronous spill;
#   4. the wide MiMo.
# Run from a snapshot holding .whl/ (see device_pending.sh):
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_next.sh
# Back under $OUT: results.tgz (every log and JSON), summary.txt.
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/next_res /tmp/next_out
pt="python3 -m pytest -m gpu -q -rA -p no:cacheprovider --timeout=150"
step moe_tests 60 $pt tests/test_kernels_moe.py
step diag_gpt_oss 120 python3 benchmarks/diag_gpt_oss.py
step smoke 150 $pt -x tests/test_gpu_smoke.py
step engine 150 $pt tests/test_engine_gpu.py
step prefix_tests 150 $pt tests/test_prefix_gpu.py
step prefix_bench 90 python3 benchmarks/bench_prefix.py --device cuda --models hybrid,llama \
  --workloads chat,spill --out $R/prefix_chat.json
step prefix_bench_2x 60 python3 benchmarks/bench_prefix.py --device cuda --models hybrid \
  --workloads chat --pool-factor 2 --out $R/prefix_chat_2x.json
step mimo_wide 120 $pt --durations=10 tests/test_engine_mimo_gpu.py -k wide
device_finish
