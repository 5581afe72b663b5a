#!/bin/bash
# (Ran at af8316c; the fused merge and the L2 hint it switches were removed in bf40d77.)
# The thirteenth session's second call, one request's decode step: the GPU tests of the
# pre-wait loads, the fused merge, rope inside decode and the GEMV candidates; a second
# GEMV chain sweep (around the installed table); one request's e2e: the eleventh
# session's path (no preload, the merge kernel), the new default (preload + fused
# merge), preload with the merge kernel, + the L2 hint after the key loop, + the new
# sweep's table, and the old path again; the breakdown; Llama's full batch e2e.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_one13b.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/one13b_res /tmp/one13b_out
step gpu_tests 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_decode_preload_gpu.py tests/test_kernels_decode_merge_gpu.py \
  tests/test_kernels_rope_decode.py tests/test_kernels_gemv.py tests/test_kernels_gpu.py \
  -k "preload or merge or rope or candidates or decode"
step gemv_sweep 100 python3 benchmarks/bench_gemv.py --chain-sweep --out $R/gemv_chain.json
TABLE=$(python3 -c "
import json, sys; sys.path.insert(0, '.')
from unikv.kernels import gemv
t = {f'{n},{k}': list(c) for (n, k), c in gemv.TABLE.items()}
t.update(json.load(open('$R/gemv_table.json')))
print(json.dumps(t))" 2>/dev/null || echo '{}')
echo "table: $TABLE" | tee -a $R/summary.txt
e2e_b1 old1 UNIKV_DECODE_MERGE=kernel UNIKV_DECODE_PRELOAD=0
e2e_b1 new UNIKV_DECODE_PRELOAD=1
e2e_b1 preload_kernel UNIKV_DECODE_MERGE=kernel
e2e_b1 hint_after UNIKV_DECODE_PREFETCH=after
e2e_b1 table2 UNIKV_GEMV_TABLE="$TABLE"
e2e_b1 old2 UNIKV_DECODE_MERGE=kernel UNIKV_DECODE_PRELOAD=0
breakdown_b1
step e2e_b256 60 python3 benchmarks/bench_e2e.py --device cuda --quick --models llama \
  --paths unikv --out $R/e2e_b256.json
device_finish
