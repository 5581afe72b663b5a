#!/bin/bash
# One device call: install the carried FlashInfer wheels, run the GPU kernel tests
# and the kernel benchmark, keep logs and JSON under $OUT. Usage: device_run.sh TEST_S BENCH_S [bench args]
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=14
mkdir -p /tmp/lcuda && ln -sf "$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')" /tmp/lcuda/libcuda.so
export FLASHINFER_EXTRA_LDFLAGS=-L/tmp/lcuda FLASHINFER_WORKSPACE_BASE=/tmp/fiws
if [ -f .whl/fiws.tgz ]; then mkdir -p /tmp/fiws && tar xzf .whl/fiws.tgz -C /tmp/fiws; fi
test_s=$1; bench_s=$2; shift 2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $OUT/smi.txt
if [ "$test_s" -gt 0 ]; then
  timeout "$test_s" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tee $OUT/gpu_tests.log
fi
timeout "$bench_s" python3 benchmarks/bench_kernels.py --out $OUT/kernels_h200.json "$@" 2>&1 | tee $OUT/bench.log
(cd /tmp/fiws 2>/dev/null && tar czf $OUT/fiws.tgz . && ls -la $OUT/fiws.tgz)
