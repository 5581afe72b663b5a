#!/bin/bash
# The wheels the device image lacks (fla-core and the serve extra), downloaded here into
# .whl/ for Python 3.12 on x86-64, so a device call can carry them (carry [".whl"]; the
# device scripts install .whl/*.whl into /tmp/site first). A fresh checkout has no .whl/:
# run this once per session before the first device call.
#   bash benchmarks/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
plat=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
  manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do plat+=(--platform "${p}_x86_64"); done
# pyproject's pins (the gpu and serve extras), and what they need beyond the image's
# packages (the device tool's list of its image: anyio, click, h11, numpy, torch, transformers, ...)
pkgs=(fla-core==0.6.0 fastapi==0.163.2 uvicorn==0.54.0 httptools==0.9.0 xgrammar==0.2.9
  openai-harmony==0.0.8 pyzmq==27.3.0 msgspec==0.23.0 pydantic pydantic-core starlette
  annotated-types annotated-doc typing-inspection typing-extensions opentelemetry-api
  apache-tvm-ffi)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" --platform any -d .whl "${pkgs[@]}"
ls .whl
