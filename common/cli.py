"""The ``kdalab`` command line.

    kdalab list                 the stages, and whether this machine can run each
    kdalab check 01             rebuild stage 01 and run its checks (what a student runs after an edit)
    kdalab tour                 every stage this machine can run: build, check, time, profile -> reports/
    kdalab bench ...            latency sweep to a JSON results file (used on the GPU)
    kdalab results              the recorded results table (the README's table is this output)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from . import checks, report
from .paths import REPORTS_DIR
from .stages import STAGE_DIRS, load_stage, normalize, previous


def _say(msg: str) -> None:
    print(msg, flush=True)


def _runnable(sid):
    try:
        spec = load_stage(sid).SPEC
    except FileNotFoundError as e:
        return None, False, str(e)
    ok, why = spec.runnable_here()
    return spec, ok, why


def cmd_list(args) -> int:
    for sid, d in STAGE_DIRS.items():
        spec, ok, why = _runnable(sid)
        if spec is None:
            _say(f"{sid}  {d:<20} not built yet ({why})")
        else:
            _say(f"{sid}  {d:<20} {'runs here' if ok else 'cannot run here: ' + why}  -- {spec.title}")
    return 0


def cmd_check(args) -> int:
    sid = normalize(args.stage)
    spec, ok, why = _runnable(sid)
    if spec is None or not ok:
        _say(f"stage {sid} cannot run here: {why}")
        if spec is not None and "cuda" in spec.devices:
            _say("compiling it instead, so a compile error still shows ...")
            stage = load_stage(sid)
            stage.build(verbose=args.verbose)
            stage.build(profile=True, verbose=args.verbose)
            _say(f"stage {sid} compiles (normal and profile builds); its checks need a GPU")
            return 0
        return 1
    stage = load_stage(sid)
    t0 = time.time()
    stage.build(verbose=args.verbose)
    pid = previous(sid)
    if pid is not None:
        load_stage(pid).build()
    cases = checks.cases_for(spec, checks.stage_device(spec), args.quick)
    _say(f"checking stage {spec.name} against the fp64 reference"
         f"{' and stage ' + load_stage(pid).SPEC.name if pid else ''} on {len(cases)} cases ...")
    rows = []
    for i, case in enumerate(cases, 1):
        rows += checks.check_case(sid, case)
        bad = [r for r in rows if r["case"] == case.id and not r["ok"]]
        _say(f"  [{i}/{len(cases)}] {case.id}: {'ok' if not bad else 'FAIL ' + ', '.join(r['output'] for r in bad)}")
    _say("")
    _say(checks.format_rows(checks.summarize(rows), columns=("output", "err_ref", "err_prev", "tol", "ok", "cases")))
    failed = [r for r in rows if not r["ok"]]
    if failed:
        _say(f"FAILED: {len(failed)} of {len(rows)} comparisons above tolerance")
        _say(checks.format_rows(failed))
        return 1
    _say(f"stage {spec.name}: all {len(rows)} comparisons within {rows[0]['tol']:g} ({time.time() - t0:.0f} s)")
    return 0


def cmd_tour(args) -> int:
    wanted = [normalize(s) for s in args.stages.split(",")] if args.stages else list(STAGE_DIRS)
    out_dir = Path(args.out) if args.out else REPORTS_DIR
    result = report.tour(wanted, out_dir=out_dir, quick=args.quick, say=_say, record=args.record)
    _say("")
    _say(result["table"])
    _say(f"report written to {result['path']}")
    return 0 if result["ok"] else 1


def cmd_bench(args) -> int:
    from . import bench
    from .results import metadata, save

    sweeps = {"cpu": bench.CPU_SWEEP, "fp32-gpu": bench.FP32_GPU_SWEEP, "tc-gpu": bench.TC_GPU_SHAPES}
    ids = [s if s == "fla" else normalize(s) for s in args.stages.split(",")]
    meta = metadata(command="kdalab " + " ".join(sys.argv[1:]))
    tc = args.sweep == "tc-gpu"  # tensor-core stages: bf16 inputs, forward only (FLA too)
    shapes = sweeps[args.sweep]
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    rows = bench.sweep(ids, shapes, gate=args.gate, chunk=args.chunk,
                       dtype=torch.bfloat16 if tc else torch.float32,
                       backward=False if (tc or args.forward_only) else None,
                       progress=lambda m: _say(f"[bench] {m}"), budget_s=args.budget,
                       on_row=lambda rows: save(args.out, rows, meta))
    path = save(args.out, rows, meta)
    _say(report.latency_table(rows))
    _say(f"wrote {path}")
    return 0


def cmd_results(args) -> int:
    if args.write_readme:
        from .paths import REPO_ROOT

        changed = report.update_readme(REPO_ROOT / "README.md")
        _say("README.md results block " + ("updated" if changed else "already up to date"))
        for p in report.write_figures(REPO_ROOT):
            _say(f"wrote {p.relative_to(REPO_ROOT)}")
        return 0
    _say(report.results_markdown())
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kdalab", description="KDA Lab: build, check, time and profile the stages")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the stages and whether this machine can run each").set_defaults(fn=cmd_list)
    c = sub.add_parser("check", help="rebuild one stage and run its checks")
    c.add_argument("stage", help="stage id, e.g. 01 or 01_cpp")
    c.add_argument("--quick", action="store_true", help="fewer cases")
    c.add_argument("--verbose", action="store_true", help="show the compiler's output")
    c.set_defaults(fn=cmd_check)
    t = sub.add_parser("tour", help="build, check, time and profile every stage this machine can run")
    t.add_argument("--stages", default=None, help="comma-separated ids (default: all)")
    t.add_argument("--quick", action="store_true", help="fewer cases and a shorter sweep")
    t.add_argument("--out", default=None, help="report directory (default: reports/)")
    t.add_argument("--record", action="store_true",
                   help="also store the timings as recorded results under results/cpu/")
    t.set_defaults(fn=cmd_tour)
    b = sub.add_parser("bench", help="latency sweep written to a JSON results file")
    b.add_argument("--stages", required=True, help="comma-separated ids, 'fla' for FLA's chunk_kda")
    b.add_argument("--sweep", choices=("cpu", "fp32-gpu", "tc-gpu"), default="cpu")
    b.add_argument("--gate", default=None, choices=("softplus", "bounded"),
                   help="default: each stage's own first gate (softplus for FLA)")
    b.add_argument("--chunk", type=int, default=None)
    b.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    b.add_argument("--shapes", default=None, help="comma-separated indices into the sweep (default: all)")
    b.add_argument("--forward-only", action="store_true", help="time the forward only")
    b.add_argument("--out", required=True)
    b.set_defaults(fn=cmd_bench)
    r = sub.add_parser("results", help="print the recorded results table")
    r.add_argument("--write-readme", action="store_true", help="rewrite the results block of README.md")
    r.set_defaults(fn=cmd_results)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
