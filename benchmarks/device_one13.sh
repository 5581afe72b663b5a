#!/bin/bash
# (Ran at a11af81; the fused merge and the L2 hint it switches were removed in bf40d77.)
# The thirteenth session's first call, one request's decode step: the GPU tests of the
# fused split merge, the L2 hint and the GEMV candidates; the GEMV chain's per-shape
# sweep; one request's e2e with the merge kernel / fused merge / + the L2 hint / + the
# swept GEMV table (the base twice, first and last, for the lease's drift); the
# breakdown; the engine's fp32 GPU tests.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_one13.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/one13_res /tmp/one13_out
step gpu_tests 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_decode_merge_gpu.py tests/test_kernels_rope_decode.py \
  tests/test_kernels_gemv.py tests/test_kernels_gpu.py -k "merge or rope or gemv or candidates or decode"
step gemv_sweep 150 python3 benchmarks/bench_gemv.py --chain-sweep --out $R/gemv_chain.json
TABLE=$(cat $R/gemv_table.json 2>/dev/null || echo '{}')
echo "table: $TABLE" | tee -a $R/summary.txt
e2e_b1 base1 UNIKV_DECODE_MERGE=kernel UNIKV_DECODE_PREFETCH=0
e2e_b1 fused UNIKV_DECODE_PREFETCH=0
e2e_b1 hint UNIKV_DECODE_PREFETCH=1
e2e_b1 table UNIKV_GEMV_TABLE="$TABLE"
e2e_b1 base2 UNIKV_DECODE_MERGE=kernel UNIKV_DECODE_PREFETCH=0
step breakdown_b1 35 env UNIKV_GEMV_TABLE="$TABLE" python3 benchmarks/bench_breakdown.py \
  --device cuda --models llama --requests 1 --out $R/breakdown_b1.json
step engine_tests 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_engine_gpu.py
device_finish
