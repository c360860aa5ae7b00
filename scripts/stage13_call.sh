#!/usr/bin/env bash
# Stage 13's backward (next/13_backward) on a GPU in one device call: build 13, 12 and 04 side by side, then
# scripts/check_backward.py (quick cases, against fp64, stage 12's forward bits and stage 04's backward),
# then the backward's time at two shapes (scripts/bench_backward.py), then, with the time left, the full case list.
# Results: $OUT/bwd_quick.json, $OUT/bwd_speed.json, $OUT/bwd_full.json, $OUT/log.txt.
# Device command: KDALAB_COMMIT=<commit> bash scripts/stage13_call.sh   (carry .whl: nvidia-cutlass, and fla-core and
# einops for FLA_BWD=1)
set -uo pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 KDALAB_BUILD=/tmp/kb OUT=${OUT:-/tmp/kdalab-out}
mkdir -p $OUT; t0=$(date +%s); log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
log "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
[ -d stages/13_backward ] || cp -r next/13_backward stages/  # on its way into the ladder: a stage here (this copy only)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site  # the CuTe headers of stages 12 and 13
if [ "${FLA_BWD:-0}" = 1 ] && ls .whl/fla_core*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_fla .whl/fla_core*.whl .whl/einops*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site_fla; FLA=--fla
fi
for s in 13 12 04; do
  ( timeout 300 python3 -c "from common.stages import load_stage; load_stage('$s').build()" > $OUT/build_$s.txt 2>&1
    log "build $s rc=$?" ) &
done
( timeout 300 python3 -c "from common.stages import load_stage; load_stage('13').build(variant='exact')" \
    > $OUT/build_13_exact.txt 2>&1; log "build 13 exact rc=$?" ) &  # the kernels' check (--kernels)
wait
tail -3 $OUT/build_13.txt | tee -a $OUT/log.txt
timeout ${QUICK_TIMEOUT:-200} python3 scripts/check_backward.py --stage 13 --kernels --quick --out $OUT/bwd_quick.json \
  2>&1 | tee -a $OUT/log.txt; log "quick rc=$?"
timeout ${BENCH_TIMEOUT:-120} python3 scripts/bench_backward.py --stage 13 --shapes "1,8192,32,128;1,1024,64,128" \
  --out $OUT/bwd_speed.json 2>&1 | tee -a $OUT/log.txt; log "bench rc=$?"
timeout ${FULL_TIMEOUT:-200} python3 scripts/check_backward.py --stage 13 ${FLA:-} --out $OUT/bwd_full.json \
  2>&1 | tee -a $OUT/log.txt; log "full rc=$?"
