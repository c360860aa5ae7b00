"""The last stage beside stage 11 and FlashKDA on the H200, both gates, in one call (issue 36).

At the tensor-core benchmark shapes (common.bench.TC_GPU_SHAPES) and five more where few
heads run long sequences or many sequences run short ones, per round and shape, on the
same inputs (drawn on the GPU, h0 present):

- part ``bounded``: stage 11, the last stage (its bounded gate's instantiation; whether its
  outputs are stage 11's bits) and FlashKDA (K = V = 128), the bounded gate at -5;
- part ``softplus``: the last stage with Kimi Linear's softplus gate; with ``--before DIR``
  also the same part for the stage directory of an earlier commit (DIR holds it as
  DIR/12_softplus), run in a subprocess (its own build directory) after each round of this
  process's rows, labelled ``before``; with ``--control`` today's stage the same way (a
  subprocess on this process's build), labelled ``control``: the like-for-like comparison.

Each row: GPU time (CUDA-graph replay where it captures; CUDA events otherwise), the
eager time and the peak memory of one call (common.bench._timed, peak_mb).

    python scripts/bench_summit.py --out $OUT/summit.json [--rounds 2] [--before .before] [--control]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_softplus import gpu_inputs, say, timing_row  # noqa: E402
from common.bench import TC_GPU_SHAPES  # noqa: E402
from common.paths import BUILD_DIR, STAGES_DIR  # noqa: E402
from common.results import metadata, save  # noqa: E402
from common.stages import load_stage, stage_ids  # noqa: E402

MORE_SHAPES = [dict(B=4, T=4096, H=32, K=128, V=128), dict(B=16, T=2048, H=32, K=128, V=128),
               dict(B=1, T=65536, H=4, K=128, V=128), dict(B=1, T=8192, H=1, K=128, V=128),
               dict(B=1, T=131072, H=32, K=128, V=128)]
SHAPES = TC_GPU_SHAPES + MORE_SHAPES


def _call(fwd, kw):
    def f():
        with torch.no_grad():
            return fwd(**kw)
    return f


def bounded_rows(shapes, rnd, last, on_row) -> None:
    from common.fla_ref import FLASHKDA_NAME, flashkda_available, flashkda_forward, flashkda_unsupported

    s11, top = load_stage("11"), load_stage(last)
    fk = flashkda_available()[0]
    for shape in shapes:
        kw = gpu_inputs(**shape, gate="bounded", lower_bound=-5.0)
        with torch.no_grad():
            a, b = s11.forward(**kw), top.forward(**kw)
        equal = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
        del a, b
        on_row(timing_row("bounded", s11.SPEC.name, shape, _call(s11.forward, kw), gate="bounded", round=rnd))
        on_row(timing_row("bounded", top.SPEC.name, shape, _call(top.forward, kw), gate="bounded", round=rnd,
                          equal_to_11=equal))
        if fk and flashkda_unsupported(shape["K"], shape["V"]) is None:
            on_row(timing_row("bounded", FLASHKDA_NAME, shape, _call(flashkda_forward, kw), gate="bounded",
                              round=rnd))
        del kw
        torch.cuda.empty_cache()


def softplus_rows(shapes, rnd, last, on_row, label=None) -> None:
    top = load_stage(last)
    for shape in shapes:
        kw = gpu_inputs(**shape, gate="softplus")
        on_row(timing_row("softplus", top.SPEC.name, shape, _call(top.forward, kw), gate="softplus", round=rnd,
                          **({"kernel": label} if label else {})))
        del kw
        torch.cuda.empty_cache()


def before_rows(before: Path, shapes_arg, rnd: int, label: str = "before", build: str | None = None) -> list[dict]:
    """One round of the softplus part on the stage directory ``before`` (an earlier commit's), in a
    subprocess with its own build directory (``build``; default $KDALAB_BEFORE_BUILD, else
    /tmp/kdalab_build_before); rounds alternate with this process's. With ``before`` today's
    stages/ and this process's build directory (``--control``: nothing is rebuilt), the rows,
    labelled ``control``, measure what running in a subprocess does to a time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "before.json"
        env = dict(os.environ, KDALAB_STAGES_DIR=str(before.resolve()),
                   KDALAB_BUILD=build or os.environ.get("KDALAB_BEFORE_BUILD", "/tmp/kdalab_build_before"))
        cmd = [sys.executable, __file__, "--parts", "softplus", "--rounds", "1", "--label", label,
               "--out", str(out)] + (["--shapes", shapes_arg] if shapes_arg else [])
        rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        say(f"the {label} kernel ({before}), round {rnd}: rc={rc}")
        return [dict(r, round=rnd) for r in json.loads(out.read_text())["rows"]] if out.exists() else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="results file (default $OUT/summit.json)")
    ap.add_argument("--parts", default="bounded,softplus")
    ap.add_argument("--shapes", default=None, help="indices into the shape list (TC_GPU_SHAPES + MORE_SHAPES)")
    ap.add_argument("--rounds", type=int, default=2, help="the sweep this many times in turn (rows carry round)")
    ap.add_argument("--before", default=None, help="a stage directory of an earlier commit: its softplus rows too")
    ap.add_argument("--control", action="store_true",
                    help="also today's softplus rows from a subprocess (label control), as --before runs its own")
    ap.add_argument("--label", default=None, help="the softplus rows' kernel label (the --before subprocess)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_summit.py needs a CUDA GPU", file=sys.stderr)
        return 2
    last = stage_ids()[-1]
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    out = Path(args.out or Path(os.environ.get("OUT", "results")) / "summit.json")
    meta = metadata(command="python scripts/bench_summit.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    meta["what"] = (f"stage {last} (the last stage) beside stage 11 and FlashKDA on the bounded gate (-5) and with "
                    "the softplus gate, the same inputs per shape and round, h0 present: GPU time (graph replay), "
                    "eager time, peak memory; equal_to_11: the last stage's outputs bitwise stage 11's")
    rows: list[dict] = []

    def on_row(row):
        rows.append(row)
        save(out, rows, meta)  # after every row: a run cut short keeps what it measured

    for rnd in range(args.rounds):
        for part in args.parts.split(","):
            if part == "bounded":
                bounded_rows(shapes, rnd, last, on_row)
            elif part == "softplus":
                softplus_rows(shapes, rnd, last, on_row, args.label)
            else:
                ap.error(f"unknown part {part!r}: bounded, softplus")
        if args.before:
            for r in before_rows(Path(args.before), args.shapes, rnd):
                on_row(r)
        if args.control:
            for r in before_rows(STAGES_DIR, args.shapes, rnd, label="control", build=str(BUILD_DIR)):
                on_row(r)
    say(f"wrote {out}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
