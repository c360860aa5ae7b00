#!/usr/bin/env bash
# session 16 call 2: racecheck flagged K2's 12-slot ring (recurrence_warp<64,64,2,12>). Which depths / layouts are clean?
set -uo pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
git apply .scratch/race_exp.patch || patch -p1 < .scratch/race_exp.patch
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass*.whl
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
V="r4:KDA_RING64=4; r6:KDA_RING64=6; r7:KDA_RING64=7; r8:KDA_RING64=8; r12:KDA_RING64=12; r8f:KDA_RING64=8,KDA_BARS_FIRST; r12f:KDA_RING64=12,KDA_BARS_FIRST"
K64="split1:B2 T2048 H4 K64 V64"
date
timeout 300 python3 scripts/try_variants.py --stage 12 --gate softplus --variants "$V" --cases "$K64; $K64; $K64" --budget 0.5 --out $OUT/ring_race.json > $OUT/ring_race.txt 2>&1
cat $OUT/ring_race.txt | grep -v "^\[kdalab\]" | tail -25
echo "== racecheck"; date
for v in "r4 KDA_RING64=4" "r6 KDA_RING64=6" "r7 KDA_RING64=7" "r8 KDA_RING64=8" "r12 KDA_RING64=12" "r8f KDA_RING64=8,KDA_BARS_FIRST" "r12f KDA_RING64=12,KDA_BARS_FIRST"; do
  set -- $v
  ( timeout 200 compute-sanitizer --tool racecheck --error-exitcode 3 python3 .scratch/race_variant.py $1 $2 > $OUT/race_$1.txt 2>&1; echo "rc=$?" >> $OUT/race_$1.txt ) &
done
wait
for f in $OUT/race_*.txt; do echo "$f: $(grep -E 'RACECHECK SUMMARY|rc=' $f | tr '\n' ' ') $(grep -c finite $f) runs"; done
date
