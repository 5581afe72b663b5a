#!/bin/bash
# One combined device call. Usage: benchmarks/device_all.sh STEP...
# Steps: gputests, enginetests, alloc, io, extend, e2e. Logs and JSON land in $OUT.
# The tree sent to the device has no .git: write the commit into the run command,
# e.g. "UNIKV_GIT_COMMIT=abc1234 bash benchmarks/device_all.sh e2e", so JSON records it.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=14
mkdir -p /tmp/lcuda && ln -sf "$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')" /tmp/lcuda/libcuda.so
export FLASHINFER_EXTRA_LDFLAGS=-L/tmp/lcuda FLASHINFER_WORKSPACE_BASE=/tmp/fiws
if [ -f .whl/fiws.tgz ]; then mkdir -p /tmp/fiws && tar xzf .whl/fiws.tgz -C /tmp/fiws; fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $OUT/smi.txt
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    gputests) timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -x --timeout=120 tests/ 2>&1 | tee $OUT/gpu_tests.log ;;
    enginetests) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=120 tests/test_engine_gpu.py tests/test_io_gpu.py 2>&1 | tee $OUT/gpu_tests.log ;;
    alloc) timeout 120 python3 benchmarks/bench_allocator.py --device cuda 2>&1 | tee $OUT/alloc.log; cp benchmarks/results/allocator_cuda.json $OUT/ 2>/dev/null ;;
    io) timeout 150 python3 benchmarks/bench_io.py --device cuda --quick 2>&1 | tee $OUT/io.log; cp benchmarks/results/io_h200.json $OUT/ 2>/dev/null ;;
    extend) timeout 150 python3 benchmarks/bench_kernels.py --quick --sections extend --out $OUT/kernels_extend_h200.json 2>&1 | tee $OUT/extend.log ;;
    e2e) timeout 420 python3 benchmarks/bench_e2e.py --device cuda --quick 2>&1 | tee $OUT/e2e.log; cp benchmarks/results/e2e_h200.json $OUT/ 2>/dev/null ;;
  esac
done
echo "=== done ($(date +%T))"
