#!/bin/bash
# The whole GPU suite (`pytest -m gpu`) in two device calls (PART=a: the engine files;
# PART=b: the kernels, smoke, FP8 and long-prefill files): lanes of test files run side by
# side on the one GPU (the tiny models leave it mostly idle; the host has 16 cores), each
# file capped, each lane skipping what the call's deadline leaves no room for. The NCCL TP
# files (tests/models/test_tp_launch.py, dist_fixtures' NCCL cases) need 2-4 GPUs.
#   UNIKV_GIT_COMMIT=<sha> BUDGET=540 PART=a bash benchmarks/device_suite.sh   (then PART=b)
# Back under $OUT: results.tgz (a log per file), summary.txt (rc, time and pytest's last
# line per file, then every FAILED line).
source "$(dirname "$0")/device_steps.sh"
device_setup /tmp/suite_res /tmp/suite_out
export NO_TAR=1
# lanes share the GPU: an engine without kv_cache_bytes takes at most this share (tests/conftest.py)
export UNIKV_TEST_LANE_FRACTION=0.1
pt="python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --timeout=240"
lane() {
  local cap=$1 f; shift
  for f in "$@"; do
    local n; n=$(basename "${f//::/.}" .py)
    step "$n" "$cap" $pt "$f"
    echo "    $n: $(tail -1 "$R/logs/$n.log")" >>"$R/summary.txt"
  done
}
if [ "${PART:-a}" = a ]; then  # the engine files (split in session 22; not yet run as two parts)
m=tests/engine/test_engine_mimo_gpu.py  # the wide MiMo: minutes on its own, so two lanes
lane 480 $m::test_bf16_teacher_forced &
lane 480 $m::test_fp32_greedy_identical_with_triton_and_graphs $m::test_fp32_graphs_under_preemption_and_tiny_chunks &
lane 480 tests/engine/test_engine_gpu.py tests/engine/test_launch_gpu.py tests/allocator/test_allocator_gpu.py &
lane 480 tests/engine/test_spec_gpu.py tests/engine/test_spec_rule.py tests/engine/test_spec_pipeline.py \
  tests/engine/test_spec_rule_ops.py tests/engine/test_spec_derive.py &
lane 480 tests/engine/test_engine_mamba_hybrids_gpu.py tests/engine/test_prefix_checkpoint_gpu.py \
  tests/io/test_io_gpu.py tests/io/test_host_runs.py &
lane 480 tests/engine/test_engine_gemma_gpu.py tests/allocator/test_allocator_pressure_gpu.py &
lane 480 tests/engine/test_engine_new_families_gpu.py tests/engine/test_engine_kimi_linear_gpu.py &
lane 480 tests/engine/test_engine_deepseek_gpu.py tests/engine/test_spec_recurrent_gpu.py \
  tests/kernels/test_kernels_recurrent_draft.py &
lane 480 tests/engine/test_engine_hybrid_gpu.py tests/engine/test_prefix_gpu.py \
  tests/engine/test_prefix_decode_cost.py tests/engine/test_spec_host.py &
lane 480 tests/engine/test_spec_qwen_mtp_gpu.py tests/engine/test_no_step_reads.py tests/engine/test_spec_lazy_draft.py \
  tests/engine/test_spec_mtp_chain.py &
lane 480 tests/engine/test_prefill_graphs_gpu.py tests/engine/test_step_rows_plan.py \
  tests/serving/test_engine_core_turns.py tests/engine/test_checkpoint_rule.py &
lane 480 tests/engine/test_spec_verify_graph.py tests/engine/test_spec_verify_rows.py \
  tests/engine/test_spec_verify_plan.py tests/engine/test_prefix_chunk_ckpt.py &
else  # PART=b: the kernel files, the smoke test, FP8 and the long prefill
lane 480 tests/kernels/test_odd_widths_gpu.py tests/kernels/test_kernels_gemv.py \
  tests/kernels/test_kernels_fused_step_gpu.py &
lane 480 tests/engine/test_gpu_smoke.py tests/kernels/test_mla_expanded.py tests/kernels/test_kernels_elementwise.py \
  tests/kernels/test_kernels_activation.py tests/kernels/test_kernels_sandwich.py &
lane 480 tests/kernels/test_kernels_mla_gpu.py tests/kernels/test_kernels_mla_decode.py \
  tests/kernels/test_kernels_mla_store_decode.py &
lane 480 tests/kernels/test_kernels_gpu.py tests/kernels/test_kernels_fp8_gemm.py &
lane 480 tests/models/test_models_fp8.py tests/kernels/test_kernels_moe.py tests/kernels/test_kernels_moe_fp8_tile.py \
  tests/kernels/test_kernels_moe_w8a8.py &
lane 480 tests/kernels/test_kernels_recurrent_ckpt.py tests/kernels/test_kernels_recurrent_gpu.py tests/engine/test_engine_long_prefill_gpu.py \
  tests/engine/test_engine_fp8_kv.py tests/kernels/test_kernels_conv_gpu.py &
lane 480 tests/kernels/test_kernels_rope_decode.py tests/kernels/test_kernels_decode_preload_gpu.py \
  tests/kernels/test_kernels_store_decode.py tests/kernels/test_kernels_rope_pairs.py \
  tests/kernels/test_kernels_moe_hopper.py tests/kernels/test_kernels_extend_hopper.py &
fi
wait
# the elastic pool's CUDA backing and the two-model budget (issue 44) measure free memory:
# alone, after the lanes
unset UNIKV_TEST_LANE_FRACTION
[ "${PART:-a}" = b ] && lane 150 tests/core/test_backing_gpu.py tests/engine/test_multi_budget_gpu.py
grep -h "^FAILED\|^ERROR" "$R"/logs/test_*.log >>"$R/summary.txt"
device_finish
