"""Record what ptxas gives every kernel instantiation of a stage: registers, stack, spill bytes
(``nvcc -Xptxas -v``, sm_90, the stage's own flags; compiled here, no GPU needed).

    python scripts/ptxas_record.py                # every CUDA stage -> results/cpu/ptxas_<stage>.json
    python scripts/ptxas_record.py --stage 11

Each row names the instantiation (kernel, its template arguments, and for the prepare's variants
the products and how u is formed) and, for the last stage, whether the op launches it with its
defaults. The record carries the hash of the sources it was compiled from: a notebook's resources
table (common.notebook.resources) reads it instead of compiling the stage a second time, and
tests/test_ptxas_record.py fails when the sources change without a new record, and when an
instantiation the op launches spills.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.build import resource_usage, sources_hash  # noqa: E402
from common.paths import RESULTS_DIR, STAGES_DIR  # noqa: E402
from common.results import metadata  # noqa: E402
from common.stages import STAGE_DIRS, last_stage, load_stage, normalize, stage_ids  # noqa: E402

PRODUCTS = {0: "factored", 1: "pairwise", 2: "as needed"}  # kda.h KdaProducts
# What the op launches without a pin: a bounded gate Prep<factored, u once>, a gate without a bound
# Prep<as needed, u in halves> (kda.cu with_prep, the binding's defaults).
DEFAULT_PREP = {(0, False), (2, True)}


def describe(kernel: str, op: bool = True) -> dict:
    """The instantiation's parts: kernel name, its numeric template arguments, Prep's two arguments;
    with ``op`` (the last stage), whether the op launches it with its defaults."""
    m = re.match(r"void kda_stage::(\w+)<(.*)>$", kernel)
    if not m:
        return dict(name=re.sub(r"^void |\(.*$", "", kernel).split("::")[-1])
    name, args = m.group(1), m.group(2)
    prep = re.search(r"Prep<(\d+), (true|false)\s*>", args)
    nums = [int(x) for x in re.findall(r"\b(\d+)\b", re.sub(r"kda_stage::Prep<[^>]*>", "", args))]
    out = dict(name=name, template=nums)
    if prep:
        p, u = int(prep.group(1)), prep.group(2) == "true"
        out.update(products=PRODUCTS[p], u_halves=u)
        if op:
            out["op_default"] = (p, u) in DEFAULT_PREP
    elif op:
        out["op_default"] = name != "kda_frag_check_kernel"  # the recurrence runs for every gate; the check kernel is the tests'
    return out


def arch_of(stage) -> str:
    """The architecture the stage's ptxas report is for (common.notebook.resources): sm_90a for a stage
    built for it, else sm_90 (the H200)."""
    return "sm_90a" if stage.SPEC.extra.get("sm90a") else "sm_90"


def record(sid: str, out: Path | None = None) -> Path:
    stage = load_stage(sid)
    d = STAGES_DIR / STAGE_DIRS[sid]
    flags = list(getattr(stage, "CUDA_FLAGS", ()))
    rows = resource_usage(d, stage.SOURCES, arch=arch_of(stage), cutlass=stage.SPEC.extra.get("cutlass", False),
                          extra_flags=flags)
    op = sid == last_stage()
    rows = [dict(r, **describe(r["kernel"], op)) for r in rows]
    meta = metadata(command=f"python scripts/ptxas_record.py --stage {sid}", device="cpu")
    meta.update(arch=arch_of(stage), sources_hash=sources_hash(d), stage=STAGE_DIRS[sid], flags=flags,
                what="ptxas -v of every kernel instantiation in the stage's normal build: registers per thread, "
                     "static shared memory, stack frame and spill bytes"
                     + ("; op_default: launched by kdalab.chunk_kda with no pin" if op else ""))
    out = out or RESULTS_DIR / "cpu" / f"ptxas_{STAGE_DIRS[sid]}.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    spills = [r["kernel"] for r in rows if r["spill_stores"] or r["spill_loads"]]
    print(f"{STAGE_DIRS[sid]}: {len(rows)} instantiations"
          + (f", {sum(r.get('op_default', False) for r in rows)} launched by the op's defaults" if op else "")
          + f"; {len(spills)} spill{': ' + ', '.join(spills) if spills else ''}; wrote {out}", flush=True)
    return out


def cuda_stages() -> list[str]:
    return [s for s in stage_ids() if "cuda" in load_stage(s).SPEC.devices and getattr(load_stage(s), "SOURCES", None)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", default=None, help="one stage (default: every CUDA stage)")
    p.add_argument("--out", default=None, help="with --stage: default results/cpu/ptxas_<stage>.json")
    args = p.parse_args()
    if args.stage:
        record(normalize(args.stage), Path(args.out) if args.out else None)
    else:
        for sid in cuda_stages():
            record(sid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
