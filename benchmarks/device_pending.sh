#!/bin/bash
# One device call for what CPU-only sessions left for a GPU (sessions 31-33): the GPU tests
# written since the last suite run, then the hybrid chat (issue 41: host ms per step
# phase, the upload ring's growth and waits) and the speculation rule at B 64 (issue 42,
# Qwen3.5's MTP included), each alone on the GPU. Carry [".whl"] (benchmarks/device_wheels.sh).
# A second call: `python3 benchmarks/bench_fp8_gemm.py --quick` (split K fused vs summed by
# torch vs cuBLAS at decode, the fused pre-norm's rows).
#   UNIKV_GIT_COMMIT=<sha> BUDGET=560 bash benchmarks/device_pending.sh
# Back under $OUT: summary.txt (each step's rc and time, the tests' last lines and
# FAILED lines), results.tgz (a log per step, prefix_hybrid_chat.json, spec_rule.json).
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/pending_res /tmp/pending_out
export NO_TAR=1 UNIKV_TEST_LANE_FRACTION=0.1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$R/gpu.txt" 2>&1
pt="python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout=200"
# the pinned ring that grows, the prefix cache's restores and chunk checkpoints
step t_ring 200 $pt tests/allocator/test_allocator_gpu.py tests/engine/test_prefix_gpu.py &
step t_ckpt 200 $pt tests/engine/test_prefix_chunk_ckpt.py tests/engine/test_prefix_checkpoint_gpu.py &
# the FP8 reference's IEEE division, the fused pre-norm's layout fix, split K in one
# launch under graph replay, FP8 models
step t_fp8 200 $pt tests/kernels/test_kernels_fp8_gemm.py tests/kernels/test_kernels_norm_quant.py \
  tests/kernels/test_kernels_fp8_split.py tests/models/test_models_fp8_normquant.py \
  tests/models/test_models_fp8.py &
wait
unset UNIKV_TEST_LANE_FRACTION
step prefix_chat 220 python3 benchmarks/bench_prefix.py --device cuda --workloads chat \
  --models hybrid --out "$R/prefix_hybrid_chat.json"
step spec_rule 200 python3 benchmarks/bench_spec.py --rule-only --out "$R/spec_rule.json"
for f in "$R"/logs/t_*.log; do echo "    $(basename "$f" .log): $(tail -1 "$f")"; done >>"$R/summary.txt"
grep -h "^FAILED\|^ERROR" "$R"/logs/t_*.log >>"$R/summary.txt"
device_finish
