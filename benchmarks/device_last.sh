#!/bin/bash
# The seventh session's closing check (after installing the head-dim-64 extend tiles from
# device_split.sh's sweep): the e2e (both models, unikv) and Llama's prefill breakdown.
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/last_res /tmp/last_out
step e2e 80 python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv --out $R/e2e.json
step breakdown_prefill 40 python3 benchmarks/bench_breakdown.py --device cuda --phase prefill \
  --models llama --out $R/breakdown_prefill_llama.json
device_finish
