"""The ``kdalab`` command line.

    kdalab list                 the stages, and whether this machine can run each
    kdalab check 01             rebuild stage 01 and run its checks (what a student runs after an edit)
    kdalab tour                 every stage this machine can run: build, check, time, profile -> reports/
    kdalab bench ...            latency sweep to a JSON results file (used on the GPU)
    kdalab results              the recorded results table (the README's table is this output)
    kdalab ablate 06            each idea of a multi-idea stage turned off alone: checked, timed, profiled
    kdalab diff 05 06           the lesson: two stages' sources diffed as their default builds see them

Exit codes: 0 done (checks passed); 1 a check failed, or nothing could be
measured; 2 a usage error (one line on stderr); 3 compiled but NOT checked (the
stage needs a GPU this machine lacks); 4 the stage does not compile (the
compiler's error lines are printed).

torch is imported only by the commands that need it, so ``--help`` is quick.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_CHECKED, EXIT_COMPILE = 0, 1, 2, 3, 4


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line too
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _say(msg: str) -> None:
    print(msg, flush=True)


def _stage_id(s) -> str:
    from .stages import normalize

    try:
        return normalize(s)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _stage_ids(csv: str, allow_fla: bool = False) -> list[str]:
    ids = [s.strip() for s in csv.split(",") if s.strip()]
    if not ids:
        raise UsageError("--stages needs at least one stage id, e.g. --stages 00,01")
    return [s if (allow_fla and s in ("fla", "flashkda")) else _stage_id(s) for s in ids]


def _runnable(sid):
    from .stages import load_stage

    try:
        spec = load_stage(sid).SPEC
    except FileNotFoundError as e:
        return None, False, str(e)
    ok, why = spec.runnable_here()
    return spec, ok, why


def cmd_list(args) -> int:
    from .stages import STAGE_DIRS

    for sid, d in STAGE_DIRS.items():
        spec, ok, why = _runnable(sid)
        if spec is None:
            _say(f"{sid}  {d:<20} not built yet ({why})")
        else:
            _say(f"{sid}  {d:<20} {'runs here' if ok else 'cannot run here: ' + why}  -- {spec.title}")
    return EXIT_OK


def _build(stage, profile: bool, verbose: bool):
    """Build a stage (and its profile variant when asked); None if it does not
    compile (the compiler's error lines are printed)."""
    from .build import CompileError

    try:
        ext = stage.build(verbose=verbose)
        if profile and ext is not None:
            stage.build(profile=True, verbose=verbose)
        return True
    except CompileError as e:
        _say(f"COMPILE ERROR: {e}")
        return None


def cmd_check(args) -> int:
    from . import checks
    from .stages import stage as ladder_stage

    sid = _stage_id(args.stage)
    spec, ok, why = _runnable(sid)
    if spec is None:
        raise UsageError(why)
    stage = ladder_stage(sid)
    t0 = time.time()
    if _build(stage, args.profile, args.verbose) is None:
        return EXIT_COMPILE
    if not ok:
        _say(f"stage {spec.name}: compiled{' (normal and profile builds)' if args.profile else ''}, "
             f"NOT checked: needs a GPU ({why}).")
        _say(f"Run `kdalab check {sid}` (or `pytest -m gpu`) on a machine with one.")
        return EXIT_NOT_CHECKED
    prev = stage.previous
    if prev is not None and _build(prev, False, args.verbose) is None:
        return EXIT_COMPILE
    cases = checks.cases_for(spec, checks.stage_device(spec), args.quick)
    _say(f"checking stage {spec.name} against the fp64 reference"
         f"{' and stage ' + prev.name if prev else ''} on {len(cases)} cases ...")

    def progress(i, n, case, rows):
        bad = [r for r in rows if not r["ok"]]
        _say(f"  [{i}/{n}] {case.id}: {'ok' if not bad else 'FAIL ' + ', '.join(r['output'] for r in bad)}")

    rows = checks.check_stage(stage, cases, progress=progress)
    _say("")
    _say(checks.format_rows(checks.summarize(rows), columns=("output", "err_ref", "err_prev", "tol", "ok", "cases")))
    failed = [r for r in rows if not r["ok"]]
    if failed:
        _say(f"FAILED: {len(failed)} of {len(rows)} comparisons above tolerance")
        _say(checks.format_rows(failed))
        return EXIT_FAILED
    _say(f"stage {spec.name}: all {len(rows)} comparisons within {rows[0]['tol']:g} ({time.time() - t0:.0f} s)")
    return EXIT_OK


def _headless_plots() -> None:
    """The command line saves figures to files: draw them without a display."""
    import matplotlib

    matplotlib.use("Agg")


def cmd_tour(args) -> int:
    _headless_plots()
    from . import report
    from .paths import REPORTS_DIR
    from .stages import STAGE_DIRS

    wanted = _stage_ids(args.stages) if args.stages else list(STAGE_DIRS)
    out_dir = Path(args.out) if args.out else REPORTS_DIR
    result = report.tour(wanted, out_dir=out_dir, quick=args.quick, say=_say, record=args.record)
    _say("")
    _say(result["table"])
    _say(f"report written to {result['path']}")
    return EXIT_OK if result["ok"] else EXIT_FAILED


def cmd_bench(args) -> int:
    import torch

    from . import bench, report
    from .results import metadata, save
    from .stages import load_stage

    sweeps = {"cpu": bench.CPU_SWEEP, "fp32-gpu": bench.FP32_GPU_SWEEP, "tc-gpu": bench.TC_GPU_SHAPES}
    ids = _stage_ids(args.stages, allow_fla=True)
    shapes = sweeps[args.sweep]
    if args.shapes:
        try:
            idx = [int(i) for i in args.shapes.split(",")]
        except ValueError:
            raise UsageError(f"--shapes takes comma-separated indices, got {args.shapes!r}") from None
        bad = [i for i in idx if not 0 <= i < len(shapes)]
        if bad:
            raise UsageError(f"--shapes {bad[0]}: the {args.sweep} sweep has {len(shapes)} shapes "
                             f"(0-{len(shapes) - 1})")
        shapes = [shapes[i] for i in idx]
    for sid in ids:
        if sid in ("fla", "flashkda"):
            continue
        spec = load_stage(sid).SPEC
        if args.chunk is not None and spec.chunk_sizes is not None and args.chunk not in spec.chunk_sizes:
            raise UsageError(f"--chunk {args.chunk}: stage {spec.name} takes chunk sizes {list(spec.chunk_sizes)}")
        if args.chunk is not None and spec.chunk_sizes is None and (args.chunk < 16 or args.chunk & (args.chunk - 1)):
            raise UsageError(f"--chunk {args.chunk}: stage {spec.name} takes a power of two >= 16")
        if args.gate is not None and args.gate not in spec.gates:
            raise UsageError(f"--gate {args.gate}: stage {spec.name} has gates {list(spec.gates)}")
    meta = metadata(command="kdalab " + " ".join(sys.argv[1:]))
    tc = args.sweep == "tc-gpu"  # tensor-core stages: bf16 inputs, forward only (FLA too)
    rows = bench.sweep(ids, shapes, gate=args.gate, chunk=args.chunk,
                       dtype=torch.bfloat16 if tc else torch.float32,
                       backward=False if (tc or args.forward_only) else None,
                       progress=lambda m: _say(f"[bench] {m}"), budget_s=args.budget,
                       on_row=lambda rows: save(args.out, rows, meta))
    path = save(args.out, rows, meta)
    _say(report.latency_table(rows))
    _say(f"wrote {path}")
    failed = [r for r in rows if r.get("error")]
    for r in failed:
        _say(f"NOT MEASURED: {r['stage']} {bench.shape_label(r)}: {r['error']}")
    if len(failed) == len(rows):
        _say("nothing was measured")
        return EXIT_FAILED
    return EXIT_OK


def cmd_ablate(args) -> int:
    from . import ablation
    from .stages import load_stage

    sid = _stage_id(args.stage)
    spec, ok, why = _runnable(sid)
    if spec is None:
        raise UsageError(why)
    abls = ablation.ablations(sid)
    if not abls:
        raise UsageError(f"stage {spec.name} has one idea: no ablations (stages with some: "
                         f"{', '.join(ablation.stages_with_ablations()) or 'none'})")
    stage = load_stage(sid)
    if _build(stage, True, args.verbose) is None:
        return EXIT_COMPILE
    for a in abls:
        _say(f"building stage {spec.name} without {a.idea} (-D{a.define}) ...")
        if _build(ablation.variant(sid, a.name), True, args.verbose) is None:
            return EXIT_COMPILE
    if not ok:
        _say(f"stage {spec.name} and its {len(abls)} ablations: compiled, NOT measured: needs a GPU ({why}).")
        return EXIT_NOT_CHECKED
    from .results import metadata, save

    rows = ablation.measure(sid, quick=args.quick, say=_say)
    if args.out:
        save(args.out, rows, metadata(command=f"kdalab ablate {sid}" + (" --quick" if args.quick else "")))
        _say(f"wrote {args.out}")
    for b in ablation.bought(rows):
        _say(f"  without {b['idea']}: forward x{b.get('fwd_speedup', float('nan')):.2f}"
             + (f", backward x{b['bwd_speedup']:.2f}" if "bwd_speedup" in b else "")
             + ("" if b["checks_ok"] else "  CHECKS FAILED"))
    return EXIT_OK if all(r["checks_ok"] for r in rows) else EXIT_FAILED


def cmd_diff(args) -> int:
    import difflib

    from .stages import DIFF_SUFFIXES, STAGE_DIRS, STAGES_DIR, lesson_source

    a, b = _stage_id(args.a), _stage_id(args.b)
    names = sorted({p.name for s in (a, b) for p in (STAGES_DIR / STAGE_DIRS[s]).iterdir()
                    if p.suffix in DIFF_SUFFIXES})
    try:
        for n in names:
            for line in difflib.unified_diff(lesson_source(a, n), lesson_source(b, n), lineterm="",
                                             fromfile=f"stages/{STAGE_DIRS[a]}/{n}",
                                             tofile=f"stages/{STAGE_DIRS[b]}/{n}", n=args.context):
                print(line)
    except BrokenPipeError:  # `kdalab diff 05 06 | head`
        sys.stderr.close()
    return EXIT_OK


def cmd_results(args) -> int:
    _headless_plots()
    from . import notebook, report

    if args.write_readme:
        from .paths import REPO_ROOT

        changed = report.update_readme(REPO_ROOT / "docs" / "RESULTS.md")
        _say("docs/RESULTS.md results block " + ("updated" if changed else "already up to date"))
        for p in report.update_stage_readmes():
            _say(f"{p.relative_to(REPO_ROOT)}: measured block updated")
        for p in notebook.write_figures(REPO_ROOT):
            _say(f"wrote {p.relative_to(REPO_ROOT)}")
        return EXIT_OK
    _say(report.results_markdown())
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kdalab", description="KDA Lab: build, check, time and profile the stages",
                epilog="exit codes: 0 ok; 1 a check failed or nothing was measured; 2 usage error; "
                       "3 compiled but not checked (needs a GPU); 4 compile error",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    sub.add_parser("list", help="the stages and whether this machine can run each").set_defaults(fn=cmd_list)
    c = sub.add_parser("check", help="rebuild one stage and run its checks")
    c.add_argument("stage", help="stage id, e.g. 01 or 01_cpp")
    c.add_argument("--quick", action="store_true", help="fewer cases")
    c.add_argument("--profile", action="store_true", help="also compile the profile build (-DKDA_PROFILE)")
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
    b.add_argument("--stages", required=True, help="comma-separated ids, 'fla' for FLA's chunk_kda, "
                   "'flashkda' for FlashKDA (built by scripts/build_flashkda.py; K = V = 128, bounded gate)")
    b.add_argument("--sweep", choices=("cpu", "fp32-gpu", "tc-gpu"), default="cpu")
    b.add_argument("--gate", default=None, choices=("softplus", "bounded"),
                   help="default: each stage's own first gate (softplus for FLA)")
    b.add_argument("--chunk", type=int, default=None)
    b.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    b.add_argument("--shapes", default=None, help="comma-separated indices into the sweep (default: all)")
    b.add_argument("--forward-only", action="store_true", help="time the forward only")
    b.add_argument("--out", required=True)
    b.set_defaults(fn=cmd_bench)
    a = sub.add_parser("ablate", help="each idea of a multi-idea stage turned off alone: checked, timed, profiled")
    a.add_argument("stage", help="stage id with ablations, e.g. 06")
    a.add_argument("--quick", action="store_true", help="fewer check cases")
    a.add_argument("--out", default=None, help="JSON results file to write")
    a.add_argument("--verbose", action="store_true", help="show the compiler's output")
    a.set_defaults(fn=cmd_ablate)
    d = sub.add_parser("diff", help="two stages' sources diffed as their default builds see them (ablation "
                                    "switches resolved off): the lesson")
    d.add_argument("a", help="stage id, e.g. 05")
    d.add_argument("b", help="stage id, e.g. 06")
    d.add_argument("-U", "--context", type=int, default=3, help="lines of context")
    d.set_defaults(fn=cmd_diff)
    r = sub.add_parser("results", help="print the recorded results table")
    r.add_argument("--write-readme", action="store_true",
                   help="rewrite docs/RESULTS.md, the measured blocks of the stage READMEs and the figures")
    r.set_defaults(fn=cmd_results)
    return p


REEXEC_ENV = "KDALAB_CHECKOUT"  # set when the command line has moved to the checkout it was started in


def _run_this_checkout() -> None:
    """Started inside another checkout than the one installed (a second clone sharing a virtual
    environment): run that checkout's command line instead, so that `kdalab check 01` checks the tree
    it is typed in. Returns only where this is already the right checkout."""
    from .paths import REPO_ROOT, checkout_of

    here = checkout_of(Path.cwd())
    if here is None or here == REPO_ROOT.resolve() or os.environ.get(REEXEC_ENV) == str(here):
        return
    print(f"kdalab: running the checkout at {here} (the current directory), not the installed {REPO_ROOT}",
          file=sys.stderr, flush=True)
    env = dict(os.environ, **{REEXEC_ENV: str(here)})
    env["PYTHONPATH"] = os.pathsep.join([str(here)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    os.execve(sys.executable, [sys.executable, "-m", "common.cli", *sys.argv[1:]], env)


def main(argv=None) -> int:
    if argv is None:  # the console script (`kdalab ...`), not a call from Python
        _run_this_checkout()
    try:
        args = parser().parse_args(argv)
        return args.fn(args)
    except UsageError as e:
        print(f"kdalab: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
