"""A stage's backward timed at a few shapes: the forward and the backward (common.bench.bench_stage:
graph replay where a call is short), each backward kernel's GPU time (torch.profiler) and the
backward's peak memory, and with --fla FLA's chunk_kda forward and backward beside it in the same
call. Rows are saved after every shape. (GPU.)

    python scripts/bench_backward.py --stage 13 --gate softplus --out $OUT/bwd_speed.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common import bench  # noqa: E402
from common.inputs import make_inputs  # noqa: E402
from common.results import metadata  # noqa: E402
from common.stages import load_stage  # noqa: E402

# Kimi Linear's shapes (issue 38) and the ladder's first benchmark shape.
SHAPES = [dict(B=1, T=8192, H=32, K=128, V=128), dict(B=4, T=4096, H=32, K=128, V=128),
          dict(B=1, T=8192, H=96, K=128, V=128), dict(B=1, T=1024, H=64, K=128, V=128)]


def parse_shape(s: str) -> dict:
    B, T, H, K = (int(x) for x in s.split(","))
    return dict(B=B, T=T, H=H, K=K, V=K)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", default="13")
    ap.add_argument("--gate", default="softplus", choices=("softplus", "bounded"))
    ap.add_argument("--shapes", default=None, help="B,T,H,K;... (default: Kimi's and B1 T1024 H64)")
    ap.add_argument("--fla", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes.split(";")] if args.shapes else SHAPES
    stage = load_stage(args.stage)
    rec = dict(meta=metadata(), gate=args.gate, rows=[])
    t0 = time.time()
    for shape in shapes:
        for sid in [args.stage] + (["fla"] if args.fla else []):
            try:
                row = bench.bench_stage(sid, shape, gate=args.gate, backward=True, budget_s=0.5)
                if sid != "fla":
                    kw = make_inputs(shape["B"], shape["T"], shape["H"], shape["K"], shape["V"], seed=0,
                                     dtype=torch.bfloat16, device="cuda", gate=args.gate, chunk_size=16)
                    fn = bench._backward_fn(stage, kw, "cuda")
                    row["bwd_kernels"] = bench.kernel_times(fn, warmup=2, calls=5)
                    row["bwd_peak_mb"] = bench.peak_mb(fn)
            except Exception as e:  # noqa: BLE001
                row = dict(stage=sid, **shape, error=f"{type(e).__name__}: {e}")
            rec["rows"].append(row)
            print(f"[{time.time() - t0:6.1f} s] {sid} {shape}: fwd {row.get('fwd_ms')} ms, bwd {row.get('bwd_ms')} ms,"
                  f" graph {row.get('bwd_graph_ms')}, peak {row.get('bwd_peak_mb')} MB {row.get('error', '')}",
                  flush=True)
            Path(args.out).write_text(json.dumps(rec, indent=1, default=str))


if __name__ == "__main__":
    main()
