"""Record what ptxas gives every kernel instantiation of a stage: registers, stack, spill bytes
(``nvcc -Xptxas -v``, sm_90, the stage's own flags; compiled here, no GPU needed).

    python scripts/ptxas_record.py                # the last stage -> results/cpu/ptxas_<stage>.json
    python scripts/ptxas_record.py --stage 11

Each row names the instantiation (kernel, its template arguments, and for the prepare's variants
the products and how u is formed) and whether the op can launch it with its defaults. The record
carries the hash of the sources it was compiled from; tests/test_ptxas_record.py fails when the
sources change without a new record, and when a default instantiation spills.
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
from common.stages import STAGE_DIRS, last_stage, load_stage, normalize  # noqa: E402

PRODUCTS = {0: "factored", 1: "pairwise", 2: "as needed"}  # kda.h KdaProducts
# What the op launches without a pin: a bounded gate Prep<factored, u once>, a gate without a bound
# Prep<as needed, u in halves> (kda.cu with_prep, the binding's defaults).
DEFAULT_PREP = {(0, False), (2, True)}


def describe(kernel: str) -> dict:
    """The instantiation's parts: kernel name, K, V, compute warps or the ring, Prep's two arguments."""
    m = re.match(r"void kda_stage::(\w+)<(.*)>$", kernel)
    if not m:
        return dict(name=kernel)
    name, args = m.group(1), m.group(2)
    prep = re.search(r"Prep<(\d+), (true|false)\s*>", args)
    nums = [int(x) for x in re.findall(r"(?<![<\w])(\d+)(?=\s*[,>]|$)", re.sub(r"kda_stage::Prep<[^>]*>", "", args))]
    out = dict(name=name, template=nums)
    if prep:
        p, u = int(prep.group(1)), prep.group(2) == "true"
        out.update(products=PRODUCTS[p], u_halves=u, op_default=(p, u) in DEFAULT_PREP)
    else:
        out["op_default"] = name != "kda_frag_check_kernel"  # the recurrence runs for every gate; the check kernel is the tests'
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", default=None, help="the stage (default: the last)")
    p.add_argument("--out", default=None, help="default: results/cpu/ptxas_<stage>.json")
    args = p.parse_args()
    sid = normalize(args.stage) if args.stage else last_stage()
    stage = load_stage(sid)
    d = STAGES_DIR / STAGE_DIRS[sid]
    flags = list(getattr(stage, "CUDA_FLAGS", ()))
    cutlass = stage.SPEC.extra.get("cutlass", False)
    rows = resource_usage(d, stage.SOURCES, arch="sm_90", cutlass=cutlass, extra_flags=flags)
    rows = [dict(r, **describe(r["kernel"])) for r in rows]
    meta = metadata(command="python scripts/ptxas_record.py" + (f" --stage {sid}" if args.stage else ""),
                    device="cpu")
    meta.update(arch="sm_90", sources_hash=sources_hash(d), stage=STAGE_DIRS[sid],
                what="ptxas -v of every kernel instantiation in the stage's normal build: registers per thread, "
                     "stack frame and spill bytes; op_default: launched by kdalab.chunk_kda with no pin")
    out = Path(args.out) if args.out else RESULTS_DIR / "cpu" / f"ptxas_{STAGE_DIRS[sid]}.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    spills = [r["kernel"] for r in rows if r["spill_stores"] or r["spill_loads"]]
    print(f"{len(rows)} instantiations, {sum(r.get('op_default', False) for r in rows)} launched by the op's "
          f"defaults; {len(spills)} spill{': ' + ', '.join(spills) if spills else ''}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
