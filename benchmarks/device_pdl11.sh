#!/bin/bash
# The eleventh session's first call: programmatic dependent launch over the whole
# one-request decode chain (kernels/pdl.py). One request's e2e with PDL off, wait
# only, + early triggers, + the GEMV's L2 weight prefetch, and both (the default);
# the default's breakdown and GEMV chain; then the engine's GPU tests (PDL on: fp32
# token-exact with graphs on and off, bf16 teacher-forced, one request on the GEMV).
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_pdl11.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/pdl11_res /tmp/pdl11_out
e2e_b1() {  # NAME ENV...: one request's e2e under the given switches
  local name=$1; shift
  step e2e_b1_$name 45 env "$@" python3 benchmarks/bench_e2e.py --device cuda \
    --models llama --paths unikv --requests 1 --out $R/e2e_b1_$name.json
}
e2e_b1 off UNIKV_PDL=0
e2e_b1 wait UNIKV_PDL_TRIGGER=0 UNIKV_PDL_PREFETCH=0
e2e_b1 trigger UNIKV_PDL_PREFETCH=0
e2e_b1 prefetch UNIKV_PDL_TRIGGER=0
e2e_b1 both UNIKV_PDL=1
step breakdown_b1 35 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --out $R/breakdown_b1.json
step gemv 30 python3 benchmarks/bench_gemv.py --out $R/gemv.json
step gemv_off 30 env UNIKV_PDL=0 python3 benchmarks/bench_gemv.py --out $R/gemv_off.json
step engine_tests 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_engine_gpu.py
device_finish
