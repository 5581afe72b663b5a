#!/usr/bin/env bash
# Odd cache widths on the GPU (issue 38 item 6): each configuration in its own process
# (a CUDA error ends only that one). Usage: benchmarks/device_odd_widths.sh [repro|tests]
# (SANITIZE=1: the repro's crash case again under compute-sanitizer). Log: $OUT/odd_widths.log
set -u
OUT=${OUT:-/tmp/odd_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
LOG=$OUT/odd_widths.log
one() {  # case page_size dtype [env...]: CUDA graphs on
  local c=$1 ps=$2 dt=$3; shift 3
  local t0=$SECONDS
  out=$(env "$@" timeout 90 python3 tests/odd_width_cases.py "$c" --page-size "$ps" --dtype "$dt" 2>&1)
  rc=$?
  res=$(echo "$out" | grep '^RESULT' | python3 -c 'import json,sys; l=sys.stdin.read().strip(); d=json.loads(l[7:]) if l else None; print("same=%s" % (d["engine"] == d["hf"]) if d else "no result")')
  echo "$c ps=$ps $dt $* rc=$rc $res $((SECONDS-t0))s" | tee -a "$LOG"
  if [ $rc -ne 0 ]; then echo "$out" | grep -v "Loading weights\|Writing model" | tail -25 | tee -a "$LOG"; fi
}
mode=${1:-repro}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$LOG"
if [ "$mode" = repro ]; then
  one mla30 4 fp32 CUDA_LAUNCH_BLOCKING=1
  if [ "${SANITIZE:-0}" = 1 ]; then
    timeout 120 compute-sanitizer --tool memcheck --print-limit 3 python3 tests/odd_width_cases.py mla30 --page-size 4 --dtype fp32 2>&1 | grep -v "Loading weights\|Writing model" | grep -B2 -A12 "Invalid\|rror\|misaligned" | head -60 | tee -a "$LOG"
  fi
  one mla30 1 fp32
  one mla30 16 fp32
  one mla30 4 bf16
  one mla26 4 fp32
  one mha6 4 fp32
  one mha40 4 fp32
fi
if [ "$mode" = tests ]; then  # the GPU tests of the fix (tests/test_odd_widths_gpu.py)
  t0=$SECONDS
  python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_odd_widths_gpu.py 2>&1 | tail -40 | tee -a "$LOG"
  echo "pytest wall $((SECONDS-t0))s" | tee -a "$LOG"
fi
