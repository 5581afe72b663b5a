#!/bin/bash
# The whole GPU suite (`pytest -m gpu`) in one device call: five lanes of test files run
# side by side on the one GPU (the tiny models leave it mostly idle; the host has 16
# cores), each file capped, each lane skipping what the call's deadline leaves no room for.
#   UNIKV_GIT_COMMIT=<sha> BUDGET=540 bash benchmarks/device_suite.sh
# Back under $OUT: results.tgz (a log per file), summary.txt (rc, time and pytest's last
# line per file, then every FAILED line).
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/suite_res /tmp/suite_out
export NO_TAR=1
pt="python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout=240"
lane() {
  local cap=$1 f; shift
  for f in "$@"; do
    step "$(basename "$f" .py)" "$cap" $pt "$f"
    echo "    $(basename "$f"): $(tail -1 "$R/logs/$(basename "$f" .py).log")" >>"$R/summary.txt"
  done
}
lane 300 tests/engine/test_prefix_gpu.py tests/engine/test_engine_hybrid_gpu.py tests/engine/test_launch_gpu.py \
  tests/io/test_io_gpu.py tests/allocator/test_allocator_gpu.py tests/engine/test_engine_gemma_gpu.py &
lane 240 tests/engine/test_engine_gpu.py tests/allocator/test_allocator_pressure_gpu.py &
lane 240 tests/kernels/test_kernels_mla_gpu.py tests/kernels/test_kernels_mla_decode.py \
  tests/kernels/test_kernels_recurrent_gpu.py &
lane 240 tests/kernels/test_kernels_gpu.py tests/engine/test_engine_deepseek_gpu.py &
lane 200 tests/engine/test_gpu_smoke.py tests/kernels/test_mla_expanded.py tests/kernels/test_kernels_elementwise.py \
  tests/models/test_models_fp8.py tests/kernels/test_kernels_moe.py &
lane 480 tests/engine/test_engine_mimo_gpu.py &  # the wide MiMo: minutes on its own
# odd cache widths (issue 38 item 6), the shared decoder's GEMV and fused step
lane 200 tests/kernels/test_odd_widths_gpu.py tests/kernels/test_kernels_gemv.py \
  tests/kernels/test_kernels_fused_step_gpu.py &
# the twentieth session's families (Bamba, Granite-4.0-H, Zamba2; Qwen3.5-MoE, Gemma-3
# multimodal, LFM2; Kimi-Linear), FP8 block weights, speculative decoding
lane 240 tests/engine/test_engine_mamba_hybrids_gpu.py tests/engine/test_engine_new_families_gpu.py \
  tests/engine/test_prefix_checkpoint_gpu.py &
lane 240 tests/engine/test_engine_kimi_linear_gpu.py tests/kernels/test_kernels_fp8_gemm.py \
  tests/engine/test_spec_gpu.py &
# the twenty-first session's: per-draft recurrent state, two models under one budget, no
# per-step environment or capability reads (the NCCL TP files need 2-4 GPUs: not here)
lane 240 tests/engine/test_spec_recurrent_gpu.py tests/kernels/test_kernels_recurrent_draft.py \
  tests/engine/test_no_step_reads.py tests/engine/test_spec_qwen_mtp_gpu.py &
wait
# the elastic pool's CUDA backing and the two-model budget (issue 44) measure free memory:
# alone, after the lanes
lane 150 tests/core/test_backing_gpu.py tests/engine/test_multi_budget_gpu.py
grep -h "^FAILED\|^ERROR" "$R"/logs/test_*.log >>"$R/summary.txt"
device_finish
