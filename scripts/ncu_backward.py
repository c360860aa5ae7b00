"""One training backward of kdalab.chunk_kda (next/13_backward's kernels) at one shape, for Nsight Compute: a
warm-up step, then the step to profile (its forward, then its backward's kernels: B1 prepare, the chains, B4).

    ncu --set full -k regex:kda_bwd -s 3 -c 3 -o $OUT/bwd python3 scripts/ncu_backward.py --shape "1,8192,32,128"
    ncu -i $OUT/bwd.ncu-rep --page details --csv > $OUT/bwd_details.csv

(-s 3 skips the warm-up's three backward launches.) Kimi Linear's flags, the softplus gate, inputs of
scripts/bench_train.py (seed 0). (GPU.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kdalab  # noqa: E402
from bench_train import NAMES, inputs, step_fn  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1,8192,32,128", help="B,T,H,K (K = V)")
    p.add_argument("--gate", default="softplus", choices=("softplus", "bounded"))
    args = p.parse_args(argv)
    B, T, H, K = (int(x) for x in args.shape.split(","))
    kw = inputs(B, T, H, K, args.gate)
    do = torch.randn(B, T, H, K, device="cuda").to(torch.bfloat16)
    step = step_fn(kdalab.chunk_kda, kw, do)
    for _ in range(2):  # warm-up, then the profiled step
        grads = step()
    torch.cuda.synchronize()
    print(f"backward at B{B} T{T} H{H} K{K} ({args.gate}): done, |d{NAMES[0]}| = {grads[0].float().norm():.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
