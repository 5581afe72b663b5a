#!/bin/bash
# The seventh session's second device call, after device_sweeps.sh (92dff99) and its MoE
# picks installed in kernels/moe.TABLE:
#   0. bench_capacity_real in the background (its figures are counts, not times), one
#      process per model, while
#   1. the GPU tests run of what had not run on a GPU: the MoE kernels (table entries,
#      swap / nibble_dots), the MLA decode entries (fused16n64, 64 heads), the fp8 KV
#      cache (fp32 model, graphs on and off);
#   2. bench_e2e --quick (both models, unikv), alone on the GPU;
#   3. where the time goes: full-chunk prefill steps (both models), the full-batch decode
#      step (both models, B 256), and the Llama B 1 step.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_next.sh   (from a snapshot with .whl/)
# (The sixth session's device_next.sh ran at cac53ea: logs/next_cac53ea/.)
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/next_res /tmp/next_out
cap() {  # capacity of one model, in the background
  OUT=$R PYTHONPATH=$PWD:/tmp/site timeout 330 python3 benchmarks/bench_capacity_real.py \
    --device cuda --models "$1" --out "$R/capacity_real_$1.json" >"$R/logs/capacity_$1.log" 2>&1
}
cap mimo-v2-flash & P1=$!
cap deepseek-v3 & P2=$!
step gpu_tests 220 python3 -m pytest -q -m gpu tests/test_kernels_moe.py \
  tests/test_kernels_mla_decode.py tests/test_engine_fp8_kv.py
wait $P1 $P2
echo "[$(date +%T)] capacity done" | tee -a "$R/summary.txt"
step e2e 130 python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv \
  --out $R/e2e.json
step breakdown_prefill 80 python3 benchmarks/bench_breakdown.py --device cuda --phase prefill \
  --out $R/breakdown_prefill.json
step breakdown_b256 70 python3 benchmarks/bench_breakdown.py --device cuda \
  --out $R/breakdown_b256.json
step breakdown_b1 40 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --out $R/breakdown_b1.json
device_finish
