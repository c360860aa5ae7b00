"""One forward of one stage (optionally one pinned path) at one shape, for Nsight
Compute: a warm-up call, then the call to profile.

    ncu --clock-control none --set full --import-source yes -k regex:kda_fused_kernel -s 1 -c 1 \
        -o $OUT/fused python3 scripts/ncu_case.py 08 --path fused8 --shape "B8 T1024 H64 K128 V128"
    ncu -i $OUT/fused.ncu-rep --page source --csv --print-source sass > $OUT/fused_sass.csv

(-s 1 skips the warm-up's launch.) bf16 inputs, bounded gate, chunk 16, the
inputs of the benchmark (seed 0).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import bench  # noqa: E402
from common.stages import load_stage  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage")
    p.add_argument("--path", default=None, help="a name of the stage's PATHS (pinned), or the stage's rule")
    p.add_argument("--shape", default="B8 T1024 H64 K128 V128")
    args = p.parse_args(argv)
    stage = load_stage(args.stage)
    kw = bench.path_inputs(bench.parse_shape(args.shape))
    with stage.path(args.path) if args.path else nullcontext(), torch.no_grad():
        for _ in range(2):  # warm-up, then the profiled call
            stage.forward(**kw)
    torch.cuda.synchronize()
    print(f"stage {args.stage} path {args.path or 'rule'} at {args.shape}: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
