"""A small forward + backward of one stage, for compute-sanitizer:

    compute-sanitizer --tool memcheck python scripts/sanitize_case.py 02
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import checks  # noqa: E402
from common.inputs import make_cotangents  # noqa: E402
from common.stages import load_stage  # noqa: E402

sid = sys.argv[1]
stage = load_stage(sid)
spec = stage.SPEC
if spec.compute_dtype == torch.bfloat16:
    kw = checks.make_inputs(1, 45, 2, 64, 64, seed=0, device="cuda", gate="bounded", chunk_size=16,
                            dtype=torch.bfloat16)
else:
    kw = checks.make_inputs(1, 45, 2, 32, 24, seed=0, device="cuda", chunk_size=16)
res = checks.run(stage.forward, kw, "cuda", backward=spec.backward,
                 cotangents=make_cotangents((1, 45, 2, kw["v"].shape[-1]), (1, 2, kw["k"].shape[-1],
                                                                                    kw["v"].shape[-1])))
torch.cuda.synchronize()
bad = [n for n, t in res.items() if t is not None and not torch.isfinite(t).all()]
print(f"stage {spec.name}: {'non-finite ' + str(bad) if bad else 'all outputs finite'}")
sys.exit(1 if bad else 0)
