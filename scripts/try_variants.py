"""A stage (the last, 12, unless --stage says) built several ways, timed side by side in one GPU call: the
experiments behind docs/PERF_NOTES.md (one question per call, every candidate
measured beside the stage as it is, on the same inputs).

A variant is the stage's sources with extra preprocessor defines, or with its
kda.cu replaced by another file (an experiment not yet in the stage):

    python scripts/try_variants.py \\
        --variants "regs120:KDA_PREP_REGS=120; ldsmb:@.exp/ldsmb.cu" \\
        --cases "fused8:B8 T1024 H64 K128 V128; fused4:B1 T8192 H64 K128 V128" \\
        [--stage 12] [--gate softplus] [--profile] [--out $OUT/variants.json]

The stage itself ("stage") is always the first variant. Every variant is built
in its own process (in parallel), then each case runs with the path pinned:
checked against the stage (o and the final state, relative difference), timed
by CUDA-graph replay (common.bench), and with --profile its clock64 regions.
Needs a GPU; the builds alone run anywhere (--build-only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import bench  # noqa: E402
from common.build import load_extension  # noqa: E402
from common.results import metadata  # noqa: E402
from common.stages import last_stage, load_stage  # noqa: E402

STAGE = last_stage()  # the last stage: its variants are the candidates for the next change
WORK = ROOT / "build" / "variants"  # copies of the stage's sources for file variants


def parse_variants(text: str) -> list[tuple[str, str | None, tuple[str, ...]]]:
    """"name:DEF=1,DEF2; name2:@file.cu[,DEF]" -> [(name, file or None, defines)]."""
    out = [("stage", None, ())]
    for item in filter(None, (x.strip() for x in (text or "").split(";"))):
        name, _, spec = item.partition(":")
        parts = [x.strip() for x in spec.split(",") if x.strip()]
        src = parts.pop(0)[1:] if parts and parts[0].startswith("@") else None
        if not name.isidentifier() or name == "stage":
            raise ValueError(f"variant name must be an identifier other than 'stage', got {name!r}")
        out.append((name, src, tuple(parts)))
    return out


def parse_cases(text: str) -> list[tuple[str, dict]]:
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        path, _, shape = item.partition(":")
        out.append((path.strip(), bench.parse_shape(shape)))
    return out


def build_variant(stage, name, src, defines, profile):
    """The extension of one variant (the stage's own build for "stage")."""
    if name == "stage":
        return stage.build(profile=profile)
    here = Path(stage.__file__).resolve().parent
    if src is not None:  # the stage's directory with kda.cu replaced
        d = WORK / name
        d.mkdir(parents=True, exist_ok=True)
        for f in here.iterdir():  # every source of the stage (kda.cu includes its kernel files)
            if f.suffix in (".cu", ".cuh", ".h", ".cpp"):
                shutil.copy2(f, d / f.name)
        shutil.copy2(ROOT / src, d / "kda.cu")
        here = d
    # every variant gets a define, so that it has its own module and build directory
    defs = defines or (f"KDA_VARIANT_{name}",)
    return load_extension(here, stage.SPEC.name, stage.SOURCES, cuda=True, cutlass=True, profile=profile,
                          extra_cuda_cflags=stage.CUDA_FLAGS, sm90a=stage.SPEC.extra.get("sm90a", False),
                          variant=name, defines=defs, quiet=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="")
    p.add_argument("--cases", default="fused8:B8 T1024 H64 K128 V128")
    p.add_argument("--stage", default=STAGE, help="the stage whose variants these are (default: the last)")
    p.add_argument("--gate", default="bounded", choices=("bounded", "softplus"),
                   help="the inputs' gate (common.bench.path_inputs)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--budget", type=float, default=0.4)
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp/kdalab-out")) / "variants.json"))
    p.add_argument("--build-only", default=None, help="(internal) build this one variant and exit")
    args = p.parse_args(argv)
    variants = parse_variants(args.variants)
    stage = load_stage(args.stage)

    if args.build_only is not None:
        name, src, defs = next(v for v in variants if v[0] == args.build_only)
        for prof in (False, True) if args.profile else (False,):
            build_variant(stage, name, src, defs, prof)
        return 0

    t0 = time.time()
    procs = [(v[0], subprocess.Popen([sys.executable, __file__, "--stage", args.stage, "--variants", args.variants,
                                      "--build-only", v[0]]
                                     + (["--profile"] if args.profile else []), cwd=ROOT))
             for v in variants]
    failed = [n for n, pr in procs if pr.wait() != 0]
    print(f"built {len(variants) - len(failed)} of {len(variants)} variants in {time.time() - t0:.0f} s"
          + (f"; FAILED: {failed}" if failed else ""), flush=True)

    import torch

    rows, meta = [], metadata(command="python scripts/try_variants.py " + " ".join(argv or sys.argv[1:]))
    own_build = stage.build
    for path, shape in parse_cases(args.cases):
        # a fresh allocation per case (list a case twice to see whether the time depends on where it lies)
        kw = bench.path_inputs(shape, gate=args.gate)
        ref = None
        for name, src, defs in variants:
            if name in failed:
                continue
            row = dict(variant=name, path=path, **shape)
            exts = {prof: build_variant(stage, name, src, defs, prof) for prof in
                    ((False, True) if args.profile else (False,))}
            stage.build = lambda profile=False, verbose=False, ablation=None, _e=exts: _e.get(profile, _e[False])
            try:
                with stage.path(path):
                    def f():
                        with torch.no_grad():
                            return stage.forward(**kw)
                    o, S = f()
                    if ref is None:
                        ref = (o.float(), S.float())
                    row["err_vs_stage"] = max(float((o.float() - ref[0]).norm() / ref[0].norm()),
                                              float((S.float() - ref[1]).norm() / ref[1].norm()))
                    row.update({"fwd_" + k: v for k, v in bench._timed(f, "cuda", args.budget, True).items()})
                    if args.profile:
                        row["profile"] = stage.profile(**kw)
            except Exception as e:  # noqa: BLE001 -- record why a variant does not run
                row["error"] = str(e).splitlines()[0][:300]
            finally:
                stage.build = own_build
            rows.append(row)
            ms = row.get("fwd_graph_ms") or row.get("fwd_ms")
            print(f"{path:7s} {bench.shape_label(shape):28s} {name:10s} "
                  f"{('%.4f ms' % ms) if ms else row.get('error')} err_vs_stage {row.get('err_vs_stage')}",
                  flush=True)
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
