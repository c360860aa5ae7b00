"""Region profiles (clock64 cycles per block, the profile build) of stage 11 and the last stage on the
bounded gate and of the last stage with the softplus gate, h0 present, at three shapes: where the
softplus gate's products cost, region by region, beside the bounded gate's instantiation.

    python scripts/profile_gates.py $OUT/profiles_gates.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_softplus import gpu_inputs  # noqa: E402
from common.results import metadata, save  # noqa: E402
from common.stages import last_stage, load_stage  # noqa: E402

SHAPES = [dict(B=2, T=2048, H=4, K=64, V=64), dict(B=1, T=4096, H=16, K=128, V=128),
          dict(B=8, T=1024, H=64, K=128, V=128)]


def main(argv=None) -> int:
    out = Path((argv if argv is not None else sys.argv[1:])[0])
    meta = metadata(command="python scripts/profile_gates.py " + str(out))
    rows = []
    for shp in SHAPES:
        for sid, gate in (("11", "bounded"), (last_stage(), "bounded"), (last_stage(), "softplus")):
            st = load_stage(sid)
            kw = gpu_inputs(**shp, gate=gate, lower_bound=-5.0 if gate == "bounded" else None)
            with torch.no_grad():
                st.profile(**kw)  # warm-up
                prof = st.profile(**kw)
            rows += [dict(stage=st.SPEC.name, gate=gate, region=reg, value=float(val), unit="cycles", **shp)
                     for reg, val in prof.items()]
            save(out, rows, meta)
            print(sid, gate, shp, {k: round(v) for k, v in prof.items()}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
