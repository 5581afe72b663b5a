#!/bin/bash
# The hybrid capacity/throughput benchmark on one H200 (benchmarks/bench_hybrid.py):
# Qwen3.5-shaped and NemotronH-shaped random-init models, unified pool vs SGLang's
# static split, plus transformers generate on a subset. One process per model, each
# under its own timeout (JSON is saved after every part, so a timeout keeps what ran),
# then the two are merged into $OUT/hybrid_h200.json and the table is printed.
# The tree sent to the device has no .git: pass the commit, e.g.
#   UNIKV_GIT_COMMIT=abc1234 bash benchmarks/device_hybrid.sh
# Carry .whl (fla-core) so the prefill of Gated DeltaNet / Mamba-2 uses fla's chunked kernels.
# Sized for about 5 minutes in all; PER_MODEL_S (default 225) caps each model and
# BENCH_ARGS is passed on (e.g. BENCH_ARGS="--requests 64" for a shorter run).
set -o pipefail
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
per_model=${PER_MODEL_S:-225}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $OUT/smi.txt
python3 -c "import fla" 2>/dev/null && echo "fla-core: yes" || echo "fla-core: NO (fused-recurrent prefill fallback)"
for model in qwen3_5 nemotron_h; do
  echo "=== $model ($(date +%T))"
  timeout "$per_model" python3 benchmarks/bench_hybrid.py --device cuda --models "$model" \
    --out "$OUT/hybrid_$model.json" $BENCH_ARGS 2>&1 | tee "$OUT/hybrid_$model.log"
  echo "=== $model exit ${PIPESTATUS[0]} ($(date +%T))"
done
python3 benchmarks/bench_hybrid.py --merge "$OUT/hybrid_qwen3_5.json" "$OUT/hybrid_nemotron_h.json" \
  --out "$OUT/hybrid_h200.json" 2>&1 | tee "$OUT/hybrid_summary.log"
echo "=== done ($(date +%T))"
