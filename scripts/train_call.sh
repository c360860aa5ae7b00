#!/usr/bin/env bash
# Training through kdalab.chunk_kda on a GPU in one device call (issue 38): build stages 12 and 13 (the op's
# forward and backward), the op's training tests (tests/test_op_gpu.py: gradients against fp64, opcheck with
# grads, a compiled training step against eager, FLA's chunk_kda trained through the backend), then the training
# step (scripts/bench_train.py) at the shapes in TRAIN_SHAPES, beside FLA's with FLA=1. FLA's Triton kernels autotune
# for minutes on the first call of each (H, K) family (../shared/DEVICE_NOTES.md): with FLA=1 the bench runs before
# the tests, at H = 32, K = 128, so that the test that trains FLA's chunk_kda (same family) finds them tuned.
# With FLA_LAST=1, the step beside FLA's last of all (FLA_GATES, $OUT/train_fla.json), after the variants' bench.
# On a fresh machine FLA's first step autotuned for more than 300 s at 4d6d8e6 (train_chains_4d6d8e6_log.txt in
# results/h100/stage13/), so FLA_TIMEOUT is 450 s; FLA beside more shapes than one is better a call of its own.
# With PROFILE=1, then the backward's clock64 regions per chunk (scripts/profile_backward.py), of the stage and of the
# variant builds in PROFILE_VARIANTS.
# With FLA_CHECK=1, then every gradient against fp64 beside FLA's error on the same inputs (scripts/check_backward.py
# --quick --fla). With LOSS=1, then the loss curves of a small model on FLA's kernels and on kdalab's (scripts/train_small.py).
# Results: $OUT/train_tests.txt, $OUT/train.json, $OUT/bwd_profile.json, $OUT/loss.json, $OUT/layer_train.json, $OUT/bwd_details.csv,
# $OUT/log.txt (the device returns at most 8 files: build logs and the ncu report stay in /tmp/train_call).
# Device command: KDALAB_COMMIT=<commit> bash scripts/train_call.sh   (carry .whl: nvidia-cutlass, fla-core, einops)
set -uo pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 KDALAB_BUILD=/tmp/kb OUT=${OUT:-/tmp/kdalab-out}
B=/tmp/train_call; mkdir -p $OUT $B; t0=$(date +%s); log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
log "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_fla .whl/fla_core*.whl .whl/einops*.whl \
  $(ls .whl/flash_linear_attention*.whl 2>/dev/null)  # fla.layers: FLA's KimiDeltaAttention
export PYTHONPATH=$PWD:/tmp/site:/tmp/site_fla:${PYTHONPATH:-}
( timeout 300 python3 -c "from common.stages import load_stage; load_stage('12').build()" > $B/build_12.txt 2>&1
  log "build 12 rc=$?" ) &
( timeout 300 python3 -c "from common.stages import load_next; load_next('13_backward').build()" > $B/build_13.txt 2>&1
  log "build 13 rc=$?" ) &
if [ "${FLA_CHECK:-0}" = 1 ]; then  # check_backward loads the backward as a stage: stages/13_backward (this copy only)
  [ -d stages/13_backward ] || cp -r next/13_backward stages/
  ( timeout 300 python3 -c "from common.stages import load_stage; load_stage('13').build()" > $B/build_13_stage.txt 2>&1
    log "build 13 (as a stage) rc=$?" ) &
fi
if [ "${PROFILE:-0}" = 1 ]; then  # the profile builds (clock64 regions), of the stage and of PROFILE_VARIANTS
  for v in "" ${PROFILE_VARIANTS:-}; do
    ( timeout 300 python3 -c "from common.stages import load_next; load_next('13_backward').build(profile=True, variant='$v' or None)" \
        > $B/build_13_prof_$v.txt 2>&1; log "build 13 profile $v rc=$?" ) &
  done
fi
for v in ${VARIANTS:-fp32_chains}; do  # the backward's variants (next/13_backward BACKWARD_VARIANTS), timed beside it
  ( timeout 300 python3 -c "from common.stages import load_next; load_next('13_backward').build(variant='$v')" \
      > $B/build_13_$v.txt 2>&1; log "build 13 $v rc=$?" ) &
done
wait
tests() {
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/test_op_gpu.py \
    -k "$1" > $OUT/train_tests.txt 2>&1; log "tests ($1) rc=$?"
  tail -15 $OUT/train_tests.txt | tee -a $OUT/log.txt
}
bench() {
  timeout ${BENCH_TIMEOUT:-200} python3 scripts/bench_train.py --shapes "${TRAIN_SHAPES:-1,8192,32,128}" \
    --gates "${TRAIN_GATES:-softplus,bounded}" $1 --out $OUT/train.json 2>&1 | tee -a $OUT/log.txt; log "bench rc=$?"
}
if [ "${FLA:-0}" = 1 ]; then
  bench ""
  tests "${TESTS_K:-trains}"
  timeout ${LAYER_TIMEOUT:-150} python3 scripts/bench_op.py --train --heads ${LAYER_HEADS:-32} --T 4096 --reps 10 \
    --out $OUT/layer_train.json 2>&1 | tee -a $OUT/log.txt; log "layer rc=$?"  # FLA's layer trained through the backend
else
  tests "${TESTS_K:-training}"
  bench "--no-fla $(for v in ${VARIANTS:-fp32_chains}; do printf -- '--variant %s ' $v; done)"
fi
if [ "${PROFILE:-0}" = 1 ]; then  # cycles per chunk in each region of the four kernels (B1 T8192 H32 K128)
  timeout ${PROFILE_TIMEOUT:-150} python3 scripts/profile_backward.py --out $OUT/bwd_profile.json \
    $(for v in ${PROFILE_VARIANTS:-}; do printf -- '--variant %s ' $v; done) 2>&1 | tee -a $OUT/log.txt; log "profile rc=$?"
fi
if [ "${FLA_LAST:-0}" = 1 ]; then  # the step beside FLA's, after everything else (FLA autotunes for minutes first)
  timeout ${FLA_TIMEOUT:-450} python3 scripts/bench_train.py --shapes "${TRAIN_SHAPES:-1,8192,32,128}" \
    --gates "${FLA_GATES:-softplus,bounded}" --out $OUT/train_fla.json 2>&1 | tee -a $OUT/log.txt; log "bench beside FLA rc=$?"
fi
if [ "${FLA_CHECK:-0}" = 1 ]; then  # every gradient against fp64 beside FLA's error on the same inputs (quick cases)
  timeout ${FLA_CHECK_TIMEOUT:-240} python3 scripts/check_backward.py --stage 13 --quick --fla --no-04 \
    --out $OUT/bwd_fla.json 2>&1 | tail -40 | tee -a $OUT/log.txt; log "fla check rc=$?"
fi
if [ "${LOSS:-0}" = 1 ]; then  # loss curves of a small model, FLA's kernels and kdalab's, two seeds (H = 32, K = 128)
  timeout ${LOSS_TIMEOUT:-240} python3 scripts/train_small.py --steps ${LOSS_STEPS:-300} --out $OUT/loss.json \
    2>&1 | tee -a $OUT/log.txt; log "loss rc=$?"
fi
if [ "${NCU:-0}" = 1 ]; then  # Nsight Compute on the backward's kernels (B1, the chains, B4) at B1 T8192 H32
  timeout ${NCU_TIMEOUT:-200} ncu --set full -k regex:kda_bwd -s 3 -c 3 -o $B/bwd python3 scripts/ncu_backward.py \
    > $B/ncu.txt 2>&1; log "ncu rc=$?"; tail -5 $B/ncu.txt >> $OUT/log.txt
  ncu -i $B/bwd.ncu-rep --page details --csv > $OUT/bwd_details.csv 2>&1
  ncu -i $B/bwd.ncu-rep --page details 2>&1 | grep -E "^  [a-z_]+|Duration|Throughput|Occupancy|Registers|Warp Cycles|Stall|Shared Memory Config|Block Limit" \
    | head -120 | tee -a $OUT/log.txt
fi
