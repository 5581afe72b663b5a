# Shared by the device scripts (sourced): set-up and capped steps.
#   device_setup RES_DIR DEFAULT_OUT   wheels from .whl/ (serve/, fi/) into /tmp/site, the
#                                      FlashInfer build environment, the BUDGET deadline
#   [TREE=dir] step NAME CAP CMD...    CMD in TREE (default: here), its own package first on
#                                      PYTHONPATH, capped at CAP s and by the deadline; its
#                                      log in $R/logs/NAME.log, one summary line, results.tgz
#                                      (not while NO_TAR is set: parallel lanes); its rc
#   e2e_b1 NAME [VAR=x ...]            one request's Llama e2e (bench_e2e --requests 1) with
#                                      those environment variables, into $R/e2e_b1_NAME.json
#   breakdown_b1                       one request's Llama breakdown into $R/breakdown_b1.json
#   timelines CAP MODEL...             profile_engine --timeline of each model (64 new
#                                      tokens) into $R/timeline_MODEL.json, CAP s each
#   [TREE=dir] ab_round LABEL           issue 43's A/B round of one tree: Llama's e2e (64 requests),
#                                      the allocator's host time per decode step (page 16) and the
#                                      kernels (quick, no Flex), into $R/ab_LABEL_{e2e,alloc,kern}.json
#   itl_summary                        one line per $R/e2e_*.json: ITL p50, the decode step's
#                                      fraction of its roofline, x roofline, tok/s
#   device_finish                      summary.txt and results.tgz under $FINAL
device_setup() {
  export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
  R=$1 FINAL=${OUT:-$2}
  rm -rf "$R"; mkdir -p "$FINAL" "$R/logs"
  local wheels
  wheels=$(ls .whl/*.whl .whl/serve/*.whl .whl/fi/*.whl 2>/dev/null)
  [ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site $wheels >"$R/logs/pip.log" 2>&1
  export CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=14
  mkdir -p /tmp/lcuda && ln -sf "$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')" \
    /tmp/lcuda/libcuda.so
  export FLASHINFER_EXTRA_LDFLAGS=-L/tmp/lcuda FLASHINFER_WORKSPACE_BASE=/tmp/fiws
  END=$(($(date +%s) + ${BUDGET:-560}))
}

step() {
  local name=$1 cap=$2 tree=${TREE:-$PWD}; shift 2
  local left=$((END - $(date +%s)))
  if [ "$left" -lt 20 ]; then echo "[$(date +%T)] $name SKIPPED (deadline)" | tee -a "$R/summary.txt"; return; fi
  [ "$cap" -gt "$left" ] && cap=$left
  local t=$(date +%s)
  (cd "$tree" && OUT=$R PYTHONPATH=$tree:/tmp/site timeout "$cap" "$@") >"$R/logs/$name.log" 2>&1
  local rc=$?
  echo "[$(date +%T)] $name rc=$rc $(($(date +%s) - t))s (cap $cap)$([ $rc = 124 ] && echo ' TIMED OUT')" | tee -a "$R/summary.txt"
  [ -z "$NO_TAR" ] && tar czf "$FINAL/results.tgz" -C "$R" . 2>/dev/null
  return $rc
}

e2e_b1() {
  step e2e_b1_$1 45 env "${@:2}" python3 benchmarks/bench_e2e.py --device cuda --models llama \
    --paths unikv --requests 1 --out $R/e2e_b1_$1.json
}

breakdown_b1() {
  step breakdown_b1 35 python3 benchmarks/bench_breakdown.py --device cuda --models llama \
    --requests 1 --out $R/breakdown_b1.json
}

timelines() {
  local cap=$1 m; shift
  for m in "$@"; do
    step timeline_$m "$cap" python3 benchmarks/profile_engine.py --model "$m" --new-tokens 64 \
      --timeline --out "$R/timeline_$m.json"
  done
}

ab_round() {
  step ab_$1_e2e 120 python3 benchmarks/bench_e2e.py --device cuda --models llama --paths unikv \
    --requests 64 --out "$R/ab_$1_e2e.json"
  step ab_$1_alloc 60 python3 benchmarks/bench_allocator.py --device cuda --batches 1,64,256 \
    --page-sizes 16 --steps 100 --out "$R/ab_$1_alloc.json"
  step ab_$1_kern 120 python3 benchmarks/bench_kernels.py --quick --no-flex --out "$R/ab_$1_kern.json"
}

itl_summary() {
  local f
  for f in "$R"/e2e_*.json; do
    python3 -c "import json,sys; p=json.load(open(sys.argv[1]))['models'][0]['paths']['unikv']; print(sys.argv[1].split('/')[-1], round(p['itl_p50_ms'],4), round(p['decode_step_fraction_of_roofline'],4), round(p['decode_step_x_roofline'],3), round(p['output_tokens_per_s']))" "$f"
  done | tee -a "$R/summary.txt"
}

device_finish() {
  cp "$R/summary.txt" "$FINAL/summary.txt"
  tar czf "$FINAL/results.tgz" -C "$R" .
  cat "$R/summary.txt"
}
