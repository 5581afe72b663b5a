#!/bin/bash
# The serving benchmark on one H200 (benchmarks/bench_serving.py): `unikv serve` under
# Poisson load on the Llama-3.2-1B shape, and the HTTP path against LLM.generate.
# The device image lacks fastapi/uvicorn/pydantic: carry them as wheels in .whl/serve
# (fetched here once, Python 3.12):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl/serve \
#     fastapi==0.163.2 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 \
#     uvicorn==0.54.0 annotated-types==0.7.0 typing-inspection==0.4.2 opentelemetry-api==1.45.2
# then run with carry [".whl"]:  UNIKV_GIT_COMMIT=abc1234 bash benchmarks/device_serving.sh
# Sized for about 4 minutes (BENCH_S caps it, default 330); BENCH_ARGS is passed on.
set -o pipefail
export PYTHONUNBUFFERED=1
if ls .whl/serve/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/serve/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $OUT/smi.txt
python3 -c "import fastapi, uvicorn, httpx, prometheus_client" || { echo "serve deps missing"; exit 1; }
echo "=== bench_serving ($(date +%T))"
timeout "${BENCH_S:-330}" python3 benchmarks/bench_serving.py --device cuda \
  --out "$OUT/serving_h200.json" --log "$OUT/server.log" $BENCH_ARGS 2>&1 | tee "$OUT/serving.log"
echo "=== exit ${PIPESTATUS[0]} ($(date +%T))"
