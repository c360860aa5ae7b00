#!/usr/bin/env bash
# The summit on the H200 in one device call (issue 36): stage 12 beside stage 11 and FlashKDA on the bounded gate,
# and with the softplus gate beside stage 12 as it was while its variants were runtime pins (before) and beside
# itself from a subprocess (control). On any card but an H200 it stops at once (an H100 record exists:
# results/h100/stage12/summit_db4ccfe.json). Results: $OUT/summit.json (saved after every row) and $OUT/r.tgz.
#
# Carry (git-ignored or in .git/info/exclude), prepared here:
#   .whl/   pip download --no-deps -d .whl nvidia-cutlass==4.2.0.0
#   .flashkda/   git archive of MoonshotAI/FlashKDA at 1ce47ea: csrc/ and flash_kda/
#   .before/12_softplus   git archive 6c642ae stages/12_softplus (stage 12 before c8a9662)
# Device command: KDALAB_COMMIT=<commit> bash scripts/summit_call.sh   (carry .whl .flashkda .before)
set -uo pipefail
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$GPU" in *H200*) ;; *) echo "not an H200: $GPU"; exit 0 ;; esac
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 KDALAB_BUILD=/tmp/kb OUT=${OUT:-/tmp/kdalab-out}
R=/tmp/summit_call; mkdir -p $R $OUT; pack() { tar czf $OUT/r.tgz -C $R . ; }
t0=$(date +%s); log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $R/call.txt; }
log "GPU: $GPU"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass*.whl
export PYTHONPATH=/tmp/site:$PWD
( KDALAB_STAGES_DIR=$PWD/.before KDALAB_BUILD=/tmp/kdalab_build_before timeout 250 python3 -c \
  "from common.stages import load_stage; load_stage('12')" > $R/before_build.txt 2>&1; log "before build rc=$?" ) &
timeout 250 bash scripts/gpu_run.sh --stages 11,12 --phases build,flashkda > $R/gpu_run.txt 2>&1; log "gpu_run rc=$?"
wait; pack
timeout ${SUMMIT_TIMEOUT:-240} python3 scripts/bench_summit.py --rounds ${SUMMIT_ROUNDS:-3} --before .before --control \
  --out $OUT/summit.json > $R/summit.log 2>&1; log "summit rc=$?"
pack
