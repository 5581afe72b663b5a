#!/bin/bash
# The first device call of the next session (written 2026-12-01, fifth session, after its
# device budget ran out): what is measured nowhere yet.
#   1. the Llama e2e with prefix caching off and on in one run (its default is on; this
#      session compared them across two leases only);
#   2. the MLA decode sweep at 64 and 16 heads (issue 13: only 128 heads were swept;
#      `--heads` is new and has not run on a GPU);
#   3. bench_mla_prefill (never run).
# Run from a snapshot holding .whl/ (FlashInfer wheels; see device_pending.sh):
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_next.sh
# Back under $OUT: results.tgz (every log and JSON), summary.txt.
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/next_res /tmp/next_out
e2e="python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv --models llama"
i=0
for caching in off on off; do  # off, on, off: the spread of the two offs bounds the noise
  i=$((i + 1))
  step e2e_llama_${i}_$caching 80 $e2e --prefix-caching $caching --out $R/e2e_llama_${i}_$caching.json
done
# issue 15's "vs the best transformers path, same run": both models, unikv and transformers
step e2e_hf 170 python3 benchmarks/bench_e2e.py --device cuda --quick \
  --paths unikv,hf_dynamic,hf_static --out $R/e2e_hf_same_run.json
step breakdown_b1 60 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
  --requests 1 --out $R/breakdown_b1.json
step mla_sweep_64_16 240 python3 benchmarks/bench_mla_decode.py --sweep --heads 64,16 \
  --budget 200 --out $R/mla_decode_sweep_64_16.json
step mla_prefill 90 python3 benchmarks/bench_mla_prefill.py --out $R/mla_prefill.json
device_finish
