#!/bin/bash
# The twelfth session's third call: gpt-oss on the engine (fp32 token-exact, bf16
# teacher-forced; its MoE kernels changed signature) and the MoE smoke test, the
# same-run A/B of the two MXFP4 decodes at 256, 2048 and 8192 tokens, and bench_moe's
# table figures (B 1, 64, 256 against the dense loop).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_mx12c.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/mx12c_res /tmp/mx12c_out
step engine_gpt_oss 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/test_engine_gpu.py tests/test_gpu_smoke.py -k "gpt_oss or moe"
step ab_halves 100 env MOE_SWEEP_FORMATS=mxfp4 MOE_SWEEP_TAG=_halves python3 \
  benchmarks/bench_moe.py --sweep --batches 256,2048,8192 --budget 90
step ab_interleave 100 env MOE_SWEEP_FORMATS=mxfp4 MOE_SWEEP_TAG=_interleave \
  UNIKV_MXFP4_DECODE=interleave python3 benchmarks/bench_moe.py --sweep \
  --batches 256,2048,8192 --budget 90
step bench_moe 90 python3 benchmarks/bench_moe.py --quick --out $R/moe_h200.json
device_finish
