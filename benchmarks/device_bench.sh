#!/bin/bash
# The benchmarks of one device call, run alone on the GPU (no tests beside them):
#   - issue 16's same-run before/after: bench_e2e --quick (unikv path) and bench_allocator
#     at BEFORE_COMMIT (the tree in ./before) and at this commit, interleaved
#     after / before / after; then the Llama e2e with prefix caching off and on (its
#     default is on: what caching costs on distinct prompts, in one run);
#   - bench_prefix's Llama workloads (system prompt, chat, spill) at this commit.
# PRE_TESTS: GPU test files run first, side by side (one lane each, capped at TEST_CAP),
# before any benchmark starts.
# Run from a snapshot holding .whl/ and before/ (see device_pending.sh):
#   UNIKV_GIT_COMMIT=<sha> BEFORE_COMMIT=<sha> BUDGET=440 bash benchmarks/device_bench.sh
# Back under $OUT: results.tgz (every log and JSON), summary.txt.
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/bench_res /tmp/bench_out
after=$PWD before=$PWD/before
for f in $PRE_TESTS; do
  NO_TAR=1 step "$(basename "$f" .py)" "${TEST_CAP:-200}" python3 -m pytest -m gpu -q -rfE \
    -p no:cacheprovider --timeout=200 "$f" &
done
wait
for f in $PRE_TESTS; do
  echo "    $(basename "$f"): $(tail -1 "$R/logs/$(basename "$f" .py).log")" >>"$R/summary.txt"
done
e2e="python3 benchmarks/bench_e2e.py --device cuda --quick --paths unikv"
for run in after1 before after2; do
  tree=$after commit=$UNIKV_GIT_COMMIT
  [ "$run" = before ] && tree=$before commit=$BEFORE_COMMIT
  UNIKV_GIT_COMMIT=$commit TREE=$tree step alloc_$run 50 python3 benchmarks/bench_allocator.py \
    --device cuda --out $R/alloc_$run.json
  [ "$run" = after2 ] && continue
  UNIKV_GIT_COMMIT=$commit TREE=$tree step e2e_$run 110 $e2e --out $R/e2e_$run.json
done
for caching in off on; do  # what caching costs on distinct prompts, same run
  step e2e_llama_$caching 80 $e2e --models llama --prefix-caching $caching --out $R/e2e_llama_$caching.json
done
step prefix_llama 150 python3 benchmarks/bench_prefix.py --device cuda --models llama \
  --workloads system,chat,spill --out $R/prefix_llama.json
device_finish
