"""Where stage 13's backward spends its time: clock64 cycles per chunk in each region of its four kernels (the
profile build: B1 and B4 one block per chunk, the chains one step each, timed by the block of a pair's first 32
value columns), at Kimi Linear's B1 T8192 H32 K128 on both gates, for the stage and for each named variant build.
(GPU.)

    python scripts/profile_backward.py --out $OUT/bwd_profile.json [--variant fp32_adjoint ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_softplus import gpu_inputs  # noqa: E402
from common.results import metadata, save  # noqa: E402
from common.stages import load_next  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1,8192,32,128", help="B,T,H,K (K = V)")
    ap.add_argument("--gates", default="softplus,bounded")
    ap.add_argument("--variant", action="append", default=[], help="a BACKWARD_VARIANTS build to profile too")
    args = ap.parse_args(argv)
    B, T, H, K = (int(x) for x in args.shape.split(","))
    st = load_next("13_backward")
    meta = metadata(command="python scripts/profile_backward.py " + " ".join(argv or sys.argv[1:]))
    rows = []
    for variant in [None] + args.variant:
        for gate in args.gates.split(","):
            kw = gpu_inputs(B=B, T=T, H=H, K=K, V=K, gate=gate, lower_bound=-5.0 if gate == "bounded" else None)
            st.profile(**kw, backward=True, variant=variant)  # warm-up
            prof = {r: v for r, v in st.profile(**kw, backward=True, variant=variant).items() if r.startswith("bwd:")}
            rows += [dict(stage=st.SPEC.name, variant=variant or "", gate=gate, region=r, value=float(v),
                          unit="cycles per chunk", B=B, T=T, H=H, K=K, V=K) for r, v in prof.items()]
            save(args.out, rows, meta)
            print(f"{variant or 'stage'} {gate}: " + ", ".join(f"{r[5:]} {v:,.0f}" for r, v in prof.items()), flush=True)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
