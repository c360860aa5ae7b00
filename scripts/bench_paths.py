"""A stage's paths side by side on the H200 (stage 08 or 09, --stage; the last one
by default): every path of the stage (split with 1 or 2 compute warps per K2
block, fused with 1, 2, 4 or V/16), the stage's rule, the previous stage and
FlashKDA (when importable), at every benchmark shape plus B1 T32768 H16. Per
row: GPU time by CUDA-graph replay, peak memory above the inputs during one
call, and whether o and the final state are bitwise equal to the previous
stage's (its same path where it has one). This is the measurement the stage's
rule (kda_fwd_plan) was chosen from; the bench-tc phase of gpu_run.py times the
rule beside the other stages.

    python scripts/bench_paths.py [--stage 09] [--shapes "B1 T1024 H64 K128 V128;..."] [--out $OUT/paths.json]
    python scripts/bench_paths.py --profile     # also clock64 regions of the fused path
    python scripts/bench_paths.py --segment-chunks 128   # the split path in segments of 128 chunks

Needs a GPU and the stage and the one before it built (gpu_run.py's build phase). The measurement itself is
common.bench.path_rows (the notebooks of stages 08 and 09 call it too, live on a GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import bench  # noqa: E402
from common.fla_ref import flashkda_available  # noqa: E402
from common.results import metadata, save  # noqa: E402
from common.stages import normalize, path_stages, previous  # noqa: E402

LONG_SHAPE = dict(B=1, T=32768, H=16, K=128, V=128)


def parse_shapes(text):
    return [bench.parse_shape(item) for item in text.split(";") if item.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default=None, help="a stage with PATHS (default: the last one)")
    p.add_argument("--shapes", default=None)
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp/kdalab-out")) / "paths.json"))
    p.add_argument("--budget", type=float, default=0.4, help="seconds of timing per row")
    p.add_argument("--profile", action="store_true", help="clock64 regions of every path of the stage per shape")
    p.add_argument("--segment-chunks", type=int, default=None,
                   help="pin the split path's segment length (chunks) for every row of the stage")
    args = p.parse_args(argv)
    sid = normalize(args.stage) if args.stage else path_stages()[-1]
    pid = previous(sid)
    shapes = parse_shapes(args.shapes) if args.shapes else bench.TC_GPU_SHAPES + [LONG_SHAPE]
    fk_ok, fk_why = flashkda_available()
    print(f"FlashKDA: {'importable' if fk_ok else fk_why}", flush=True)
    rows, meta = [], metadata(command=f"python scripts/bench_paths.py --stage {sid}" + (" --profile" if args.profile else "")
                              + (f" --segment-chunks {args.segment_chunks}" if args.segment_chunks else ""))
    for shape in shapes:
        label, t0 = bench.shape_label(shape), [time.time()]

        def on_row(row):
            rows.append(row)
            ms = row.get("fwd_graph_ms") or row.get("fwd_ms")
            print(f"{label} {row['stage']:8s} {row['path']:7s} {('%.4f ms' % ms) if ms else row.get('error')} "
                  f"peak {row.get('peak_mb')} MB eq{pid}={row.get(f'equal_to_{pid}')} ({time.time() - t0[0]:.1f} s)",
                  flush=True)
            save(Path(args.out), rows, meta)
            t0[0] = time.time()

        bench.path_rows(sid, shape, budget_s=args.budget, flashkda=fk_ok, profile=args.profile, on_row=on_row,
                        segment_chunks=args.segment_chunks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
