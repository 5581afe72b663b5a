#!/bin/bash
# The ninth session's second call: GPU tests of the engine on the fused rope + store
# and argmax, the decode attention grid-order A/B, Llama timelines without the GEMM
# warm-up / with it / with CUDA_MODULE_LOADING=EAGER, the e2e (unikv) and breakdowns.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_warm9.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/warm9_res /tmp/warm9_out
pe="python3 benchmarks/profile_engine.py --model llama --new-tokens 64 --timeline --layers"
step timeline_nowarm 60 $pe --no-warm-gemms --out $R/timeline_nowarm.json
step timeline_warm 60 $pe --out $R/timeline_warm.json
CUDA_MODULE_LOADING=EAGER step timeline_eager 60 $pe --no-warm-gemms --out $R/timeline_eager.json
step decode_ops 60 python3 benchmarks/bench_decode_ops.py --sections attention \
  --out $R/decode_ops_grid.json
step e2e_unikv 100 python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv \
  --out $R/e2e_unikv.json
step breakdown_b256 50 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --out $R/breakdown_b256.json
step breakdown_b1 40 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --out $R/breakdown_b1.json
step gpu_tests 170 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_kernels_fused_step_gpu.py tests/test_engine_gpu.py
device_finish
