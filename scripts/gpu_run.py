"""One GPU session: build the CUDA stages, run the GPU tests, compute-sanitizer,
record checks, profiles and latencies as JSON under $OUT; execute the notebooks
as a reader would (nbval, with or without fla-core) and the tour.

    python scripts/gpu_run.py --stages 05,06,07 [--phases build,tests,checks,...] [--fla] [--flashkda]
    python scripts/gpu_run.py --phases build,notebooks --notebooks 00,01,02
    python scripts/gpu_run.py --phases tour
    python scripts/gpu_run.py --stages 04,05,06 --phases build,launches,ablations

On a machine kept warm between calls, `KDALAB_KEEP_BUILDS=1 bash scripts/gpu_run.sh ...`
dates the sources back so that ninja reuses the last call's builds (only when
the sources did not change between the calls).

With --flashkda (or the phase flashkda), FlashKDA is first built from the
checkout in $KDALAB_FLASHKDA_SRC (default .flashkda: its csrc/ and flash_kda/,
carried) by scripts/build_flashkda.py --check, log in $OUT/flashkda_build.txt;
the checks and bench-tc phases then measure it beside the stages (K = V = 128
shapes only). A failed build is logged and the run goes on without it.

Meant for the lent H200 (no network: extra wheels travel in .whl/ and are
installed to /tmp/site by scripts/gpu_run.sh). Every step has its own timeout
and writes its output under $OUT as it goes, so a step that runs long loses
nothing already measured. Copy what comes back into results/h200/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT", "/tmp/kdalab-out"))
OUT.mkdir(parents=True, exist_ok=True)
LOG = OUT / "log.txt"


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    with open(LOG, "a") as f:
        f.write(line + "\n")


def sh(cmd, timeout, name):
    """Run a command, append its output to $OUT/<name>.txt; return its exit code."""
    t0 = time.time()
    with open(OUT / f"{name}.txt", "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    log(f"{name}: rc={rc} ({time.time() - t0:.0f} s)")
    return rc


def build_all(stages, ablations=False):
    """Build every extension (normal + profile, and the ablation variants when
    asked) in parallel processes."""
    from common.stages import build_parallel

    t0 = time.time()
    failed = build_parallel(stages, jobs=min(32, 2 * len(stages) * (4 if ablations else 1)), say=log,
                            ablations=ablations)
    for sid, err in failed.items():
        log(f"build {sid} FAILED:\n{err}")
    log(f"build: {len(stages)} stages in {time.time() - t0:.0f} s")
    return not failed


def run_notebooks(names, tag: str, parallel: int = 0):
    """Each notebook through nbval (the figure plugin on), as a reader runs it:
    one pytest per notebook, timed by the wall clock, results saved after each
    to $OUT/notebooks_<tag>.json. With ``parallel`` > 0 all run at once in
    pytest-xdist workers (for completion, not timing)."""
    import glob
    import json

    from common.results import metadata

    paths = sorted(p for p in glob.glob(str(ROOT / "notebooks" / "*.ipynb"))
                   if not names or any(Path(p).stem.startswith(n) for n in names))
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--nbval-lax",
            "--nbval-current-env", "-p", "common.nbcheck", "-rfE"]
    meta = metadata(command=f"python scripts/gpu_run.py --phases notebooks ({tag})")
    meta["fla_core"] = _fla_importable()
    rows = []
    if parallel:
        t0 = time.time()
        rc = sh(base + ["-n", str(parallel), "--dist", "loadfile"] + paths, 580, f"notebooks_{tag}")
        rows.append(dict(notebooks=[Path(p).name for p in paths], parallel=parallel, rc=rc,
                         seconds=round(time.time() - t0, 1)))
    else:
        for p in paths:
            t0 = time.time()
            rc = sh(base + [p], 400, f"notebooks_{tag}")
            rows.append(dict(notebook=Path(p).name, rc=rc, seconds=round(time.time() - t0, 1)))
            log(f"notebook {Path(p).name} ({tag}): rc={rc}, {rows[-1]['seconds']} s")
            (OUT / f"notebooks_{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (OUT / f"notebooks_{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


def _fla_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("fla") is not None


def run_tour():
    import json
    import shutil

    t0 = time.time()
    rc = sh([sys.executable, "-m", "common.cli", "tour", "--out", str(OUT / "tour")], 580, "tour")
    secs = time.time() - t0
    log(f"tour: rc={rc}, {secs:.0f} s")
    (OUT / "tour" / "timing.json").write_text(json.dumps({"rc": rc, "seconds": round(secs, 1)}) + "\n")
    shutil.make_archive(str(OUT / "tour"), "gztar", str(OUT / "tour"))
    shutil.rmtree(OUT / "tour")


def build_flashkda() -> bool:
    """Build FlashKDA from $KDALAB_FLASHKDA_SRC (default .flashkda) and check one
    forward; on success put it on this process's path and on the subprocesses'
    PYTHONPATH. False (logged) when it cannot be had: the run goes on without."""
    src = os.environ.get("KDALAB_FLASHKDA_SRC") or ".flashkda"
    rc = sh([sys.executable, "scripts/build_flashkda.py", "--src", src, "--check"], 300, "flashkda_build")
    if rc != 0:
        log(f"FlashKDA: build or check failed (rc={rc}, see flashkda_build.txt): going on without it")
        return False
    from common.fla_ref import flashkda_available, use_flashkda_build

    dirs = use_flashkda_build(src)
    os.environ["PYTHONPATH"] = os.pathsep.join(dirs + [os.environ.get("PYTHONPATH", "")])
    ok, why = flashkda_available()
    log(f"FlashKDA: {'importable' if ok else 'NOT importable: ' + why}")
    return ok


def record_checks(stages, fla=False, flashkda=False):
    import torch

    from common import checks
    from common.results import metadata, save
    from common.stages import load_stage

    rows = []
    for sid in stages:
        spec = load_stage(sid).SPEC
        cases = checks.cases_for(spec, "cuda")
        t0 = time.time()
        r = checks.check_stage(sid, cases, device="cuda")
        worst = checks.summarize(r)
        det = checks.check_deterministic(sid, checks.determinism_case(cases), device="cuda")
        for w in worst:
            w["deterministic_fwd"] = det
        rows += worst
        bad = [x for x in r if not x["ok"]]
        log(f"checks {spec.name}: {len(r)} comparisons, {len(bad)} above tolerance, deterministic={det} "
            f"({time.time() - t0:.0f} s)")
        for x in bad[:20]:
            log(f"   FAIL {x['case']} {x['output']} err_ref={x['err_ref']:.3e} err_prev={x['err_prev']}")
        if spec.compute_dtype == torch.bfloat16 and fla:
            frows = [r for case in checks.fla_cases() for r in checks.check_against_fla(sid, case)]
            rows += checks.summarize_fla(frows)
            log(f"checks {spec.name} against FLA: " + ", ".join(
                f"{r['case']} {r['output']} {r['err_fla']:.2e} (FLA vs fp64 {r['fla_err_ref']:.2e})" for r in frows))
        save(OUT / "checks.json", rows, metadata(command="python scripts/gpu_run.py (checks)"))
    if flashkda:  # FlashKDA's own errors against fp64, on the bf16 cases it takes (K = V = 128)
        t0 = time.time()
        try:
            frows = [r for case in checks.flashkda_cases() for r in checks.check_flashkda(case)]
        except Exception as e:  # keep what the stages measured
            log(f"checks FlashKDA FAILED: {type(e).__name__}: {e}")
        else:
            rows += checks.summarize(frows)
            log(f"checks FlashKDA vs fp64 ({time.time() - t0:.0f} s): " + ", ".join(
                f"{r['case']} {r['output']} {r['err_ref']:.2e}" for r in frows))
        save(OUT / "checks.json", rows, metadata(command="python scripts/gpu_run.py (checks)"))


def record_profiles(stages):
    from common import checks
    from common.bench import PROFILE_SHAPE
    from common.results import metadata, save
    from common.stages import load_stage

    rows = []
    for sid in stages:
        stage = load_stage(sid)
        kw = checks.stage_inputs(stage.SPEC, **PROFILE_SHAPE["cuda"], device="cuda")
        prof = stage.profile(**kw, backward=stage.SPEC.backward)
        rows += [dict(stage=stage.SPEC.name, region=k, value=v, unit=stage.SPEC.region_unit,
                      **PROFILE_SHAPE["cuda"]) for k, v in prof.items()]
        log(f"profile {stage.SPEC.name}: " + ", ".join(f"{k}={v:.3g}" for k, v in prof.items()))
    save(OUT / "profiles.json", rows, metadata(command="python scripts/gpu_run.py (profiles)"))


def record_ablations(stages):
    """Every ablation variant of the stages that have some: checked, timed and
    profiled beside the stage (common.ablation.measure) -> $OUT/ablations.json."""
    from common import ablation
    from common.results import metadata, save

    rows = []
    for sid in stages:
        if not ablation.ablations(sid):
            continue
        t0 = time.time()
        try:
            rows += ablation.measure(sid, say=log)
        except Exception as e:  # keep what the other stages measured
            log(f"ablations {sid} FAILED: {type(e).__name__}: {e}")
        log(f"ablations {sid}: {time.time() - t0:.0f} s")
        save(OUT / "ablations.json", rows, metadata(command="python scripts/gpu_run.py --phases ablations "
                                                            "(common.ablation.measure per stage)"))


def record_launches(stages):
    """Grid, block and dynamic shared memory of every kernel of each stage at its
    regime shape (common.notebook.live_launches) -> $OUT/launches.json."""
    from common.notebook import live_launches
    from common.results import metadata, save
    from common.stages import load_stage

    rows = []
    for sid in stages:
        name = load_stage(sid).SPEC.name
        got, shape = live_launches(sid)
        rows += [dict(stage=name, **shape, **r) for r in got]
        log(f"launches {name}: " + ", ".join(f"{r['kernel']} {r['grid']}x{r['block']} "
                                            f"{r['dynamic_smem']} B" for r in got))
    save(OUT / "launches.json", rows, metadata(command="python scripts/gpu_run.py --phases launches"))


def sanitize(stages, ablations=False):
    """memcheck, racecheck and synccheck on every stage (and, with ``ablations``,
    on every ablation variant), in parallel processes."""
    from common.ablation import ablations as ablations_of

    targets = [(sid,) for sid in stages]
    if ablations:
        targets += [(sid, a.name) for sid in stages for a in ablations_of(sid)]
    jobs = [(t, tool) for t in targets for tool in ("memcheck", "racecheck", "synccheck")]

    def one(job):
        t, tool = job
        return sh(["compute-sanitizer", "--tool", tool, "--error-exitcode", "3", sys.executable,
                   "scripts/sanitize_case.py", *t], 400, f"sanitizer_{'_'.join(t)}_{tool}")

    with ThreadPoolExecutor(min(len(jobs), 16)) as ex:
        rcs = list(ex.map(one, jobs))
    for (t, tool), rc in zip(jobs, rcs):
        log(f"sanitizer {' -'.join(t)} {tool}: {'clean' if rc == 0 else 'FAILED rc=' + str(rc)}")
    with open(OUT / "sanitizer.txt", "w") as f:
        for t, tool in jobs:
            p = OUT / f"sanitizer_{'_'.join(t)}_{tool}.txt"
            f.write(p.read_text())
            p.unlink()


PHASES = ("build", "tests", "checks", "profiles", "sanitize", "bench-fp32", "bench-fla-fp32", "bench-tc")
EXTRA_PHASES = ("flashkda", "notebooks", "notebooks-fla", "tour", "ablations", "launches",
                "varlen", "op")  # asked for by name only


def gpu_stage_ids() -> list[str]:
    """Every stage of common/stages.py STAGE_DIRS that exists and runs on a GPU."""
    from common.stages import load_stage, stage_ids

    return [s for s in stage_ids() if "cuda" in load_stage(s).SPEC.devices]


def merge_flashkda(path, fk_path) -> None:
    """Append FlashKDA's bench rows (fk_path) to the tensor-core file (path), so
    that it sits beside the stages in one file."""
    from common.results import load, save

    fk = load(fk_path)
    data = load(path) if Path(path).exists() else {"meta": fk["meta"], "rows": []}
    rows = [r for r in data["rows"] if r.get("stage") != "FlashKDA"] + fk["rows"]
    command = data["meta"].get("command", "").split("; FlashKDA: ")[0]
    meta = dict(data["meta"], command=command + "; FlashKDA: " + fk["meta"].get("command", ""))
    save(path, rows, meta)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default=None, help="comma-separated ids (default: every GPU stage of STAGE_DIRS)")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--fla", action="store_true", help="include FLA chunk_kda in the benchmarks")
    p.add_argument("--flashkda", action="store_true",
                   help="build FlashKDA from $KDALAB_FLASHKDA_SRC (default .flashkda) first and include it in the "
                        "checks and bench-tc phases (the phase flashkda does the same)")
    p.add_argument("--bench-timeout", type=int, default=420)
    p.add_argument("--pytest-timeout", type=int, default=900, help="seconds for the tests phase (after checks)")
    p.add_argument("--pytest-k", default=None, help="pytest -k expression for the tests phase")
    p.add_argument("--shapes", default=None, help="bench only these rows of each sweep (kdalab bench --shapes)")
    p.add_argument("--notebooks", default="", help="comma-separated notebook name prefixes (default: all)")
    p.add_argument("--parallel", type=int, default=0, help="notebooks-fla: run the notebooks in N xdist workers")
    p.add_argument("--ablations", action="store_true",
                   help="also build the ablation variants and run them under compute-sanitizer (the ablations "
                        "phase implies it)")
    args = p.parse_args()
    stages = args.stages.split(",") if args.stages else gpu_stage_ids()
    phases = args.phases.split(",")
    unknown = [x for x in phases if x not in PHASES + EXTRA_PHASES]
    if unknown:
        p.error(f"unknown phases {unknown}; phases are {PHASES + EXTRA_PHASES}")
    if args.fla:  # FLA's wheel is installed apart (gpu_run.sh)
        os.environ["PYTHONPATH"] = "/tmp/site_fla" + os.pathsep + os.environ.get("PYTHONPATH", "")
        sys.path.insert(0, "/tmp/site_fla")
    import torch

    from common.stages import load_stage

    fp32 = [s for s in stages if load_stage(s).SPEC.compute_dtype == torch.float32]
    tc = [s for s in stages if s not in fp32]
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, stages {stages}, phases {phases}")
    from common.stages import previous, stage_ids

    from common import checks

    def compared_with(s):
        """The previous stage, and any the checks take instead where it cannot run a case (stage 12's
        softplus cases: stage 04), so that the tests do not build them on the clock."""
        stage = load_stage(s)
        return {previous(s)} | {p.SPEC.id for c in checks.cases_for(stage.SPEC, "cuda")
                                if (p := checks.previous_for(stage, c)) is not None}

    to_build = sorted(set(stages).union(*map(compared_with, stages)) - {None, "00"})
    if "notebooks" in phases or "notebooks-fla" in phases or "tour" in phases:
        to_build = sorted(set(to_build) | (set(stage_ids()) - {"00"}))  # every stage with a build
    with_ablations = args.ablations or "ablations" in phases
    flashkda = False
    with ThreadPoolExecutor(1) as ex:  # FlashKDA (about 90 s) builds beside the stages
        fk = ex.submit(build_flashkda) if args.flashkda or "flashkda" in phases else None
        built = "build" not in phases or build_all(to_build, ablations=with_ablations)
        flashkda = fk.result() if fk is not None else False  # early: checks and bench-tc take it when it builds
    if not built:
        log("BUILD FAILED: see build.txt")
        return 1
    if "checks" in phases:
        record_checks(stages, fla=args.fla, flashkda=flashkda and bool(tc))
    if "tests" in phases:
        os.environ["KDALAB_STAGES"] = ",".join(stages)
        sh([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-o", "addopts=",
            "--junitxml", str(OUT / "junit.xml"), "tests/test_gpu_stages.py", "tests/test_stage_paths.py", "tests/test_profile_regions.py", "tests/test_contract.py",
            "tests/test_flashkda.py", "tests/test_varlen.py", "tests/test_op.py", "tests/test_op_gpu.py"]
           + (["-k", args.pytest_k] if args.pytest_k else []),
           args.pytest_timeout, "pytest")
    if "profiles" in phases:
        record_profiles(stages)
    if "launches" in phases:
        record_launches(stages)
    if "sanitize" in phases:
        sanitize(stages, ablations=with_ablations)
    if "ablations" in phases:
        record_ablations(stages)
    fla = ["fla"] if args.fla else []
    shapes = ["--shapes", args.shapes] if args.shapes else []
    if "bench-fp32" in phases and fp32:
        sh([sys.executable, "-m", "common.cli", "bench", "--stages", ",".join(fp32), "--sweep", "fp32-gpu",
            "--out", str(OUT / "fp32_stages.json"), "--budget", "0.5"] + shapes, args.bench_timeout, "bench")
    if "bench-fla-fp32" in phases and args.fla:
        sh([sys.executable, "-m", "common.cli", "bench", "--stages", "fla", "--sweep", "fp32-gpu",
            "--out", str(OUT / "fp32_fla.json"), "--budget", "0.5"] + shapes, args.bench_timeout, "bench")
    if "bench-tc" in phases and tc:
        sh([sys.executable, "-m", "common.cli", "bench", "--stages", ",".join(tc + fla), "--sweep", "tc-gpu",
            "--gate", "bounded", "--chunk", "16", "--out", str(OUT / "tc_stages.json"), "--budget", "0.5"]
           + shapes, args.bench_timeout, "bench")
        if flashkda:  # in a second call, at the K = V = 128 shapes only, then merged into tc_stages.json
            from common.bench import TC_GPU_SHAPES

            idx = [i for i, s in enumerate(TC_GPU_SHAPES) if s["K"] == s["V"] == 128
                   and (not args.shapes or str(i) in args.shapes.split(","))]
            if idx:
                rc = sh([sys.executable, "-m", "common.cli", "bench", "--stages", "flashkda", "--sweep", "tc-gpu",
                         "--gate", "bounded", "--chunk", "16", "--out", str(OUT / "tc_flashkda.json"), "--budget",
                         "0.5", "--shapes", ",".join(map(str, idx))], args.bench_timeout, "bench")
                if (OUT / "tc_flashkda.json").exists():
                    merge_flashkda(OUT / "tc_stages.json", OUT / "tc_flashkda.json")
                    log(f"bench FlashKDA: rc={rc}, rows merged into tc_stages.json")
    if "varlen" in phases:  # packed sequences: the last stage beside FlashKDA's varlen forward (and FLA's, --fla)
        sh([sys.executable, "scripts/bench_varlen.py", "--out", str(OUT / "varlen.json")] + (["--fla"] if args.fla else []),
           args.bench_timeout, "varlen")
    if "op" in phases:  # kdalab.chunk_kda in an FLA KDA layer, with and without the FLA backend (needs --fla)
        sh([sys.executable, "scripts/bench_op.py", "--out", str(OUT / "op.json")], args.bench_timeout, "op")
    nbs = [n for n in args.notebooks.split(",") if n]
    if "notebooks" in phases:  # without fla-core on the path (gpu_run.sh keeps it apart in /tmp/site_fla)
        run_notebooks(nbs, "no_fla")
    if "tour" in phases:
        run_tour()
    if "notebooks-fla" in phases:
        fla_dir = "/tmp/site_fla"
        os.environ["PYTHONPATH"] = fla_dir + os.pathsep + os.environ.get("PYTHONPATH", "")
        sys.path.insert(0, fla_dir)
        import importlib

        importlib.invalidate_caches()
        log(f"fla-core importable: {_fla_importable()}")
        run_notebooks(nbs, "fla", parallel=args.parallel)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
