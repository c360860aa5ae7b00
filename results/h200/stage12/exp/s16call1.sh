#!/usr/bin/env bash
# session 16 call 1: stage 12 at 25a6d0c: build; H96 speed beside FLA; checks (with FLA); memcheck/racecheck/synccheck
set -uo pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export TRITON_CACHE_DIR=/tmp/tcache; mkdir -p $TRITON_CACHE_DIR
savetune() { (cd $TRITON_CACHE_DIR && find . -name '*.autotune.json' | tar czf $OUT/tune.tgz -T -); }
date; bash scripts/gpu_run.sh --stages 12 --phases build > $OUT/build.txt 2>&1; tail -3 $OUT/build.txt
export PYTHONPATH=$PWD:/tmp/site:/tmp/site_fla:${PYTHONPATH:-}
echo "== speed H96"; date
timeout 260 python3 scripts/bench_softplus.py --parts speed --shapes 3 --repeat 2 --out $OUT/speed_h96.json > $OUT/speed_h96.txt 2>&1; echo "rc=$?" >> $OUT/speed_h96.txt
savetune; grep -v "^\[kdalab\]" $OUT/speed_h96.txt | tail -12
echo "== checks, sanitize"; date
bash scripts/gpu_run.sh --stages 12 --phases checks,sanitize --fla > $OUT/checks_sanitize.txt 2>&1
grep -E "checks|sanitizer|FAIL" $OUT/checks_sanitize.txt | tail -20; date
