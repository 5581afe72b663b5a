#!/bin/bash
# One request's step between and around its graph: the tokens' copy to the host on a
# side stream (runner.SIDE_READBACK), the argmax inside small greedy graphs
# (graphs.GREEDY_ROWS), the embedding inside the first GEMV (gemv.EMBED), each turned
# off alone, and all of them with the one-pass merge off (the session's start),
# alternating twice; the GPU tests of the runner (engine, fp32 and bf16, graphs on and
# off) and of the GEMV.
#   UNIKV_GIT_COMMIT=<sha> bash benchmarks/device_one14c.sh
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/one14c_res /tmp/one14c_out
OFF="UNIKV_SIDE_READBACK=0 UNIKV_GRAPH_GREEDY_ROWS=0 UNIKV_GEMV_EMBED=0 UNIKV_DECODE_MERGE_TILE=1024"
for round in 1 2; do
  e2e_b1 all_$round UNIKV_SIDE_READBACK=1
  e2e_b1 noside_$round UNIKV_SIDE_READBACK=0
  e2e_b1 nogreedy_$round UNIKV_GRAPH_GREEDY_ROWS=0
  e2e_b1 noembed_$round UNIKV_GEMV_EMBED=0
  e2e_b1 start_$round $OFF
done
step gemv_tests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_kernels_gemv.py \
  -k "gather or candidates"
step engine_tests 240 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_engine_gpu.py
itl_summary
device_finish
