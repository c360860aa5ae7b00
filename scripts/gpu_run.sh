#!/usr/bin/env bash
# On the H200 (device tool): install carried wheels, then run scripts/gpu_run.py.
#   bash scripts/gpu_run.sh --stages 02,03,04 --fla
#   bash scripts/gpu_run.sh --stages 05,06,07 --fla --flashkda   # FlashKDA built from .flashkda/ (carried) first
# Records name the commit from KDALAB_COMMIT when set (common.results.metadata): set it in the device command
# (KDALAB_COMMIT=<hash, here> bash scripts/gpu_run.sh ...), since the device copy's git may name an older commit.
# FLA's autotune results (FLA_CACHE_RESULTS=1, its default) land in TRITON_CACHE_DIR: to skip the autotune in a
# later call (about 100 s per head count), tar the *.autotune.json files there to $OUT and carry them back as
# .tune/tune.tgz (git-ignored; carry ".tune"): this script then unpacks it into TRITON_CACHE_DIR first.
set -uo pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export OUT=${OUT:-/tmp/kdalab-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  # fla-core (and flash-linear-attention's fla.layers, einops) apart, in /tmp/site_fla: gpu_run.py puts it on the path only where FLA is asked for (--fla, notebooks-fla)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $(ls .whl/*.whl | grep -v -e fla_core -e flash_linear_attention -e einops) \
      && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  if ls .whl/fla_core*.whl >/dev/null 2>&1; then  # with fla.layers (flash_linear_attention) and einops when carried
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_fla \
        $(ls .whl/*.whl | grep -e fla_core -e flash_linear_attention -e einops)
  fi
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -f .tune/tune.tgz ] && [ -z "${TRITON_CACHE_DIR:-}" ]; then
  export TRITON_CACHE_DIR=/tmp/tcache
  mkdir -p "$TRITON_CACHE_DIR" && tar xzf .tune/tune.tgz -C "$TRITON_CACHE_DIR"
fi
if [ "${KDALAB_KEEP_BUILDS:-0}" = 1 ]; then
  # each call re-sends the tree with fresh mtimes, which would rebuild every stage: date the sources back so
  # that ninja keeps the builds of the last call (only valid when no source changed between the calls)
  find stages common/include -type f -exec touch -d '2020-01-01 00:00' {} +
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$OUT/log.txt"
python3 scripts/gpu_run.py "$@"
