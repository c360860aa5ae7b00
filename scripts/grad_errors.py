"""Per-output errors of an fp32 stage, of its ablation variants and of another
build of its sources, beside the float32 token loop: which gradient moved, and
is it the kernel or the float32 floor of the case? (GPU.)

    python scripts/grad_errors.py --stage 04 --ablations --src old=.exp/04_old \\
        --cases "B3 T100 H45 K32 V32; B1 T1000 H135 K32 V32" --seeds 0,1,2 --out $OUT/grad_errors.json

Every case runs with the softplus gate and an initial state unless --gate / --no-h0
say otherwise, at the stage's default chunk or --chunk. Each row is one (variant,
case, output): its error against the fp64 token loop, as common.checks measures it
(the reduced gradients dA_log and ddt_bias against the size of their terms; err_plain
is the plain relative error), its difference from the stage's own build (vs_stage,
bitwise_stage), and "fp32 loop": the same token loop evaluated in float32
(common.reference with dtype float32), the floor any float32 evaluation of the case
sits near.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common import bench, checks, extrun  # noqa: E402
from common.build import load_extension  # noqa: E402
from common.contract import prepare  # noqa: E402
from common.inputs import make_cotangents  # noqa: E402
from common.metrics import rel_err  # noqa: E402
from common.reference import kda_reference  # noqa: E402
from common.results import metadata  # noqa: E402
from common.stages import load_stage  # noqa: E402


class Built:
    """A stage-like object (SPEC, forward) running one extension of a stage's sources."""

    def __init__(self, stage, name, ext_fn):
        self.stage, self.ext_fn = stage, ext_fn
        self.SPEC = dataclasses.replace(stage.SPEC, name=f"{stage.SPEC.name}[{name}]")

    def forward(self, q, k, v, g, beta, **kw):
        c = prepare(self.stage.SPEC, q, k, v, g, beta, **kw)
        return extrun.run(self.ext_fn(), self.stage.SPEC, c)


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU for stages 00-01


def outputs(fn, inp, cot, device):
    return checks.run(fn, inp, device, backward=True, cotangents=cot)


def fp32_loop(**kw):
    """The token loop of common.reference evaluated in float32 (its default is float64)."""
    return kda_reference(**kw, dtype=torch.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default="04")
    p.add_argument("--ablations", action="store_true", help="also each of the stage's ABLATIONS")
    p.add_argument("--src", action="append", default=[], help="NAME=DIR: the stage built from DIR's sources")
    p.add_argument("--cases", required=True, help="shapes 'B.. T.. H.. K.. V..' separated by ';'")
    p.add_argument("--seeds", default="0")
    p.add_argument("--gate", default="softplus")
    p.add_argument("--no-h0", action="store_true")
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp/kdalab-out")) / "grad_errors.json"))
    args = p.parse_args(argv)

    stage = load_stage(args.stage)
    variants = [("stage", stage)]
    if args.ablations:
        variants += [(a.name, Built(stage, a.name, lambda n=a.name: stage.build(ablation=n)))
                     for a in stage.ABLATIONS]
    for item in args.src:
        name, _, d = item.partition("=")
        here = ROOT / d
        variants.append((name, Built(stage, name, lambda h=here, n=name: load_extension(
            h, stage.SPEC.name, stage.SOURCES, cuda=True, variant=n, defines=(f"KDA_VARIANT_{n}",), quiet=True))))
    t0 = time.time()
    for _, v in variants:  # build first, so that a compile error shows before any case
        (v.build if v is stage else v.ext_fn)()
    print(f"built {len(variants)} variants in {time.time() - t0:.0f} s", flush=True)

    rows = []
    chunk = args.chunk or stage.SPEC.default_chunk
    for shape_text in filter(None, (s.strip() for s in args.cases.split(";"))):
        s = bench.parse_shape(shape_text)
        for seed in (int(x) for x in args.seeds.split(",")):
            case = checks.Case(s["B"], s["T"], s["H"], s["K"], s["V"], chunk=chunk, gate=args.gate,
                               lower_bound=-5.0 if args.gate == "bounded" else None, h0=not args.no_h0, seed=seed)
            inp = checks.case_inputs(case)
            cot = make_cotangents((case.B, case.T, case.H, case.V), (case.B, case.H, case.K, case.V), seed=seed)
            ref = checks.run(kda_reference, inp, DEV, backward=True, cotangents=cot, dtype=torch.float64)
            scales = checks.reduction_scales(inp, cot)
            got = {"fp32 loop": outputs(fp32_loop, inp, cot, DEV)}
            for name, v in variants:
                got[name] = outputs(v.forward, inp, cot, DEV)
            found = {}
            for name, res in got.items():
                errs = found.setdefault(name, {})
                for out, x in res.items():
                    if x is None or ref[out] is None:
                        continue
                    errs[out] = checks._err(x, ref[out], scales.get(out))
                    rows.append(dict(variant=name, case=case.id, output=out, err_ref=errs[out],
                                     err_plain=rel_err(x, ref[out]),
                                     vs_stage=rel_err(x, got["stage"][out]) if name != "stage" else None,
                                     bitwise_stage=bool(torch.equal(x.cpu(), got["stage"][out].cpu()))))
            worst = {name: max(errs, key=errs.get) for name, errs in found.items()}
            print(case.id, " ".join(f"{n}: {w} {found[n][w]:.2e}" for n, w in worst.items()), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = metadata(command="python scripts/grad_errors.py " + " ".join(argv or sys.argv[1:]))
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out} ({len(rows)} rows, {time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
