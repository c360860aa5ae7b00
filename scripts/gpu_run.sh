#!/usr/bin/env bash
# On the H200 (device tool): install carried wheels, then run scripts/gpu_run.py.
#   bash scripts/gpu_run.sh --stages 02,03,04 --fla
set -uo pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export OUT=${OUT:-/tmp/kdalab-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$OUT/log.txt"
python3 scripts/gpu_run.py "$@"
