#!/bin/bash
# The next session's second device call (written in the sixth session, whose device was
# not lent after its first call): after benchmarks/device_sweeps.sh's picks are
# installed in kernels/moe.TABLE and mla_decode_plan.TABLE,
#   1. the GPU tests of what changed unrun on a GPU: the MoE kernels (table entries,
#      swap / nibble_dots), the MLA decode entries (fused16n64, 64 heads), the fp8 KV
#      cache (fp32 model, graphs on and off);
#   2. bench_e2e --quick (both models, unikv; the installed MoE entries in the step);
#   3. the Llama B 1 breakdown again.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_next.sh   (from a snapshot with .whl/)
# (The first session's device_next.sh ran at cac53ea: logs/next_cac53ea/.)
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/next_res /tmp/next_out
step gpu_tests 240 python3 -m pytest -q -m gpu tests/test_kernels_moe.py \
  tests/test_kernels_mla_decode.py tests/test_engine_fp8_kv.py
step e2e 120 python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv \
  --out $R/e2e.json
step breakdown_b1 60 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --out $R/breakdown_b1.json
step moe_bench 90 python3 benchmarks/bench_moe.py --quick --out $R/moe.json
device_finish
