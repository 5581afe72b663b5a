#!/bin/bash
# A short diagnostic call (seventh session): where a prefill step's host time goes on
# the H200 host (its breakdown showed 27 ms of kernels in a 50 ms step), and the e2e at
# a larger chunk.
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/diag_res /tmp/diag_out
step host_prefill 100 python3 benchmarks/profile_engine.py --model llama --new-tokens 2
step e2e_chunk16k 70 python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv \
  --models llama --chunk 16384 --out $R/e2e_llama_chunk16k.json
device_finish
