"""A small forward + backward of one stage (or one of its ablation variants),
for compute-sanitizer:

    compute-sanitizer --tool memcheck python scripts/sanitize_case.py 02
    compute-sanitizer --tool racecheck python scripts/sanitize_case.py 06 no_load_warp

A stage with several paths (the PATHS of stages 08 and 09) runs each of them, pinned, as well, at K = V = 64 and 128,
its split path also in segments of 3 chunks. The packed-sequence stages (11, 12) run ragged packed calls on every
path and the hybrid (long sequences split beside the fused kernel). Stage 12 runs its extreme softplus cases
(pairwise products in the wide chunks) on every path too.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import checks  # noqa: E402
from common.inputs import make_cotangents  # noqa: E402
from common.ablation import variant  # noqa: E402
from common.stages import load_stage  # noqa: E402

sid = sys.argv[1]
stage = load_stage(sid) if len(sys.argv) < 3 else variant(sid, sys.argv[2])
spec = stage.SPEC
K, V = (64, 64) if spec.head_dims else (32, 24)  # the smallest head size the stage supports
T = 150  # several chunks at any chunk size, and a tail
kw = checks.stage_inputs(spec, 1, T, 2, K, V, device="cuda")
res = checks.run(stage.forward, kw, "cuda", backward=spec.backward,
                 cotangents=make_cotangents((1, T, 2, kw["v"].shape[-1]), (1, 2, kw["k"].shape[-1],
                                                                                    kw["v"].shape[-1])))
if spec.compute_dtype == torch.bfloat16:
    # many heads as well: the tensor-core stages pick a wider recurrence block when
    # B*H*V/32 fills the GPU twice over, so both variants run under the sanitizer
    kw2 = checks.stage_inputs(spec, 2, 40, 70, K, V, seed=1, device="cuda")
    res.update({k + " (B*H = 140)": v for k, v in checks.run(stage.forward, kw2, "cuda", backward=False).items()})
lone = getattr(stage, "LONE_RING64", None)
if lone:  # K = 64 with few heads: K2's deeper ring (its blocks fit the SMs), every slot reused twice over
    kw3 = checks.stage_inputs(spec, 1, 16 * (2 * lone + 3), 2, 64, 64, seed=4, device="cuda")
    res.update({k + " (deep ring wraps)": v for k, v in checks.run(stage.forward, kw3, "cuda", backward=False).items()})
if getattr(stage, "PATHS", None):  # a stage with several paths (08, 09): each one, pinned, at K = V = 64 and 128
    kw128 = checks.stage_inputs(spec, 1, 40, 2, 128, 128, seed=2, device="cuda")  # a tail chunk too
    for name, (_, ncw) in stage.PATHS.items():
        for kwp in (kw, kw128):
            if 16 * ncw > kwp["v"].shape[-1]:
                continue
            with stage.path(name):
                res.update({f"{k} ({name}, K={kwp['k'].shape[-1]})": v
                            for k, v in checks.run(stage.forward, kwp, "cuda", backward=False).items()})
            if name.startswith("split") and hasattr(stage, "SEGMENT_CHUNKS"):  # in segments of 3 chunks too
                with stage.path(name, segment_chunks=3):
                    res.update({f"{k} ({name} in segments, K={kwp['k'].shape[-1]})": v
                                for k, v in checks.run(stage.forward, kwp, "cuda", backward=False).items()})
if spec.varlen:  # packed sequences (stage 11 on): every path, ragged
    # lengths with empty and sub-chunk sequences, both state layouts, the split path in segments of 3 chunks too
    for case in checks.varlen_cases(big=False)[:3]:
        inp = checks.varlen_inputs(case, device="cuda")
        for name in [None] + [n for n, (_, ncw) in stage.PATHS.items() if 16 * ncw <= case.V]:
            for seg in ((None, 3) if name and name.startswith("split") else (None,)):
                with stage.path(name, segment_chunks=seg):
                    got = checks.run_varlen(stage.forward, inp, "cuda")
                res.update({f"{k} (packed {case.lengths}, {name or 'rule'}, seg {seg})": v for k, v in got.items()})
    # the hybrid: runs of long sequences on the split path (segments of 3 chunks) beside the fused kernel
    for case in checks.HYBRID_CASES:
        with stage.path("fused8" if case.V == 128 else "fused4", segment_chunks=3, long_from=checks.HYBRID_FROM):
            got = checks.run_varlen(stage.forward, checks.varlen_inputs(case, device="cuda"), "cuda")
        res.update({f"{k} (hybrid {case.lengths})": v for k, v in got.items()})
if hasattr(stage, "pairwise"):  # stage 12: the pairwise products, at the gate's extremes (wide and narrow
    # chunks side by side: each chunk picks its products) on every path, and pinned in every chunk
    for case in [c for c in checks.tc_softplus_cases() if c.extreme]:
        inp = checks.case_inputs(case, "cuda", torch.bfloat16)
        for name in [None] + [n for n, (_, ncw) in stage.PATHS.items() if 16 * ncw <= case.V]:
            with stage.path(name):
                res.update({f"{k} ({case.id}, {name or 'rule'})": v
                            for k, v in checks.run(stage.forward, inp, "cuda", backward=False).items()})
        with stage.pairwise(True):
            res.update({f"{k} ({case.id}, pairwise pinned)": v
                        for k, v in checks.run(stage.forward, inp, "cuda", backward=False).items()})
torch.cuda.synchronize()
bad = [n for n, t in res.items() if t is not None and not torch.isfinite(t).all()]
print(f"stage {spec.name}: {'non-finite ' + str(bad) if bad else 'all outputs finite'}")
sys.exit(1 if bad else 0)
