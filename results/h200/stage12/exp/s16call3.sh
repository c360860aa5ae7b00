#!/usr/bin/env bash
# session 16 call 3: stage 12 with the 8-slot K = 64 ring: build; memcheck/racecheck/synccheck (sanitize_case 12, deep ring
# wrapping); K64 speed beside FLA; the ring and path-row GPU tests, then the op's GPU tests in the time left
set -uo pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export TRITON_CACHE_DIR=/tmp/tcache; mkdir -p $TRITON_CACHE_DIR
[ -f .tune/tune.tgz ] && tar xzf .tune/tune.tgz -C $TRITON_CACHE_DIR
savetune() { (cd $TRITON_CACHE_DIR && find . -name '*.autotune.json' | tar czf $OUT/tune.tgz -T -); }
date; bash scripts/gpu_run.sh --stages 12 --phases build,sanitize > $OUT/build_sanitize.txt 2>&1
grep -E "built|sanitizer 12|FAIL" $OUT/build_sanitize.txt | tail -6; grep -h "RACECHECK SUMMARY\|ERROR SUMMARY\|finite" $OUT/sanitizer.txt | sort | uniq -c
export PYTHONPATH=$PWD:/tmp/site:/tmp/site_fla:${PYTHONPATH:-}
echo "== speed K64"; date
timeout 200 python3 scripts/bench_softplus.py --parts speed --shapes 5 --repeat 2 --out $OUT/speed_k64.json > $OUT/speed_k64.txt 2>&1; echo "rc=$?" >> $OUT/speed_k64.txt
savetune; grep -v "^\[kdalab\]" $OUT/speed_k64.txt | tail -6
echo "== tests"; date
KDALAB_STAGES=12 timeout ${PT:-200} python3 -m pytest -v -p no:cacheprovider -o addopts= -m gpu tests/test_stage_paths.py tests/test_op_gpu.py \
  -k "${PK:-k64_ring or path_rows}" > $OUT/pytest.txt 2>&1; echo "rc=$?" >> $OUT/pytest.txt
grep -cE "PASSED" $OUT/pytest.txt; grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/pytest.txt | tail -15; date
