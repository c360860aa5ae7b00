"""What the notebooks call: each function measures live when this machine can
run the stage, and otherwise shows the recorded GPU figures, labelled as
recorded (device, date, commit, command). Notebooks stay narrative + calls.

On a GPU the live parts stay within minutes: a latency sweep times the shapes
that fit a time budget (predicted from the recorded figures) and shows the
recorded figures for the rest, labelled; checks and sweeps show a progress
bar. FLA's Triton kernels autotune for minutes on a machine's first use, so
live FLA timing is opt-in (KDALAB_LIVE_FLA=1) and announced before it starts.

Every function that draws is marked with :func:`figure`; the notebook tests
(common/nbcheck.py) fail a cell that calls one and shows no image.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pandas as pd
import torch

from . import bench, checks, results
from .results import FLA_TC, FLASHKDA, FLASHKDA_MEASURED, anchor_rows
from .bench import PROFILE_SHAPE, progress_bar
from .build import resource_usage, sources_hash

PTXAS_COLUMNS = ("kernel", "registers", "smem_bytes", "stack_bytes", "spill_stores", "spill_loads")
from .fla_ref import fla_available, flashkda_available, flashkda_unsupported
from .paths import STAGES_DIR
from .plotting import (format_total, plot_ablation, plot_bars, plot_chunk_timeline, plot_latency, plot_paths,
                       plot_profile, split_bars)
from .report import README_FIGURES
from .stages import (STAGE_DIRS, declared_records, fused_stage, last_stage, lesson_source, load_stage, neighbour_diff,
                     normalize, previous, record_names, tensor_core_stages, varlen_record)

# A table's words are part of the lesson: pandas cuts a cell at 50 characters by default ("a load warp fills the
# slot ring (warp speciali..."), so the ablation tables' ideas showed cut off. Every cell is shown whole.
pd.set_option("display.max_colwidth", None)

FIGURES: set = set()  # names of the functions below that draw a figure


def figure(fn):
    """Mark a notebook function that draws: a cell calling it must show an image."""
    FIGURES.add(fn.__name__)
    return fn


LIVE_FLA_ENV = "KDALAB_LIVE_FLA"
# How long FLA's first call per (H, K) family took on a fresh H200 (Triton
# compiles and autotunes; results/h200/fp32_stages.json meta and the stop notes
# of 2026-11-29): fp32 forward ~80 s, fp32 backward ~230 s, bf16 forward at the
# six tensor-core shapes ~5 minutes in all.
FLA_FIRST_USE = {"fp32": "about 80 s per (H, K) family for the forward",
                 "bf16": "about 5 minutes in all for the six tensor-core shapes (four (H, K) families)"}
LIVE_BUDGET_S = 30.0  # seconds of live timing per latency figure on a GPU


class CheckFailed(AssertionError):
    """A notebook's check found what it checks broken: its cell fails (and nbval with it)."""


NOTEBOOK_ENV = "KDALAB_NOTEBOOK"  # the path of the notebook a kernel runs (common.nbcheck.kernel_env sets it)


def notebook_path() -> Path | None:
    """The notebook this kernel runs: from KDALAB_NOTEBOOK (set by the notebook tests and
    scripts/run_notebooks.py), else from Jupyter's JPY_SESSION_NAME; None when neither says."""
    for var in (NOTEBOOK_ENV, "JPY_SESSION_NAME"):
        v = os.environ.get(var)
        if v and v.endswith(".ipynb"):
            return Path(v)
    return None


def chapter() -> str | None:
    """The stage id of the chapter this kernel runs ("01" for notebooks/01_cpp.ipynb), None for a notebook
    that is not a stage's (summary, use_in_a_model) or when it is not known."""
    p = notebook_path()
    if p is None:
        return None
    sid = p.stem[:2]
    return sid if sid in STAGE_DIRS and p.stem == STAGE_DIRS[sid] else None


def own_stage(stage_id) -> str:
    """``stage_id``, normalised, after checking that it is the chapter's own stage: a chapter's check
    cell that checks another stage raises (a copied cell left pointing at its neighbour)."""
    sid = normalize(stage_id)
    mine = chapter()
    if mine is not None and sid != mine:
        raise CheckFailed(f"{STAGE_DIRS[mine]}.ipynb checks stage {sid} ({STAGE_DIRS[sid]}): a chapter's check "
                          f"cell checks its own stage, {mine}")
    return sid


def fail_if(problems, what: str) -> None:
    """Raise CheckFailed listing ``problems`` (strings), if there are any: the cell that shows ``what``
    fails with it."""
    problems = list(problems)
    if problems:
        raise CheckFailed(f"{what}: " + "; ".join(problems) if len(problems) == 1 else
                          f"{what}:\n  " + "\n  ".join(problems))


def environment() -> str:
    """One line about this machine (what the notebook will do live). Fails where the notebook belongs to
    another checkout than the ``common`` it imported (a second clone sharing a virtual environment):
    its checks would run the other tree's code."""
    from .paths import REPO_ROOT

    p = notebook_path()
    folder = p.resolve().parent if p is not None and p.is_absolute() else Path.cwd().resolve()  # the kernel's cwd
    checkout = folder.parent  # notebooks/ sits at the top of a checkout
    if (checkout / "common" / "notebook.py").exists() and checkout != REPO_ROOT.resolve():
        raise RuntimeError(f"this notebook is in the checkout {checkout}, but `common` was imported from "
                           f"{REPO_ROOT}: start Jupyter with PYTHONPATH={checkout}, or pip install -e that checkout")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    line = f"torch {torch.__version__}, {gpu}"
    print(line)
    return line


def build(stage_id, profile=True):
    """Build a stage, and its profile variant where the stage runs here (a profile is taken only there:
    elsewhere the chapter shows the recorded one, and the variant would be a second compile of every
    translation unit); returns the stage module."""
    stage = load_stage(stage_id)
    stage.build()
    if profile and stage.build() is not None and stage.SPEC.runnable_here()[0]:
        stage.build(profile=True)
    return stage


def diff(stage_id, lines: int = 30) -> pd.DataFrame:
    """The chapter's lesson as code: the neighbour diff from the previous stage (lines added and removed per
    file, as the default builds see them: an ablation switch's other branch left out), an excerpt of its largest
    change (the hunk that adds the most lines, at most ``lines`` of it), and the command that prints the rest."""
    import difflib

    sid = own_stage(stage_id)
    pid = previous(sid)
    rows = neighbour_diff(sid, lesson=True)
    print(f"diff -ru stages/{STAGE_DIRS[pid]} stages/{STAGE_DIRS[sid]}   # the whole lesson "
          f"({sum(r['added'] for r in rows)} lines added, {sum(r['removed'] for r in rows)} removed, READMEs aside)")
    hunks = []
    for r in rows:
        text = list(difflib.unified_diff(lesson_source(pid, r["file"]), lesson_source(sid, r["file"]),
                                         f"{STAGE_DIRS[pid]}/{r['file']}", f"{STAGE_DIRS[sid]}/{r['file']}",
                                         lineterm="", n=2))
        cut = [i for i, line in enumerate(text) if line.startswith("@@")] + [len(text)]
        for a, b in zip(cut, cut[1:]):
            hunk = text[a:b]
            hunks.append((sum(x.startswith("+") for x in hunk), r["file"], hunk))
    if hunks:
        added, name, hunk = max(hunks, key=lambda h: h[0])
        print(f"\nits largest change, in {name} ({added} lines added here):\n")
        print("\n".join(hunk[:lines]) + (f"\n... ({len(hunk) - lines} more lines)" if len(hunk) > lines else ""))
    return pd.DataFrame(rows).set_index("file") if rows else pd.DataFrame()


def _say_recorded(meta: dict, rows=None) -> None:
    """Print where the figures shown come from, once per table: device, days, commits (those of ``rows``, the
    rows shown, where they name theirs), file(s)."""
    where = results.label(meta, rows)
    print(where[:1].upper() + where[1:])


def _recorded(name):
    data = results.recorded(name)
    return (data["meta"], data["rows"]) if data else (None, [])


def fla_live() -> tuple[bool, str]:
    """(True, "") if FLA is timed live here, else (False, why not)."""
    ok, why = fla_available()
    if not ok:
        return False, why
    if os.environ.get(LIVE_FLA_ENV) != "1":
        return False, (f"live FLA timing is opt-in: set {LIVE_FLA_ENV}=1 before starting Jupyter (its first use "
                       "on a machine autotunes Triton kernels for minutes)")
    return True, ""


_FLA_ANNOUNCED: set = set()


def _announce_fla(regime: str, shapes) -> None:
    fams = sorted({(s["H"], s["K"]) for s in shapes})
    new = [f for f in fams if (regime, f) not in _FLA_ANNOUNCED]
    if new:
        print(f"FLA chunk_kda ({regime}): the first call for each (H, K) family compiles and autotunes its Triton "
              f"kernels on this machine, {FLA_FIRST_USE[regime]} ({len(new)} new here: "
              + ", ".join(f"H={h} K={k}" for h, k in new) + "); later calls reuse Triton's cache.", flush=True)
        _FLA_ANNOUNCED.update((regime, f) for f in new)


def _problems(stage, rows, where: str) -> list[str]:
    """The rows that fail (common.checks.judge), one line each: the case, the output, its errors and
    what it is held to."""
    same = checks.same_bits(stage)
    return [f"{stage.SPEC.name} ({where}): {r.get('case', 'worst of ' + str(r.get('cases')) + ' cases')} "
            f"{r['output']}: {r['err_ref']:.2e} against fp64"
            + (f", {r['err_prev']:.2e} against {r.get('prev')}" if r.get("err_prev") is not None else "")
            + f" (tolerance {r['tol']:g}{'; the stage declares the previous stage bits' if same else ''})"
            for r in rows if not r["ok"]]


def error_table(stage_id, *, quick: bool = False) -> pd.DataFrame:
    """Worst relative error per output against the fp64 reference and the previous stage, each judged by
    the stage's tolerance (StageSpec.tolerance). Live when the stage runs here, else recorded. Raises
    CheckFailed when an output fails (common.checks.judge: above its tolerance, or off the previous stage's
    bits where the stage declares them) and when the cell checks a stage other than its chapter's own. Recorded:
    results/h200/checks.json, or the record the stage declares as RECORDS["checks"]."""
    sid = own_stage(stage_id)
    stage = load_stage(sid)
    spec = stage.SPEC
    ok, why = spec.runnable_here()
    if ok:
        dev = checks.stage_device(spec)
        cases = checks.cases_for(spec, dev, quick)
        rows = []
        for case in progress_bar(cases, f"checking {spec.name}", "case"):
            rows += checks.check_case(sid, case)
        bad = _problems(stage, rows, f"live on {dev}")
        worst = checks.summarize(rows)
        print(f"measured live on {dev}: {len(cases)} cases, {len(rows)} comparisons, "
              + ("each within its output's tolerance" if not bad else f"{len(bad)} ABOVE tolerance"))
    else:
        meta, rec = _own_or_recorded(sid, "checks", "checks")  # a stage's own: a row per stage compared with
        worst = [checks.judge(stage, r) for r in rec if r.get("stage") == spec.name and "err_ref" in r]
        if not worst:
            raise CheckFailed(f"{spec.name} cannot run here ({why}) and has no recorded checks "
                              "(results/h200/checks.json)")
        bad = _problems(stage, worst, "recorded")
        print(f"{spec.name} cannot run here ({why}); showing figures {results.label(meta)}")
    fail_if(bad, f"checks of {spec.name}")
    df = pd.DataFrame(worst)
    cols = [c for c in ("output", "err_ref", "err_prev", "prev", "tol", "ok", "cases") if c in df]
    return df[cols].style.format({"err_ref": "{:.2e}", "err_prev": "{:.2e}", "tol": "{:.1e}"}, na_rep="-")


def fla_error_table(stage_id) -> pd.DataFrame:
    """A tensor-core stage against FLA's chunk_kda on the same bf16 inputs, as
    recorded on the H200 (tests/test_gpu_stages.py checks it live there)."""
    meta, rows = _recorded("checks")
    name = load_stage(stage_id).SPEC.name
    mine = [r for r in rows if r.get("stage") == name and "err_fla" in r]
    if not mine:
        print(f"no recorded comparison of {name} with FLA")
        return pd.DataFrame()
    _say_recorded(meta)
    fail_if([f"{r['output']}: {r['err_fla']:.2e} from FLA (bound {r['tol_fla']:g}), FLA {r['fla_err_ref']:.2e} "
             "from fp64" for r in mine if not r["ok"]], f"{name} against FLA")
    df = pd.DataFrame(mine)[["output", "err_fla", "fla_err_ref", "tol_fla", "ok", "cases"]]
    return df.style.format({"err_fla": "{:.2e}", "fla_err_ref": "{:.2e}", "tol_fla": "{:.0e}"}, na_rep="-")


def _region_profiles(stage_id, compare_previous: bool = True, backward: bool = True):
    """The region profiles :func:`profile` and :func:`profile_moves` show: ({stage name: {region: value}},
    the shape, the unit). Live when possible, else recorded (results/h200/profiles.json, or the record the
    stage declares as RECORDS["region_profile"]: both stages from one call); says which, once."""
    ids = [stage_id]
    pid = previous(stage_id)
    if compare_previous and pid is not None:
        ids.insert(0, pid)
    unit = load_stage(stage_id).SPEC.region_unit
    profs, notes, shown = {}, [], []
    meta, rec = _own_or_recorded(stage_id, "region_profile", "profiles")  # a stage's own: it and the one before
    for sid in ids:
        spec = load_stage(sid).SPEC
        if spec.region_unit != unit:
            continue
        ok, why = spec.runnable_here()
        if ok:
            dev = checks.stage_device(spec)
            kw = checks.stage_inputs(spec, **PROFILE_SHAPE[dev.type], device=dev)
            print(f"profiling {spec.name} live on {dev} at {bench.shape_label(PROFILE_SHAPE[dev.type])} ...",
                  flush=True)
            build(sid)
            profs[spec.name] = load_stage(sid).profile(**kw, backward=backward and spec.backward)
            notes.append(f"{spec.name}: live on {dev}")
        else:
            rows = [r for r in rec if r.get("stage") == spec.name]
            if rows:
                profs[spec.name] = {r["region"]: r["value"] for r in rows}
                notes.append(f"{spec.name}: recorded")
                shown += rows
            else:
                notes.append(f"{spec.name}: no figures ({why})")
    shape = PROFILE_SHAPE["cpu" if unit == "s" else "cuda"]
    print("; ".join(notes) + f" -- shape {bench.shape_label(shape)}")
    if meta is not None and any("recorded" in n for n in notes):
        _say_recorded(meta, shown)
    return profs, shape, unit


@figure
def profile(stage_id, *, compare_previous: bool = True, backward: bool = True):
    """The region profile of a stage next to the previous one (same unit only),
    one bar per kernel or direction: each region's share, the bar's total at
    its right. Live when possible, else recorded (:func:`_region_profiles`)."""
    profs, shape, unit = _region_profiles(stage_id, compare_previous, backward)
    if not profs:
        return None
    bars = {}
    for name, prof in profs.items():
        bars.update(split_bars(name, prof))
    what = "wall time" if unit == "s" else "clock64 cycles per block"
    return plot_profile(bars, unit, title=f"Where the time goes ({what}), {bench.shape_label(shape)}")


MOVED = 0.05  # profile_moves names a region that moved by more than this fraction either way


def chunks_per_block(region: str, T: int, chunk: int = 16) -> int | None:
    """What a split path's region (or a kernel's bar, "K1", "K2 load warp") is divided by to give cycles per
    chunk: 1 for K1, which runs one block per chunk; NT = ceil(T / chunk) for K2, whose block (its compute warps
    and its load warp) walks the NT chunks of its sequence in turn; None for a region of neither kernel."""
    kernel = region.split(":", 1)[0].split()[0] if region else ""
    if kernel not in ("K1", "K2"):
        return None
    if T < 1:
        raise ValueError(f"T must be positive, got {T}")
    return 1 if kernel == "K1" else -(-T // chunk)


def split_chunk_profile(prof: dict, T: int, chunk: int = 16) -> dict:
    """A split path's region profile (clock64 cycles per block, mean over blocks) per chunk
    (:func:`chunks_per_block`). ValueError for a region of neither kernel."""
    out = {}
    for region, v in prof.items():
        per = chunks_per_block(region, T, chunk)
        if per is None:
            raise ValueError(f"{region!r} is a region of neither K1 nor K2: not a split path's profile")
        out[region] = v / per
    return out


def _split_path_profile(prof: dict) -> bool:
    """Are these the regions of a split path (K1 + K2), the only ones :func:`split_chunk_profile` takes?"""
    return bool(prof) and all(chunks_per_block(r, 1) is not None for r in prof)


def profile_moves(stage_id) -> pd.DataFrame:
    """What moved between the previous stage's profile and this one's (:func:`profile`'s figures), in clock64
    cycles per chunk (:func:`split_chunk_profile`): each region of either stage, both values and their
    ratio, and each kernel's total. Prints the regions that moved by more than 5%, fewer cycles first. Where
    the previous stage's kernels are not a split path's (stage 05 after the fp32 stages), this stage alone."""
    sid = normalize(stage_id)
    profs, shape, unit = _region_profiles(sid, backward=False)
    prev, this = (load_stage(s).SPEC.name for s in (previous(sid), sid))
    if unit == "s" or this not in profs or not _split_path_profile(profs[this]):
        raise ValueError(f"profile_moves takes the cycle profile of a tensor-core stage's split path; "
                         f"have {sorted(profs)} in {unit}")
    names = [n for n in (prev, this) if n in profs and _split_path_profile(profs[n])]
    per = {n: split_chunk_profile(profs[n], shape["T"]) for n in names}
    regions = list(dict.fromkeys(r for n in names for r in per[n]))
    table = pd.DataFrame({n[:2]: [per[n].get(r) for r in regions] for n in names},
                         index=pd.Index(regions, name="region"), dtype=float)
    for kernel in ("K1", "K2"):  # each kernel's total; K2's compute warps apart from its load warp
        rows = [r for r in regions if r.startswith(kernel + ":")]
        table.loc[f"{kernel} total" if kernel == "K1" else "K2 compute warps: total"] = table.loc[rows].sum()
    where = (f"cycles per chunk at {bench.shape_label(shape)} (K1: per block, one chunk each; K2: per block / "
             f"{chunks_per_block('K2', shape['T'])} chunks)")
    if len(names) == 1:
        print(f"{where}; stage {prev[:2]}'s kernels are not a split path's: stage {this[:2]} alone")
        return table.style.format("{:,.0f}", na_rep="-")
    table["ratio"] = table[this[:2]] / table[prev[:2]]
    moved = table["ratio"].drop([i for i in table.index if i.endswith("total")]).dropna()
    less = [f"{r} {v:.2f}x" for r, v in moved.sort_values().items() if v < 1 - MOVED]
    more = [f"{r} {v:.2f}x" for r, v in moved.sort_values(ascending=False).items() if v > 1 + MOVED]
    print(f"{where}; stage {this[:2]} against {prev[:2]}, by more than {MOVED:.0%}: "
          f"fewer: {', '.join(less) or 'none'}; more: {', '.join(more) or 'none'}")
    return table.style.format({prev[:2]: "{:,.0f}", this[:2]: "{:,.0f}", "ratio": "{:.2f}"}, na_rep="-")


_LIVE: dict = {}  # live sweeps, measured once per notebook session
_GATHERED: dict = {}  # (live rows, recorded rows, notes) per figure's stages


def _live_sweep(sid, shapes, tc: bool = False):
    """A live latency sweep, measured once per notebook session and reused.
    FLA is timed forward only (its fp32 backward autotunes for minutes; the
    recorded backward rows are in results/h200/fp32_stages.json).
    ``tc``: the tensor-core regime (bf16 inputs, bounded gate, chunk 16, forward)."""
    key = (sid, tc, tuple(tuple(sorted(x.items())) for x in shapes))
    if key not in _LIVE:
        if sid == "fla":
            _announce_fla("bf16" if tc else "fp32", shapes)
        kw = dict(dtype=torch.bfloat16, gate="bounded", chunk=16, backward=False) if tc else \
            dict(backward=False if sid == "fla" else None)
        _LIVE[key] = bench.sweep([sid], shapes, budget_s=0.3, bar=True, **kw)
    return [dict(r) for r in _LIVE[key]]


def _stage_name(sid) -> str:
    return {"fla": "FLA chunk_kda", "flashkda": FLASHKDA}.get(sid) or load_stage(sid).SPEC.name


def _gather(stage_ids, shapes_for, recorded, tc: bool, budget_s: float):
    """Rows to plot for some stages: live where the stage (or FLA, when opted
    in) runs here, within ``budget_s`` seconds in all (the last stage, the
    notebook's own, first), recorded for the rest. Returns (live rows,
    recorded rows, notes)."""
    live, rec, notes = [], [], []
    left = budget_s
    for sid in reversed(list(stage_ids)):
        name = _stage_name(sid)
        mine = [dict(r) for r in recorded if r.get("stage") == name]
        if sid == "fla":
            ok, why = fla_live()
        elif sid == "flashkda":  # no autotuning: live whenever it is built here
            ok, why = flashkda_available()
        else:
            spec = load_stage(sid).SPEC
            ok, why = spec.runnable_here()
        if not ok:
            rec += mine
            notes.append(f"{name}: recorded ({why})")
            continue
        dev = "cuda" if sid in ("fla", "flashkda") else checks.stage_device(load_stage(sid).SPEC).type
        shapes = shapes_for(sid, dev)
        now, skipped, need, rest = bench.fit_budget(name, shapes, recorded if dev == "cuda" else [], left)
        if now:
            print(f"timing {name} live on {dev} at {len(now)} of {len(shapes)} shapes"
                  + (f" (about {need:.0f} s)" if need else "") + " ...", flush=True)
            live += _live_sweep(sid, now, tc=tc)
        left -= need
        if skipped:
            rec += skipped
            notes.append(f"{name}: {len(skipped)} shape(s) recorded, not timed live (about {rest:.0f} s more than "
                         f"the {budget_s:.0f} s budget of this figure)")
    return live, rec, notes


@figure
def latency(stage_ids, *, y: str = "fwd", title=None, budget_s: float = LIVE_BUDGET_S):
    """Latency against T for a few stages (and "fla"): live for what runs here
    (within ``budget_s`` seconds on a GPU), recorded H200 figures for the rest,
    in one figure with recorded lines dashed. ``y`` is "fwd" or "bwd": GPU time
    (graph replay) where there is one, else the eager time."""
    meta, rec = _recorded("fp32_stages")

    def shapes_for(sid, dev):
        return bench.FP32_GPU_SWEEP if sid == "fla" else bench.sweep_for(load_stage(sid).SPEC, dev)

    key = (tuple(stage_ids), budget_s)
    first = key not in _GATHERED
    if first:
        _GATHERED[key] = _gather(stage_ids, shapes_for, rec, False, budget_s)
    live_rows, rec_rows, notes = _GATHERED[key]
    if first:  # the same rows serve the forward and the backward figure: say where they come from once
        for n in notes:
            print(n)
        if rec_rows and meta is not None:
            _say_recorded(meta, rec_rows)
    ykey = f"{y}_best_ms"
    rows = []
    live_labels = {(r["stage"], bench.shape_label(r)) for r in live_rows}
    for r, recorded in [(r, False) for r in live_rows] + [(r, True) for r in rec_rows]:
        if recorded and (r["stage"], bench.shape_label(r)) in live_labels:
            continue
        if r["H"] == 64 and r["K"] == 128:  # the seed's shape: one point, shown by the ladder, not a T sweep
            continue
        v = bench.best_ms(r, y)
        if v is None:
            continue
        where = "H200" if r.get("device", "cuda") != "cpu" else "CPU"
        series = f"{r['stage']} (B{r['B']} H{r['H']} K{r['K']}{', ' + where if live_rows and rec_rows else ''})" \
            + _eager_mark(r, y)
        rows.append(dict(r, **{ykey: v, "series": series, "recorded": recorded}))
    if not rows:
        print("no latency figures for these stages on this machine yet")
        return None
    order = {n: i for i, n in enumerate(STAGE_DIRS.values())}
    rows.sort(key=lambda r: (order.get(r["stage"], 99), r["T"]))  # legend in ladder order, FLA last
    what = "GPU time where measured" if any(r.get("device", "cuda") != "cpu" for r in rows) else "wall time"
    return plot_latency(rows, y=ykey, by="series", ylabel=f"{y} ms ({what})",
                        title=(title or f"{'Forward' if y == 'fwd' else 'Backward'} latency against T")
                        + ("" if live_rows else " (recorded on the H200)"))


def _eager_mark(row: dict, y: str) -> str:
    """' eager' for a row timed without graph replay although a call is short
    enough for launch overhead to count (FLA's backward goes through autograd)."""
    short = row.get(f"{y}_ms") is not None and row[f"{y}_ms"] < 1e3 * bench.LONG_CALL_S
    return " eager" if short and row.get(f"{y}_graph_ms") is None and row.get("device") != "cpu" else ""


def latency_rows(stage_ids, name: str = "fp32_stages") -> pd.DataFrame:
    """The recorded latency rows of some stages as a table."""
    meta, rec = _recorded(name)
    names = [_stage_name(s) for s in stage_ids]
    rows = [r for r in rec if r.get("stage") in names]
    if meta is not None:
        _say_recorded(meta, rows)
    cols = ["stage", "B", "T", "H", "K", "V", "fwd_ms", "fwd_graph_ms", "bwd_ms", "bwd_graph_ms"]
    df = pd.DataFrame(rows)
    return df[[c for c in cols if c in df]] if len(df) else df


def live_launches(stage_id) -> tuple[list[dict], dict]:
    """On a GPU: the kernels one forward (and, where there is one, backward) of
    the stage launches at its regime shape, from ext.launches(). Returns (rows
    with their direction, the shape)."""
    from . import extrun
    from .ablation import shape_for
    from .contract import prepare

    stage = load_stage(stage_id)
    spec = stage.SPEC
    shape = shape_for(stage_id)
    kw = checks.stage_inputs(spec, **shape, device="cuda")
    ext = stage.build()
    c = prepare(spec, **kw)
    extrun.run(ext, spec, c)
    torch.cuda.synchronize()
    rows = [dict(direction="fwd", **r) for r in ext.launches()]
    if spec.backward:
        B, T, H, K, V = (shape[x] for x in "BTHKV")
        extrun.backward(ext, c, torch.randn(B, T, H, V, device="cuda"), torch.randn(B, H, K, V, device="cuda"))
        torch.cuda.synchronize()
        rows += [dict(direction="bwd", **r) for r in ext.launches()]
    return rows, shape


def launches(stage_id) -> tuple[list[dict], str]:
    """The kernels one forward (and backward) of the stage launches at its
    regime shape: grid, block, dynamic shared memory (as the launcher chose
    it), registers and static shared memory of the instantiation launched.
    Live on a GPU (:func:`live_launches`), else recorded
    (results/h200/launches.json). Returns (rows, where they come from)."""
    spec = load_stage(stage_id).SPEC
    ok, _ = spec.runnable_here()
    if ok and "cuda" in spec.devices:
        rows, shape = live_launches(stage_id)
        return rows, f"live, {bench.shape_label(shape)}"
    rec = results.recorded("launches")
    rows = [r for r in (rec or {}).get("rows", []) if r.get("stage") == spec.name]
    return rows, (f"{bench.shape_label(rows[0])}, {results.label(rec['meta'])}" if rows else "not recorded")


def resources(stage_id) -> pd.DataFrame:
    """Per kernel: registers, static shared memory, stack and spills from ptxas
    -v (sm_90, or sm_90a for a stage built for it; compiled here: no GPU needed), and next to them the launch
    configuration (grid, block, *dynamic* shared memory) of the kernels one
    call launches at the stage's regime shape (see :func:`launches`): ptxas
    cannot see dynamic shared memory, which is sized at launch."""
    stage = load_stage(stage_id)
    d, arch = STAGES_DIR / STAGE_DIRS[stage.SPEC.id], "sm_90a" if stage.SPEC.extra.get("sm90a") else "sm_90"
    rec = results.recorded(f"ptxas_{stage.SPEC.name}", "cpu")  # scripts/ptxas_record.py: no second compile
    if rec and rec["meta"].get("sources_hash") == sources_hash(d) and rec["meta"].get("arch") == arch:
        rows = [{k: r[k] for k in PTXAS_COLUMNS} for r in rec["rows"]]
        print(f"ptxas -v ({arch}): results/cpu/ptxas_{stage.SPEC.name}.json, recorded from these sources")
    else:
        rows = resource_usage(d, stage.SOURCES, arch=arch, cutlass=stage.SPEC.extra.get("cutlass", False),
                              extra_flags=getattr(stage, "CUDA_FLAGS", ()))
    df = pd.DataFrame(rows).rename(columns={"smem_bytes": "static_smem_bytes"})
    if "cuda" not in stage.SPEC.devices:
        return _for_the_reader(df)
    launched, where = launches(stage_id)
    print(f"launch configuration: {where}")
    if not launched:
        return _for_the_reader(df)
    base = df["kernel"].str.replace(r"<.*", "", regex=True).str.split("::").str[-1]
    symbols = {}
    if any(x.get("symbol") for x in launched):  # exact: the instantiation's mangled name
        from .build import _demangle

        names = [x["symbol"] for x in launched]
        symbols = {id(x): n for x, n in zip(launched, _demangle(names))}
    rows_of = {}  # launch -> the ptxas rows it may be
    for i, r in df.iterrows():
        targs = re.search(r"<(\d+)", r["kernel"])  # stages 05-07: kernels templated on K first
        for x in launched:
            if symbols:
                sym = re.sub(r"\(.*", "", symbols[id(x)].replace("(anonymous namespace)::", ""))
                ok = sym == r["kernel"]
            else:
                ok = (x["kernel"] == base[i]
                      and (targs is None or x.get("K") is None or int(targs.group(1)) == x["K"])
                      and x.get("registers") in (None, r["registers"])
                      and x.get("static_smem") in (None, r["static_smem_bytes"]))
            if ok:
                rows_of.setdefault(id(x), []).append(i)
    extra = [dict(launched="", grid=None, block=None, dynamic_smem_bytes=None) for _ in range(len(df))]
    for x in launched:
        cand = rows_of.get(id(x), [])
        for i in cand:
            e = extra[i]
            tag = x["direction"] + ("" if len(cand) == 1 else f" (one of {len(cand)} instantiations)")
            e["launched"] = " / ".join(sorted(set(filter(None, e["launched"].split(" / "))) | {tag}))
            e.update(grid=x["grid"], block=x["block"], dynamic_smem_bytes=x["dynamic_smem"])
    out = pd.concat([df, pd.DataFrame(extra)], axis=1)
    for c in ("grid", "block", "dynamic_smem_bytes"):
        out[c] = out[c].astype("Int64")  # whole numbers; <NA> where the kernel is not launched at that shape
    print(f"launched: what one call at that shape launches, with its grid, block and dynamic shared memory; "
          f"the other {int((out['launched'] == '').sum())} kernels serve other shapes, paths or checks")
    return _for_the_reader(out)


def _for_the_reader(df: pd.DataFrame) -> pd.DataFrame:
    """The table as a reader reads it: kernel names without ``void`` and namespaces
    (``kda_fused_kernel<128, 128, 8>``), and a printed line for every kernel that spills."""
    df = df.copy()
    df["kernel"] = df["kernel"].str.replace(r"^void\s+", "", regex=True).str.replace(r"\b\w+::", "", regex=True)
    for _, r in df[(df["spill_stores"] > 0) | (df["spill_loads"] > 0)].iterrows():
        print(f"spills: {r['kernel']} at {r['registers']} registers stores {r['spill_stores']} and loads "
              f"{r['spill_loads']} bytes to local memory ({r['stack_bytes']} bytes of stack)")
    return df


@figure
def tc_latency(stage_ids=("05",)):
    """Tensor-core stages against FLA and FlashKDA at the H200 shapes, GPU time
    (graph replay) where measured, else eager. On a GPU the stages are measured
    live (FLA too when opted in; FlashKDA whenever scripts/build_flashkda.py
    built it here); otherwise the recorded figures are shown: the stages, FLA
    and FlashKDA as measured on one H200 lease, and, at the shapes where
    FlashKDA (or FLA) was not measured there, the newest file in
    results/anchors/, labelled "(anchor ...)"."""
    meta, rec = bench.recorded_tc_rows()
    ids = list(stage_ids) + ["fla", "flashkda"]

    def shapes_for(sid, dev):
        if sid == "flashkda":  # K = V = 128 only
            return [s for s in bench.TC_GPU_SHAPES if flashkda_unsupported(s["K"], s["V"]) is None]
        return bench.TC_GPU_SHAPES

    key = ("tc", tuple(ids))
    if key not in _GATHERED:
        _GATHERED[key] = _gather(ids, shapes_for, rec, True, LIVE_BUDGET_S)
    live_rows, rec_rows, notes = _GATHERED[key]
    for n in notes:
        print(n)
    if rec_rows and meta is not None:
        _say_recorded(meta, rec_rows)
    rows = [dict(r, where="live") for r in live_rows if bench.best_ms(r) is not None] + \
        [dict(r, where="recorded") for r in rec_rows if bench.best_ms(r) is not None]
    for r in rows:
        if r["stage"] == "FLA chunk_kda":
            r["stage"] = FLA_TC
        if r["stage"] == FLASHKDA:  # measured beside the stages: live here, or recorded with them
            r["stage"] = "FlashKDA (measured, recorded)" if r["where"] == "recorded" and live_rows \
                else FLASHKDA_MEASURED
        elif r["where"] == "recorded" and live_rows:
            r["stage"] += " (recorded)"
    shapes = {bench.shape_label(r) for r in rows}
    fla_at = {bench.shape_label(r) for r in rows if r["stage"].startswith(FLA_TC)}
    fk_at = {bench.shape_label(r) for r in rows if r["stage"].startswith(FLASHKDA)}
    anchored = [r for r in anchor_rows(fla_at, fk_at) if bench.shape_label(r) in shapes]
    rows += anchored  # the anchor's shapes where the stages were measured and the reference was not
    order = {n: i for i, n in enumerate(STAGE_DIRS.values())}
    rows.sort(key=lambda r: (order.get(r["stage"].split(" ")[0], 50), r["stage"]))
    data, path = results.newest_anchor()
    if anchored:
        which = " and ".join(dict.fromkeys("FLA" if r["stage"].startswith("FLA") else "FlashKDA" for r in anchored))
        print(f"{which} where not measured beside the stages: anchors measured on the H200 "
              f"({path.name}: {data.get('date', '')}, {data.get('device', '')})")
    for r in rows:
        r["shape"] = bench.shape_label(r)
        r["ms"] = bench.best_ms(r)
    where = "measured live" if live_rows else "recorded"
    ax = plot_bars(rows, x="shape", y="ms", by="stage",
                   title=f"Forward latency on the H200 (GPU time, ms; stages {where})", ylabel="ms")
    df = pd.DataFrame(rows)
    return ax, df.pivot_table(index="shape", columns="stage", values="ms", sort=False)


@figure
def ladder(shape=dict(B=1, T=1024, H=64, K=128, V=128)):
    """The whole ladder at one shape, from the recorded figures: forward
    latency per stage (GPU time where recorded) plus the references."""
    rows = []
    for name in ("fp32_stages", "tc_stages"):
        meta, rec = _recorded(name) if name != "tc_stages" else bench.recorded_tc_rows()
        for r in rec:
            if all(r.get(k) == v for k, v in shape.items()):
                label = r["stage"]
                if label == "FLA chunk_kda":
                    label = "FLA chunk_kda (fp32, softplus)" if name == "fp32_stages" else FLA_TC
                elif label == FLASHKDA:
                    label = FLASHKDA_MEASURED
                else:
                    label += " (fp32, softplus)" if name == "fp32_stages" else " (bf16, bounded)"
                rows.append(dict(stage=label, fwd_ms=bench.best_ms(r), bwd_ms=bench.best_ms(r, "bwd"),
                                 note=r.get("error") or r.get("note") or ""))
    fla_at = {bench.shape_label(shape)} if any(r["stage"] == FLA_TC for r in rows) else frozenset()
    fk_at = {bench.shape_label(shape)} if any(r["stage"] == FLASHKDA_MEASURED and r["fwd_ms"] is not None
                                              for r in rows) else frozenset()
    rows = [r for r in rows if not (r["stage"] == FLASHKDA_MEASURED and r["fwd_ms"] is None)]
    rows += [dict(stage=r["stage"], fwd_ms=r["fwd_graph_ms"], bwd_ms=None, note="anchor " + r["anchor"])
             for r in anchor_rows(fla_at, fk_at) if all(r.get(k) == v for k, v in shape.items())]
    order = {n: i for i, n in enumerate(STAGE_DIRS.values())}
    rows.sort(key=lambda r: order.get(r["stage"].split(" ")[0], 100))
    df = pd.DataFrame(rows)
    ok = df[df["fwd_ms"].notna()]
    import matplotlib.pyplot as plt

    from .plotting import format_ms, series_color

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(ok["stage"], ok["fwd_ms"], color=[series_color(n) for n in ok["stage"]])
    for y, v in enumerate(ok["fwd_ms"]):
        ax.text(v * 1.1, y, format_ms(v), va="center", fontsize=7)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("forward ms (log scale)")
    ax.set_title(f"The ladder at {bench.shape_label(shape)} (H200, recorded)")
    fig.tight_layout()
    return ax, df


def recorded_summary():
    """The ladder by regime from the recorded results: each stage's own errors
    and its latency at one shape per regime, FLA and FlashKDA as rows."""
    from IPython.display import Markdown

    from .report import recorded_summary_markdown

    return Markdown(recorded_summary_markdown())


def ablation_table(stage_id) -> pd.DataFrame:
    """What each idea of a multi-idea stage bought: the recorded H200 rows of
    results/h200/ablations.json (``kdalab ablate NN`` measures them live: it
    builds every variant, which takes minutes, so a notebook does not)."""
    from . import ablation

    meta, rows = ablation.recorded_rows(stage_id)
    if not rows:
        print(f"no recorded ablations for stage {stage_id}: run `kdalab ablate {stage_id}` on a GPU")
        return pd.DataFrame()
    _say_recorded(meta, rows)
    out = []
    for b in ablation.bought(rows):
        d = dict(idea=b["idea"], instead=b["instead"], shape=b["shape"])
        for y in ("fwd", "bwd"):
            if b.get(f"{y}_ms_without") is not None:
                d[f"{y} ms with"] = round(b[f"{y}_ms_with"], 4)
                d[f"{y} ms without"] = round(b[f"{y}_ms_without"], 4)
                d[f"{y} x slower without"] = round(b[f"{y}_speedup"], 2)
        if b.get("region"):
            d["region"] = b["region"]
            d["region with"] = f"{b['region_with']:.3g}"
            d["region without"] = f"{b['region_without']:.3g}"
        if "peak_mb_without" in b:
            d["peak MB with"] = round(b["peak_mb_with"], 1)
            d["peak MB without"] = round(b["peak_mb_without"], 1)
        d["checks"] = "ok" if b["checks_ok"] else "FAILED"
        d["err vs full stage"] = f"{b['err_full']:.1e}"
        out.append(d)
    fail_if([f"{d['idea']} turned off: its checks failed" for d in out if d["checks"] != "ok"],
            f"ablations of stage {stage_id}")
    return pd.DataFrame(out)


@figure
def ablation_plot(stage_id):
    """The recorded ablations of a stage as a figure (see :func:`ablation_table`)."""
    from . import ablation

    meta, rows = ablation.recorded_rows(stage_id)
    if not rows:
        print(f"no recorded ablations for stage {stage_id}")
        return None
    full = next(r for r in rows if r["variant"] == "full")
    ms = {y: bench.best_ms(full, y) for y in ("fwd", "bwd")}
    spec = load_stage(stage_id).SPEC
    bought = ablation.bought(rows)
    at = bench.shape_label(full) if len({b["shape"] for b in bought}) == 1 else "each at a shape where it runs"
    return plot_ablation(bought, ms, unit=spec.region_unit,
                         title=f"Stage {spec.id}: what each idea bought, {at} "
                               f"(recorded, {meta.get('device', 'H200')})")


# ---- a stage with several paths (stages 08-10): every path side by side -----

FUSED_KERNELS = {"kda_fused_kernel"}  # what a fused path launches; a split path launches K1 + K2
SPLIT_KERNELS = {"kda_prepare_kernel", "kda_recurrence_kernel"}
FUSED_VS_PREVIOUS = 1e-3  # a fused path against the previous stage (tests/test_stage_paths.py): only the
                          # decay factors' ex2.approx (09 against 08) or the order of a row's sums (10 against
                          # 09) differ, and now and then a bf16 output rounds the other way

_PATHS: dict = {}  # stage id -> (rows, notes, recorded meta): measured once per notebook session


def path_problems(row: dict, prev_id: str = "07") -> list[str]:
    """What is wrong with one row of a paths measurement (common.bench.path_rows,
    or its recorded file), against what stages 08-10 promise: the row ran and was
    timed; a row of the stage launched either K1 + K2 or the fused kernel alone
    (a pinned path: the one its name says), a split launch gives the previous
    stage's outputs bitwise, a fused one stays within FUSED_VS_PREVIOUS of them
    (where the difference was measured; the previous stage's same path where it
    has one, see common.bench.path_rows), and its peak memory was measured.
    Rows of the previous stage and of FlashKDA only need a time."""
    if row.get("error"):
        return [f"failed: {row['error']}"]
    out = []
    ms = bench.best_ms(row)
    if ms is None or not (math.isfinite(ms) and ms > 0):
        out.append(f"no valid time ({ms})")
    if row.get("stage") in (prev_id, FLASHKDA):
        return out
    kernels = set(row.get("kernels") or ())
    path = row.get("path", "rule")
    want = FUSED_KERNELS if path.startswith("fused") else SPLIT_KERNELS if path.startswith("split") else None
    if want is not None and kernels != want:
        out.append(f"path {path} launched {sorted(kernels)}, not {sorted(want)}")
    elif kernels not in (FUSED_KERNELS, SPLIT_KERNELS):
        out.append(f"launched {sorted(kernels)}: neither K1 + K2 nor the fused kernel")
    if kernels == SPLIT_KERNELS and row.get(f"equal_to_{prev_id}") is not True:
        out.append(f"a split launch not bitwise equal to stage {prev_id}")
    err = row.get(f"err_vs_{prev_id}")
    if kernels == FUSED_KERNELS and err is not None and not err <= FUSED_VS_PREVIOUS:
        out.append(f"{err:.1e} from stage {prev_id} (more than {FUSED_VS_PREVIOUS:g})")
    if row.get("peak_mb") is None or not row["peak_mb"] >= 0:
        out.append("no peak memory")
    return out


def _shape_of(r: dict) -> dict:
    return {k: r[k] for k in "BTHKV"}


def _paths(stage_id, budget_s: float = LIVE_BUDGET_S):
    """Every path of a stage at the shapes of its recorded paths file: live on a
    GPU (common.bench.path_rows, the shapes that fit ``budget_s`` as predicted
    from the recorded times, in the file's order), recorded for the rest.
    Returns (rows, each with where = "live" or "recorded"; notes; the
    recorded file's meta). Measured once per notebook session."""
    sid = normalize(stage_id)
    if sid in _PATHS:
        return _PATHS[sid]
    info = paths_recorded().get(sid)
    meta, rec = _recorded(info["table"]) if info else (None, [])
    spec = load_stage(sid).SPEC
    ok, why = spec.runnable_here()
    shapes = list({bench.shape_label(r): _shape_of(r) for r in rec}.values()) or list(bench.TC_GPU_SHAPES)
    rows, notes = [], []
    if not ok:
        rows = [dict(r, where="recorded") for r in rec]
        notes.append(f"{spec.name} and its paths: recorded ({why})" if rec else f"{spec.name}: no figures ({why})")
    else:
        live, skipped, need, rest = [], [], 0.0, 0.0
        for shape in shapes:
            mine = [r for r in rec if bench.shape_label(r) == bench.shape_label(shape)]
            s = sum(bench.predicted_s(r) or 1.0 for r in mine) if mine else 0.0
            if need + s <= budget_s:
                live.append(shape)
                need += s
            else:
                skipped.append(shape)
                rest += s
        print(f"timing every path of {spec.name} live at {len(live)} of {len(shapes)} shapes"
              + (f" (about {need:.0f} s)" if need else "") + " ...", flush=True)
        for shape in progress_bar(live, f"paths of {spec.name}", "shape"):
            rows += [dict(r, where="live") for r in bench.path_rows(sid, shape, budget_s=0.3)]
        labels = {bench.shape_label(s) for s in skipped}
        rows += [dict(r, where="recorded") for r in rec if bench.shape_label(r) in labels]
        if skipped:
            notes.append(f"{len(skipped)} shape(s) recorded, not timed live (about {rest:.0f} s more than the "
                         f"{budget_s:.0f} s budget of this table)")
    _PATHS[sid] = (rows, notes, meta)
    return _PATHS[sid]


def _say(rows, notes, meta):
    """Print a table's notes and, where any of its rows is recorded, the record's provenance; return the rows."""
    for n in notes:
        print(n)
    if meta is not None and any(r["where"] == "recorded" for r in rows):
        _say_recorded(meta)
    return rows


def _say_paths(stage_id):
    return _say(*_paths(stage_id))


def paths_table(stage_id="09") -> pd.DataFrame:
    """Every path of the stage per shape (its rule and each path that
    ``stage.path`` can pin), beside the previous stage and FlashKDA measured in
    the same call: GPU time (graph replay), the ratios to both, peak memory,
    whether the outputs are bitwise the previous stage's, and the checks of
    :func:`path_problems`. Live on a GPU (within a 30-second budget), else the
    recorded file (results/h200/stageNN/)."""
    sid = normalize(stage_id)
    rows = _say_paths(sid)
    pid = previous(sid)
    order = ["rule"] + list(getattr(load_stage(sid), "PATHS", {}))
    out, bad = [], []
    for lab in dict.fromkeys(bench.shape_label(r) for r in rows):
        at = [r for r in rows if bench.shape_label(r) == lab]
        ref = next((r for r in at if r["stage"] == pid), {})
        fk = next((r for r in at if r["stage"] == FLASHKDA), {})
        bad += [f"{lab} {r['stage']} {r['path']}: {'; '.join(p)}" for r in at if (p := path_problems(r, pid))]
        for r in sorted((r for r in at if r["stage"] == sid), key=lambda r: order.index(r["path"])):
            ms, ms_ref, ms_fk = bench.best_ms(r), bench.best_ms(ref), bench.best_ms(fk)
            problems = path_problems(r, pid)
            out.append({"shape": lab, "path": r["path"], "GPU ms": ms, f"{pid} ms": ms_ref, "FlashKDA ms": ms_fk,
                        f"time / {pid}": ms / ms_ref if ms and ms_ref else None,
                        "time / FlashKDA": ms / ms_fk if ms and ms_fk else None,
                        "peak MB": r.get("peak_mb"), "FlashKDA peak MB": fk.get("peak_mb"),
                        f"bitwise = {pid}": r.get(f"equal_to_{pid}"),
                        "check": "ok" if not problems else "FAILED: " + "; ".join(problems), "where": r["where"]})
    print(f"path checks: {len(rows) - len(bad)} of {len(rows)} rows as expected")
    fail_if(bad, f"path checks of stage {sid} ({len(bad)} of {len(rows)} rows)")
    if not out:
        return pd.DataFrame()
    df = pd.DataFrame(out).set_index(["shape", "path"])
    sig = {"GPU ms": 4, f"{pid} ms": 4, "FlashKDA ms": 4, f"time / {pid}": 3, "time / FlashKDA": 3}
    for col, n in sig.items():
        df[col] = df[col].map(lambda v: None if v is None or v != v else float(f"{v:.{n}g}"))
    return df


@figure
def paths_plot(stage_id="09"):
    """The figure of :func:`paths_table`: per shape, the GPU time of the
    previous stage, the rule, every path and FlashKDA, coloured against the
    previous stage, and the peak memory of the split path (the previous
    stage's), the rule (split or fused by size), the fused path and FlashKDA. Live rows and
    recorded ones are told apart in the row labels when both are shown."""
    sid = normalize(stage_id)
    rows = _say_paths(sid)
    if not rows:
        return None
    pid = previous(sid)
    paths = list(getattr(load_stage(sid), "PATHS", {}))
    cells = {}
    for r in rows:
        if r.get("error") or bench.best_ms(r) is None:
            continue
        col = pid if r["stage"] == pid else FLASHKDA if r["stage"] == FLASHKDA else r["path"]
        cells[(bench.shape_label(r), col)] = dict(ms=bench.best_ms(r), peak_mb=r.get("peak_mb"))
    shapes = list(dict.fromkeys(bench.shape_label(r) for r in rows))
    for sh in shapes:  # every fused width allocates the same (no workspace): the first one measured stands for all
        fused = next((cells[(sh, p)] for p in paths if p.startswith("fused") and (sh, p) in cells), None)
        if fused is not None:
            cells[(sh, "fused")] = fused
    where = {bench.shape_label(r): r["where"] for r in rows}
    mixed = len(set(where.values())) > 1
    labels = [s + (f" ({where[s]})" if mixed else "") for s in shapes]
    mem = [(f"stage {pid}", pid), ("rule", "rule"), ("fused (any width)", "fused"), (FLASHKDA, FLASHKDA)]
    meta = _paths(sid)[2] or {}
    if mixed:
        src = "live and recorded rows"
    elif where[shapes[0]] == "live":
        src = "measured live"
    else:
        src = f"recorded on {meta.get('device')}, {str(meta.get('date'))[:10]}, commit {meta.get('commit')}"
    return plot_paths(cells, shapes=shapes, columns=[pid, "rule"] + paths + [FLASHKDA], ref=pid,
                      mem_columns=mem, row_labels=labels,
                      title=f"Stage {sid}'s paths beside stage {pid} and FlashKDA ({src})")


# What each region of the fused kernel's profile times (kda.cu, the banner of
# kda_fused_kernel: the prepare warps reuse K1's region ids for K1's phases and
# the load warp's for the rest), in the order a chunk goes through them.
FUSED_PREPARE = {
    "fused prepare: team barrier": "barrier",
    "K2 producer: issue loads (+ stage rows, fused)": "rows +\nnext loads",
    "K2 producer: wait (free slot, barrier)": "free slot",
    "fused prepare: decay columns": "decay",
    "K1: L/Aqk products": "L, Aqk",
    "K1: inverse": "inverse",
    "K1: w/u + store": "w, u",
}
FUSED_COMPUTE_WAIT = "K2: wait for operands"
FUSED_BARRIER, FUSED_DECAY = "fused prepare: team barrier", "fused prepare: decay columns"
# The fused kernel's prepare teams are a fact of its stage (stage.py PREP_TEAMS, the
# kernel's kPrepTeams): thread 0 of each team adds its timeline to the block's prepare
# regions, so these hold the sum of the teams' timelines, each spanning the block's
# lifetime. (The recorded files are of kernels with that many teams: each stage's RECORDS["paths"].)
def prep_teams(stage_id=None) -> int:
    """The prepare teams of a stage's fused kernel (its stage.py PREP_TEAMS; None: the first
    stage with a fused path)."""
    return load_stage(stage_id or fused_stage()).PREP_TEAMS


def chunk_profile(prof: dict, T: int, chunk: int = 16, teams: int | None = None) -> dict:
    """A profile of the fused kernel (region -> clock64 cycles per block, mean
    over blocks) per chunk: {"prepare warps": {region: cycles / (teams NT)},
    "compute warps": {region: cycles / NT}} with NT = ceil(T / chunk), the
    regions in the order a chunk goes through them; the prepare regions are the
    sum over the kernel's ``teams`` prepare teams, each working on every
    teams-th chunk, so they are shown per team (a team's cycles per chunk of the
    block; default: stage 09's PREP_TEAMS). The two groups time the same block side by side, so their totals
    must agree (within 5%); otherwise this is not one fused block's profile (a
    split path's, a region missing, the wrong team count): ValueError."""
    if T < 1:
        raise ValueError(f"T must be positive, got {T}")
    if FUSED_DECAY not in prof and "K1: load+pre-stage" in prof and FUSED_BARRIER not in prof:
        # a record of the kernels before the fused prepare had regions of its own (before 2026-12-01 late):
        # its decay phase was timed as K1's first region, its team barrier inside the wait for a free slot
        prof = {(FUSED_DECAY if r == "K1: load+pre-stage" else r): v for r, v in prof.items()}
        prof[FUSED_BARRIER] = 0.0
    teams = prep_teams() if teams is None else teams
    nt = -(-T // chunk)
    prep = {r: prof[r] / (nt * teams) for r in FUSED_PREPARE if r in prof}
    comp = {FUSED_COMPUTE_WAIT: prof.get(FUSED_COMPUTE_WAIT, 0.0) / nt}
    comp.update({r: v / nt for r, v in prof.items() if r.startswith("K2:") and r != FUSED_COMPUTE_WAIT})
    missing = [r for r in list(FUSED_PREPARE) + [FUSED_COMPUTE_WAIT] if r not in prof]
    if missing:
        raise ValueError(f"not a profile of the fused kernel: no {', '.join(missing)}")
    a, b = sum(prep.values()), sum(comp.values())
    if not (a > 0 and b > 0) or abs(a - b) > 0.05 * max(a, b):
        raise ValueError(f"the prepare warps ({a:.3g} cycles per chunk) and the compute warps ({b:.3g}) of one "
                         "fused block must span the same time: not one fused block's profile")
    return {"prepare warps": prep, "compute warps": comp}


def chunk_totals(groups: dict) -> dict:
    """Totals of :func:`chunk_profile`, cycles per chunk: the prepare warps,
    the compute warps, their wait for operands and the chain (the rest)."""
    prep, comp = sum(groups["prepare warps"].values()), sum(groups["compute warps"].values())
    wait = groups["compute warps"][FUSED_COMPUTE_WAIT]
    return dict(prepare=prep, compute=comp, wait=wait, chain=comp - wait)


def _fused_row(stage_id):
    """(profile, shape, path, where) of the fused kernel: live on a GPU under
    ``stage.path`` (the profile build), else the recorded row. The kernels the
    call launched must be the fused kernel alone (ValueError otherwise)."""
    sid = normalize(stage_id)
    info = paths_recorded()[sid]
    stage = load_stage(sid)
    if "profile" not in info:
        print(f"no fused-kernel profile of {stage.SPEC.name} is recorded or taken here (its kernels are stage "
              f"{previous(sid)}'s: see that stage's notebook)")
        return None
    path, shape = info["profile_path"], info["profile_shape"]
    ok, why = stage.SPEC.runnable_here()
    if ok:
        print(f"profiling {stage.SPEC.name} ({path}) live at {bench.shape_label(shape)} ...", flush=True)
        build(sid)
        kw = bench.path_inputs(shape)
        with stage.path(path):
            prof = stage.profile(**kw)
            kernels = [x["kernel"] for x in stage.build(profile=True).launches()]
        row, where = dict(stage=sid, path=path, **shape, profile=prof, kernels=kernels), "live"
    else:
        meta, rec = _recorded(info["profile"])
        hits = [r for r in rec if r.get("stage") == sid and r.get("path") == path
                and bench.shape_label(r) == bench.shape_label(shape) and r.get("profile")]
        if not hits:
            print(f"no recorded profile of {path} at {bench.shape_label(shape)} ({why})")
            return None
        row, where = hits[-1], "recorded"
        print(f"{stage.SPEC.name} ({path}): recorded ({why}) -- {results.label(meta)}")
    if set(row.get("kernels") or ()) != FUSED_KERNELS:
        raise ValueError(f"the profile of {path} launched {row.get('kernels')}, not the fused kernel alone")
    return row, where


@figure
def fused_profile(stage_id="09"):
    """Where a chunk's time goes in the fused kernel: the prepare warps'
    regions against the compute warps' (their wait for operands, then the
    recurrence's chain), clock64 cycles per chunk on one axis
    (:func:`chunk_profile`). Live on a GPU (the fused path pinned), else the
    recorded profile (results/h200/stageNN/)."""
    got = _fused_row(stage_id)
    if got is None:
        return None
    row, where = got
    teams = prep_teams(stage_id)
    groups = chunk_profile(row["profile"], row["T"], teams=teams)
    tot = chunk_totals(groups)
    print(f"per chunk: prepare warps {tot['prepare']:.3g} cycles; compute warps {tot['compute']:.3g} "
          f"(waiting for operands {tot['wait']:.3g}, the chain {tot['chain']:.3g})")
    prev = previous(normalize(stage_id))
    info = paths_recorded().get(prev, {}) if prev is not None else {}
    if str(info.get("profile_path", "")).startswith("fused"):  # the fused kernel before the step: what it moved
        before = _fused_row(prev)
        if before is not None:
            pt = chunk_totals(chunk_profile(before[0]["profile"], before[0]["T"], teams=prep_teams(prev)))
            print(f"stage {prev}, the same shape and path: prepare warps {pt['prepare']:.3g} cycles; compute warps "
                  f"{pt['compute']:.3g} (waiting for operands {pt['wait']:.3g}, the chain {pt['chain']:.3g})")
    ncw = load_stage(stage_id).PATHS[row["path"]][1]
    bars = {f"{teams} x 4 prepare warps": groups["prepare warps"], f"{ncw} compute warps": groups["compute warps"]}
    labels = dict(FUSED_PREPARE, **{FUSED_COMPUTE_WAIT: "waiting for\nthe prepare"})
    first = next(r for r in groups["compute warps"] if r != FUSED_COMPUTE_WAIT)
    chain = format_total(tot["chain"], "cycles").replace(" cycles", "")
    return plot_chunk_timeline(bars, labels=labels, brace=(f"{ncw} compute warps", first, f"the chain: {chain}"),
                               title=f"The fused kernel ({row['path']}) per chunk, {bench.shape_label(row)} "
                                     f"({'measured live' if where == 'live' else 'recorded on the H200'})")


# ---- packed sequences (stage 11): one call over sequences of different lengths ----

VARLEN_MIX_ORDER = ("flashkda", "serving64", "long+short", "few-long")  # scripts/bench_varlen.py MIXES
NO_HYBRID = "long_from=0"  # the pin that turns the hybrid off (bench_varlen --paths): what it bought
VARLEN_LIVE_MIX = "flashkda"  # the mix timed live on a GPU (FlashKDA's varlen shape: seconds)
VARLEN_LIVE_TIMEOUT_S = 600
_VARLEN: dict = {}  # stage id -> (rows, notes, recorded meta): measured once per notebook session


def varlen_demo(lengths=(7, 0, 20, 33), H=2, K=64, V=64, seed=0, stage_id="11") -> pd.DataFrame:
    """Packed sequences on the fp64 token loop, small enough for a CPU (on
    the stage's bf16 inputs, in fp64): the packed call (common.checks.kda_reference_varlen with cu_seqlens) against
    each sequence called alone (common.reference.kda_reference on its slice
    and its own h0), and against the packed tensor taken as one long
    sequence (no cu_seqlens: the state runs on across the boundaries). One
    row per sequence, the largest absolute difference of its o and of its
    final state. Prints whether the V-first final state is the K-first one
    transposed. On a GPU the stage's packed call (bf16) is added, as the
    relative error of each sequence against the one called alone."""
    from .metrics import rel_err
    from .reference import kda_reference

    case = checks.VarlenCase(tuple(lengths), H=H, K=K, V=V, h0=True, state_v_first=False, seed=seed)
    spec = load_stage(stage_id).SPEC
    low = checks.varlen_inputs(case, "cpu", spec.compute_dtype)  # the stage's inputs (bf16)
    inp = {n: (x.to(torch.float64) if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in low.items()}
    b = case.bounds()
    print(f"{case.N} sequences of {', '.join(map(str, lengths))} tokens packed into T = {case.T}; "
          f"cu_seqlens = {b}")
    with torch.no_grad():
        o_p, S_p = checks.kda_reference_varlen(**inp)
        h0 = inp["initial_state"]
        o_one, _ = checks.kda_reference_varlen(**dict(inp, cu_seqlens=None, initial_state=h0[:1]))
        vf = dict(inp, initial_state=h0.transpose(-1, -2).contiguous(), state_v_first=True)
        _, S_vf = checks.kda_reference_varlen(**vf)
        ref_kw = {x: inp[x] for x in ("A_log", "dt_bias", "scale", "gate", "lower_bound")}
        alone = []
        for n in range(case.N):
            s, e = b[n], b[n + 1]
            if e == s:  # nothing to run: its final state is its h0
                alone.append((None, h0[n].to(torch.float64)))
                continue
            o, S = kda_reference(*(inp[x][:, s:e] for x in ("q", "k", "v", "g", "beta")),
                                 initial_state=h0[n:n + 1], **ref_kw)
            alone.append((o, S[0]))
    got = None
    ok, why = spec.runnable_here()
    if ok:
        got = checks.run_varlen(load_stage(stage_id).forward, low, checks.stage_device(spec))
    rows = []
    for n in range(case.N):
        s, e = b[n], b[n + 1]
        o_a, S_a = alone[n]
        d = {"sequence": n, "tokens": f"{s}..{e - 1}" if e > s else "(empty)", "length": e - s,
             "packed vs alone: max |o diff|": None if o_a is None else (o_p[:, s:e] - o_a).abs().max().item(),
             "packed vs alone: max |S diff|": (S_p[n] - S_a).abs().max().item(),
             "one long sequence vs alone: o rel. error":
                 None if o_a is None else rel_err(o_one[:, s:e], o_a)}
        if got is not None:
            d[f"{spec.name} (bf16) packed vs alone: o rel. error"] = \
                None if o_a is None else rel_err(got["o"][:, s:e], o_a)
            d[f"{spec.name} (bf16) packed vs alone: S rel. error"] = rel_err(got["S"][n], S_a)
        rows.append(d)
    d = (S_vf.transpose(-1, -2) - S_p).abs().max().item()
    print(f"V-first final states [N, H, V, K] against the K-first ones [N, H, K, V] transposed: max |S diff| "
          f"{d:.1e} (of states up to {S_p.abs().max().item():.2f}; fp64 round-off, the sums in another order)")
    print(f"{spec.name} packed on this machine: " + ("measured live, bf16, the last columns" if got is not None
                                                     else f"not run ({why})"))
    bad = [f"sequence {r['sequence']}: packed and alone differ by {r[c]:.1e}" for r in rows
           for c in ("packed vs alone: max |o diff|", "packed vs alone: max |S diff|") if r[c] not in (None, 0.0)]
    bad += [f"sequence {r['sequence']}: as one long sequence only {r['one long sequence vs alone: o rel. error']:.1e} "
            "from alone (the state did not run on across the boundary)" for r in rows[1:]
            if r["one long sequence vs alone: o rel. error"] is not None
            and not r["one long sequence vs alone: o rel. error"] > 1e-2]
    if got is not None:
        bad += [f"sequence {r['sequence']}: {out} {r[col]:.1e} from alone (tolerance {spec.tol(out)})"
                for r in rows for out in ("o", "S")
                if (col := f"{spec.name} (bf16) packed vs alone: {out} rel. error") and r[col] is not None
                and not r[col] <= spec.tol(out)]
    fail_if(bad, "packed sequences")
    df = pd.DataFrame(rows).set_index("sequence")
    return df.style.format({c: "{:.1e}" for c in df.columns if c not in ("tokens", "length")}, na_rep="-")


def _varlen_live(stage_id):
    """On a GPU: scripts/bench_varlen.py at VARLEN_LIVE_MIX (its measurement, in a subprocess, fp64
    reference included), as rows. Returns (rows, note)."""
    import json
    import subprocess
    import sys
    import tempfile

    from .paths import REPO_ROOT

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "varlen.json"
        cmd = [sys.executable, str(REPO_ROOT / "scripts" / "bench_varlen.py"), "--mixes", VARLEN_LIVE_MIX,
               "--budget", "0.3", "--stage", normalize(stage_id), "--out", str(out)]
        print(f"timing the packed call live at mix {VARLEN_LIVE_MIX} (python scripts/bench_varlen.py --mixes "
              f"{VARLEN_LIVE_MIX} --budget 0.3; about 30 s) ...", flush=True)
        try:
            run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=VARLEN_LIVE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return [], f"the live run took more than {VARLEN_LIVE_TIMEOUT_S} s: every mix recorded"
        if run.returncode != 0 or not out.exists():
            tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or [""]
            return [], f"the live run failed (exit {run.returncode}: {tail[0][:200]}): every mix recorded"
        return json.loads(out.read_text())["rows"], ""


def _varlen(stage_id="11"):
    """The packed-sequence rows of a varlen stage: live at VARLEN_LIVE_MIX on a GPU
    (:func:`_varlen_live`), recorded for the rest (the stage's RECORDS["varlen"]).
    Returns (rows, each with where = "live" or "recorded"; notes; the recorded
    file's meta). Measured once per notebook session."""
    sid = normalize(stage_id)
    if sid in _VARLEN:
        return _VARLEN[sid]
    data = varlen_record(sid) or {}
    spec = load_stage(sid).SPEC
    meta = data.get("meta")
    # this stage's rows (a record may hold the next stage's too), FlashKDA's and the per-sequence loop's
    rec = [r for r in data.get("rows", []) if r.get("stage") in (None, spec.name) or r.get("per_sequence_loop")]
    ok, why = spec.runnable_here()
    notes, live = [], []
    if ok:
        live, note = _varlen_live(sid)
        if note:
            notes.append(note)
    live_mixes = {r["mix"] for r in live}
    rows = [dict(r, where="live") for r in live] + [dict(r, where="recorded") for r in rec
                                                    if r["mix"] not in live_mixes]
    if not ok:
        notes.append(f"{spec.name} packed: recorded ({why})" if rec else f"{spec.name} packed: no figures ({why})")
    elif live_mixes:
        notes.append(f"mix {', '.join(sorted(live_mixes))}: measured live; the other mixes recorded (they take "
                     "minutes: python scripts/bench_varlen.py times them all)")
    _VARLEN[sid] = (rows, notes, meta)
    return _VARLEN[sid]


def _say_varlen(stage_id):
    return _say(*_varlen(stage_id))


def _varlen_impl(row) -> str:
    """An implementation's label across mixes (the per-sequence loop's call count dropped)."""
    return re.sub(r" \(\d+ calls\)$", "", row["impl"])


def varlen_table(stage_id="11") -> pd.DataFrame:
    """Packed sequences: per mix of sequence lengths (N sequences, T tokens in
    all, H heads, K = V = 128), the stage's packed call in both state layouts,
    FlashKDA's varlen call and, where measured, the stage before called once
    per sequence: GPU time (CUDA-graph replay), time over FlashKDA's, and the
    relative error of o and of the final states against the fp64 token loop
    run sequence by sequence. Live at one mix on a GPU, else recorded
    (results/h200/stageNN/varlen_*.json)."""
    rows = _say_varlen(stage_id)
    order = {m: i for i, m in enumerate(VARLEN_MIX_ORDER)}
    out = []
    for r in sorted(rows, key=lambda r: order.get(r["mix"], 99)):
        out.append({"mix": r["mix"], "N": r["N"], "T": r["T"], "H": r["H"], "impl": r["impl"],
                    "GPU ms": r.get("gpu_ms"), "x FlashKDA": r.get("vs_flashkda"),
                    "o err vs fp64": r.get("o_err_ref"), "S err vs fp64": r.get("S_err_ref"),
                    "where": r["where"] + (f" (failed: {r['error']})" if r.get("error") else "")})
    spec = load_stage(stage_id).SPEC
    fail_if([f"{r['mix']} {r['impl']}: " + (f"failed: {r['error']}" if r.get("error") else
                                             f"o {r.get('o_err_ref')}, S {r.get('S_err_ref')} against fp64")
             for r in rows if r.get("stage") == spec.name
             and (r.get("error") or not (r.get("o_err_ref", 0) <= spec.tol("o") and r.get("S_err_ref", 0)
                                         <= spec.tol("S")))], f"packed sequences of {spec.name}")
    if not out:
        return pd.DataFrame()
    df = pd.DataFrame(out).set_index(["mix", "N", "T", "H", "impl"])
    return df.style.format({"GPU ms": "{:.4f}", "x FlashKDA": "{:.3f}", "o err vs fp64": "{:.2e}",
                            "S err vs fp64": "{:.2e}"}, na_rep="-")


@figure
def varlen_plot(stage_id="11"):
    """The figure of :func:`varlen_table`: per mix, the GPU time of FlashKDA's
    varlen call, the stage's packed call (V-first state, FlashKDA's layout), the
    same without the hybrid (pinned long_from=0, where recorded) and the stage
    before called once per sequence, each bar labelled, "n/a" where not measured."""
    rows = _say_varlen(stage_id)
    if not rows:
        return None
    sid = normalize(stage_id)
    name = load_stage(sid).SPEC.name
    keep = {FLASHKDA, f"{name} (V-first state)", f"{name} (V-first state) {NO_HYBRID}"}
    order = {m: i for i, m in enumerate(VARLEN_MIX_ORDER)}
    mixed = len({r["where"] for r in rows}) > 1
    bars = []
    for r in sorted(rows, key=lambda r: order.get(r["mix"], 99)):
        impl = _varlen_impl(r)
        if impl not in keep and not r.get("per_sequence_loop") and "once per sequence" not in impl:
            continue
        label = f"{r['mix']}\nN={r['N']} T={r['T']} H={r['H']}" + (f"\n({r['where']})" if mixed else "")
        if NO_HYBRID in impl:  # a label of its own (and so a colour of its own): the stage without the hybrid
            impl = f"without the hybrid ({NO_HYBRID})"
        bars.append(dict(mix=label, impl=impl, ms=None if r.get("error") else r.get("gpu_ms")))
    bars.sort(key=lambda b: {FLASHKDA: 0}.get(b["impl"], 1 if b["impl"].startswith(name)
                                              else 1.5 if NO_HYBRID in b["impl"] else 2))
    bars.sort(key=lambda b: order.get(b["mix"].split("\n")[0], 99))  # stable: mixes in order, bars in order
    meta = _varlen(sid)[2] or {}
    src = "live and recorded rows" if mixed else "measured live" if rows[0]["where"] == "live" else \
        f"recorded on {meta.get('device')}, {str(meta.get('date'))[:10]}, commit {meta.get('commit')}"
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(11, 4.2))  # wide enough that neighbouring bars' values do not run together
    return plot_bars(bars, x="mix", y="ms", by="impl", ax=ax, logy=False, ylabel="GPU ms per call",
                     value_fmt=".4g", value_rotation=0, value_fontsize=7,
                     title=f"Packed sequences at K = V = 128, GPU time ({src})")


def paths_recorded() -> dict:
    """{stage id: its recorded paths} as the stages declare them (RECORDS["paths"] in stage.py)."""
    return declared_records("paths")




def write_figures(root) -> list:
    """The README's figures (report.README_FIGURES), drawn from the recorded results (no GPU needed):
    the ladder at the seed's shape and the tensor-core stages against FLA and
    FlashKDA at the H200 shapes."""
    import matplotlib.pyplot as plt

    draw = {"ladder": ladder, "tensor-core shapes": lambda: tc_latency(tensor_core_stages())}
    out = []
    for key, fn in draw.items():
        ax, _ = fn()
        path = Path(root) / README_FIGURES[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        ax.figure.savefig(path, dpi=110, bbox_inches="tight")
        out.append(path)
    plt.close("all")
    return out


# ---------------------------------------------------------------------------
# Stage 12: the softplus gate's records
# ---------------------------------------------------------------------------
# Notebook 12's tables and figures: one chunk at the gate's extremes and the wide chunks of the benchmark's inputs
# (on the CPU), then the H200 records its stage.py declares (RECORDS: accuracy, fla_speed, products, ring, race,
# bounded_before, summit, gate_profile), each table naming its record once.

EXTREME_CHUNK = dict(K=64, T=32, seed=0)  # one head of the extreme checks' inputs, two chunks long
WIDE_INPUTS = dict(B=1, T=8192, H=32, K=128, seed=0)  # Kimi Linear's shape, where wide chunks are counted on the CPU
_WIDE: dict = {}  # stage id -> (the table's rows, each inputs' chunk decays): counted once per notebook session


def _stage_records(stage_id, key: str, say: bool = True):
    """The records a stage declares as ``RECORDS[key]`` (a name or a list: common.stages.record_names), loaded,
    and their meta as one (devices, dates and commits joined). With ``say``, prints one line naming the file(s)
    and where they were recorded (results.label). Returns (the records, in the declared order; that meta)."""
    sid = normalize(stage_id)
    names = record_names(declared_records(key)[sid])
    data = [results.recorded(n) for n in names]
    paths = [os.path.normpath(f"results/h200/{n}.json") for n in names]
    missing = [p for p, d in zip(paths, data) if d is None]
    if missing:
        raise FileNotFoundError(f"stage {sid} declares RECORDS[{key!r}], and {', '.join(missing)} is not there")
    meta = {f: ", ".join(dict.fromkeys(str(d["meta"].get(f)) for d in data)) for f in ("device", "date", "commit")}
    meta["file"] = ", ".join(paths)
    if say:
        folder = os.path.commonpath(paths) if len(paths) > 1 else None
        where = paths[0] if folder is None else f"{folder}/ ({', '.join(os.path.relpath(p, folder) for p in paths)})"
        print(f"{where}: {results.label(dict(meta, file=None))}")  # the files named once, before the colon
    return data, meta


def _own_or_recorded(stage_id, key: str, name: str):
    """(meta, rows) of the record the stage declares as ``RECORDS[key]`` if it declares one, else of
    results/h200/<name>.json (_recorded)."""
    if normalize(stage_id) in declared_records(key):
        (data,), _ = _stage_records(stage_id, key, say=False)
        return data["meta"], data["rows"]
    return _recorded(name)


def _part(data: dict, what: str) -> list[dict]:
    """The rows of one part of a recorded call (scripts/bench_softplus.py's parts: "accuracy", "speed", ...)."""
    return [r for r in data["rows"] if r.get("part") == what]


def _two_line_shape(label: str) -> str:
    """A shape's label on two lines for a bar's tick ("B1 T8192\\nH32 K128"; V = K left out)."""
    return "{} {}\n{} {}".format(*label.split()[:4])


def _ratio_panel(ax, fontsize: float) -> None:
    """A panel of ratios (plot_bars) finished: a line at 1, no legend, the shapes' labels level and centred."""
    import matplotlib.pyplot as plt

    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.get_legend().remove()
    plt.setp(ax.get_xticklabels(), rotation=0, ha="center", fontsize=fontsize)


# ---- one chunk at the gate's extremes, on the CPU: its products three ways ----

def _chunk_products_factored(qn, kn, b, gc, scale):
    """L and Aqk of one chunk as stages 05-11 form them: one product of k e^gc against k e^-gc."""
    e, ie = torch.exp(gc), torch.exp(-gc)
    return torch.tril(b[:, None] * ((kn * e) @ (kn * ie).T), -1), torch.tril(scale * ((qn * e) @ (kn * ie).T))


def _chunk_products_pairwise(qn, kn, b, gc, scale):
    """L and Aqk of one chunk pair by pair: exp(gc_i - gc_j) for i >= j only, every factor <= 1."""
    n = gc.shape[0]
    i_ge_j = torch.ones(n, n, dtype=torch.bool).tril()[:, :, None]
    d = torch.exp(torch.where(i_ge_j, gc[:, None] - gc[None, :], -torch.inf))  # [i, j, K]
    return (torch.tril(b[:, None] * torch.einsum("id,jd,ijd->ij", kn, kn, d), -1),
            scale * torch.einsum("id,jd,ijd->ij", qn, kn, d))


def _chunk_products_tiles(qn, kn, b, gc, scale):
    """L and Aqk of one chunk as products_pairwise forms them (stage 12's prepare.cuh): 4 x 4 tiles, those below
    the diagonal through their first row r, exp(gc_i - gc_r) exp(gc_r - gc_j). Returns (L, Aqk, the largest
    factor taken)."""
    n = gc.shape[0]
    L, A = torch.zeros(n, n, dtype=gc.dtype), torch.zeros(n, n, dtype=gc.dtype)
    top = 0.0
    for I in range(n // 4):
        for J in range(I + 1):
            i, j = slice(4 * I, 4 * I + 4), slice(4 * J, 4 * J + 4)
            if I == J:
                L[i, j], A[i, j] = _chunk_products_pairwise(qn[i], kn[i], b[i], gc[i], scale)
                continue
            r = 4 * I
            fi, fj = torch.exp(gc[i] - gc[r]), torch.exp(gc[r] - gc[j])  # 3 + 4 exponentials per feature
            top = max(top, fi.max().item(), fj.max().item())
            L[i, j] = b[i, None] * (kn[i] * fi) @ (kn[j] * fj).T
            A[i, j] = scale * (qn[i] * fi) @ (kn[j] * fj).T
    return L, A, top


def softplus_extremes(stage_id="12"):
    """One chunk at the softplus gate's extremes, on the CPU: one head of the extreme checks' inputs
    (common.inputs.make_inputs(extreme=True)), activated in fp32; how far its key dimensions decay and where
    exp(-gc) leaves fp32; then the chunk's L and Aqk factored (stages 05-11), pair by pair and through the
    4 x 4 tiles' reference rows (the stage's), in fp32 against float64: entries not finite, relative errors."""
    from .inputs import make_inputs
    from .metrics import rel_err
    from .reference import activate

    sid = normalize(stage_id)
    K, bt = EXTREME_CHUNK["K"], load_stage(sid).SPEC.default_chunk
    scale = K ** -0.5
    inp = make_inputs(B=1, T=EXTREME_CHUNK["T"], H=1, K=K, gate="softplus", extreme=True, seed=EXTREME_CHUNK["seed"])

    def chunk(dtype, c=0):  # qn, kn, sigmoid(beta) and gc of chunk c (one head), activated in dtype; gc: [bt, K]
        qn, kn, b, a = activate(*(inp[n].to(dtype) for n in ("q", "k", "g", "beta", "A_log", "dt_bias")))
        s = slice(bt * c, bt * (c + 1))
        return qn[0, s, 0], kn[0, s, 0], b[0, s, 0], a[0, s, 0].cumsum(0)

    qn, kn, b, gc = chunk(torch.float32)
    decay = -gc[-1]
    print(f"A_log = {inp['A_log'].item():.2f}: over the chunk each key dimension decays by {decay.min():.0f} to "
          f"{decay.max():.0f} (median {decay.median():.0f})")
    print(f"fp32: exp(-gc) is inf at {torch.isinf(torch.exp(-gc)).sum()} of {gc.numel()} entries, "
          f"exp(gc) is 0 at {(torch.exp(gc) == 0).sum()}")
    L_f, A_f = _chunk_products_factored(qn, kn, b, gc, scale)
    print(f"factored: {(~L_f.isfinite()).sum()} of {bt * (bt - 1) // 2} entries of L (below the diagonal) and "
          f"{(~A_f.isfinite()).sum()} of {bt * (bt + 1) // 2} of Aqk are inf or NaN")
    L64, A64 = _chunk_products_pairwise(*chunk(torch.float64), scale)  # the ground truth: float64 throughout
    L_t, A_t, top = _chunk_products_tiles(qn, kn, b, gc, scale)
    rows = []
    for name, (L, A) in {"factored (stages 05-11)": (L_f, A_f),
                         "pairwise": _chunk_products_pairwise(qn, kn, b, gc, scale),
                         f"4 x 4 tiles, reference rows (stage {sid})": (L_t, A_t)}.items():
        rows.append({"fp32 products": name, "L not finite": int((~L.isfinite()).sum()),
                     "Aqk not finite": int((~A.isfinite()).sum()),
                     "L rel. error vs float64": rel_err(L, L64), "Aqk rel. error vs float64": rel_err(A, A64)})
    print(f"the largest factor the tiles took: {top:.3g}; |L| up to {L64.abs().max():.3g}, |Aqk| up to "
          f"{A64.abs().max():.3g} in float64")
    return pd.DataFrame(rows).set_index("fp32 products").style.format(
        {"L rel. error vs float64": "{:.1e}", "Aqk rel. error vs float64": "{:.1e}"})


# ---- how many chunks are wide: the benchmark's inputs at Kimi Linear's shape, on the CPU ----

def _wide(stage_id):
    """The wide chunks (stage.wide_chunks) of the benchmark's softplus inputs at WIDE_INPUTS, realistic and at
    the extremes, and each chunk's decay: the largest over its key dimensions of -glast (the sum of a over its
    16 tokens). Returns (the table's rows, {inputs: decays}); counted once per notebook session."""
    import numpy as np

    from .inputs import make_inputs
    from .reference import log_decay

    sid = normalize(stage_id)
    if sid not in _WIDE:
        stage = load_stage(sid)
        spread, rows = {}, []
        for name, extreme in (("realistic", False), ("extreme=True", True)):
            x = make_inputs(**WIDE_INPUTS, gate="softplus", extreme=extreme)
            a = log_decay(x["g"], x["A_log"], x["dt_bias"])
            wide, total = stage.wide_chunks(a)
            d = -a[0].double().reshape(-1, 16, WIDE_INPUTS["H"], WIDE_INPUTS["K"]).sum(1)
            spread[name] = d.amax(-1).flatten().numpy()
            rows.append({"inputs": name, "wide chunks": wide, "chunks": total, "wide %": 100 * wide / total,
                         "median decay per chunk": np.median(spread[name]), "largest": spread[name].max()})
            del x, a, d
        _WIDE[sid] = rows, spread
    return _WIDE[sid]


def _wide_label() -> str:
    return "B{B} T{T} H{H} K{K}".format(**WIDE_INPUTS)


def wide_chunks(stage_id="12"):
    """How many chunks go pair by pair (stage.wide_chunks: some key dimension decays by more than
    stage.FACTORED_RANGE within the chunk) in the benchmark's softplus inputs at Kimi Linear's shape,
    realistic and at the extremes, on the CPU; with the median and the largest decay per chunk."""
    print(f"stage.FACTORED_RANGE = {load_stage(stage_id).FACTORED_RANGE:g}")
    rows, _ = _wide(stage_id)
    print(f"{_wide_label()}, seed {WIDE_INPUTS['seed']}")
    return pd.DataFrame(rows).set_index("inputs").style.format(
        {"wide %": "{:.3f}", "median decay per chunk": "{:.3g}", "largest": "{:.3g}"})


@figure
def wide_chunks_plot(stage_id="12"):
    """The figure of :func:`wide_chunks`: the histogram of the chunks' decays, realistic and extreme inputs,
    and the line above which a chunk goes pair by pair."""
    import matplotlib.pyplot as plt
    import numpy as np

    line = load_stage(stage_id).FACTORED_RANGE
    _, spread = _wide(stage_id)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    bins = np.logspace(0, 4, 49)  # decays below 1 drawn in the first bin
    for name, d in spread.items():
        ax.hist(np.clip(d, 1, None), bins=bins, alpha=0.6,
                label=f"{name}: {(d > line).sum()} of {d.size} chunks wide")
    ax.axvline(line, color="black", ls="--", lw=1)
    ax.text(line * 1.1, ax.get_ylim()[1] * 0.9, f"{line:g}: pair by pair above", fontsize=8, va="top")
    ax.set_xscale("log")
    ax.set_xlabel("a chunk's decay: max over key dimensions of -glast (natural log)")
    ax.set_ylabel("chunks")
    ax.set_title(f"Softplus gate, {_wide_label()} on the CPU: which chunks go pair by pair", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return ax


# ---- the H200 records ----

def softplus_accuracy(stage_id="12"):
    """Accuracy on every softplus check case (RECORDS["accuracy"]): the stage as it runs, with u from Af rounded
    once, pinned pair by pair, and FLA, in one call on the same bf16 inputs, each against fp64; per output, on
    how many cases the stage is below FLA and what u in two halves bought; the wide chunks of each case."""
    from .metrics import TOLERANCE

    sid = normalize(stage_id)
    (data,), _ = _stage_records(sid, "accuracy")
    acc = pd.DataFrame(_part(data, "accuracy")).set_index("case")
    for out in ("o", "S"):
        b = acc[f"{out}_err"] < acc[f"fla_{out}_err"]
        print(f"{out}: below FLA's on {b.sum()} of {len(acc)} cases"
              + "".join(f"; above at {c}: {acc.at[c, out + '_err']:.2e} against {acc.at[c, 'fla_' + out + '_err']:.2e}"
                        for c in acc.index[~b]))
        gain = 1 - acc[f"{out}_err"] / acc[f"u_once_{out}_err"]
        print(f"   u in two halves: {out} {100 * gain.min():.0f}% to {100 * gain.max():.0f}% nearer fp64 than u "
              f"rounded once, which was above FLA's on {(acc[f'u_once_{out}_err'] >= acc[f'fla_{out}_err']).sum()} "
              "cases")
    print(f"every output finite: stage {sid} {bool(acc.finite.all())}, FLA {bool(acc.fla_finite.all())}; worst o: "
          f"stage {sid} {acc.o_err.max():.2e}, FLA {acc.fla_o_err.max():.2e} (the bf16 "
          f"tolerance {TOLERANCE['bf16']:.0e})")
    acc["wide"] = [f"{w} / {n}" for w, n in zip(acc.wide_chunks, acc.chunks)]
    errs = {"o_err": f"{sid}: o", "u_once_o_err": "u once: o", "pairwise_o_err": "pairwise: o",
            "fla_o_err": "FLA: o", "S_err": f"{sid}: S", "u_once_S_err": "u once: S",
            "pairwise_S_err": "pairwise: S", "fla_S_err": "FLA: S"}
    return acc[["wide", *errs]].rename(columns={"wide": "wide chunks", **errs}).style.format(
        "{:.2e}", subset=list(errs.values()))


def _fla_speed(stage_id, say: bool = True):
    """The stage's GPU time and peak memory over FLA's, per shape and round, from the records its stage.py
    declares as RECORDS["fla_speed"], in the order recorded: a shape's rows come from the last record that
    times it. Returns (the table, one row per shape and round, with its record; the shapes where FLA was not
    timed beside the stage; the records' meta)."""
    sid = normalize(stage_id)
    name = load_stage(sid).SPEC.name
    data, meta = _stage_records(sid, "fla_speed", say)
    records = [Path(n).name for n in record_names(declared_records("fla_speed")[sid])]
    calls = [_part(d, "speed") for d in data]
    latest = {bench.shape_label(r): i for i, rows in enumerate(calls) for r in rows}
    speed, untimed = [], []
    for i, rows in enumerate(calls):
        rows = [r for r in rows if latest[bench.shape_label(r)] == i]
        fla_at = {(bench.shape_label(r), r.get("round", 0)): r for r in rows if r["stage"].startswith("FLA")}
        for s in rows:
            if s["stage"] != name:
                continue
            lab = bench.shape_label(s)
            f = fla_at.get((lab, s.get("round", 0)))
            if f is None:
                untimed.append(f"{lab} ({records[i]}: stage {sid} {s['graph_ms']:.4f} ms)")
                continue
            speed.append({"shape": lab, "round": s.get("round", 0), "record": records[i],
                          f"{sid} GPU ms": s["graph_ms"], "FLA GPU ms": f["graph_ms"],
                          f"time {sid} / FLA": s["graph_ms"] / f["graph_ms"], f"{sid} peak MB": s["peak_mb"],
                          "FLA peak MB": f["peak_mb"], f"peak {sid} / FLA": s["peak_mb"] / f["peak_mb"]})
    return pd.DataFrame(speed).set_index(["shape", "round"]), untimed, meta


def softplus_fla_speed(stage_id="12"):
    """The stage's GPU time (CUDA-graph replay) and peak memory beside FLA's chunk_kda in one call, softplus
    gate, per shape and round (:func:`_fla_speed`). Fails where a round is above the stage's aim
    (stage.FLA_TIME_TARGET of FLA's time) or FLA was not timed beside the stage."""
    sid = normalize(stage_id)
    target = load_stage(sid).FLA_TIME_TARGET
    speed, untimed, _ = _fla_speed(sid)
    t, p = f"time {sid} / FLA", f"peak {sid} / FLA"
    over = speed[speed[t] > target]
    print(f"stage {sid} over FLA at {speed.index.get_level_values(0).nunique()} shapes, {len(speed)} rounds: "
          f"GPU time {speed[t].min():.2f}x to {speed[t].max():.2f}x, peak memory {speed[p].min():.2f}x to "
          f"{speed[p].max():.2f}x")
    print(f"within {target}x in {len(speed) - len(over)} of {len(speed)} rounds"
          + "".join(f"; above at {lab} round {rnd}: {r[t]:.2f}x" for (lab, rnd), r in over.iterrows()))
    print("FLA not timed in these calls at: " + ("; ".join(untimed) or "none"))
    fail_if([f"{lab} round {rnd}: {r[t]:.3f}x FLA's time" for (lab, rnd), r in over.iterrows()]
            + [f"{x}: FLA not timed beside it" for x in untimed], f"the {target}x target")
    return speed.style.format({f"{sid} GPU ms": "{:.4f}", "FLA GPU ms": "{:.4f}", t: "{:.3f}",
                               f"{sid} peak MB": "{:.1f}", "FLA peak MB": "{:.1f}", p: "{:.3f}"})


@figure
def softplus_fla_speed_plot(stage_id="12"):
    """The figure of :func:`softplus_fla_speed`: per shape, the slower round's GPU time and peak memory over
    FLA's, with the stage's aim (stage.FLA_TIME_TARGET) and 1 marked; its title says where they were recorded."""
    import matplotlib.pyplot as plt

    sid = normalize(stage_id)
    target = load_stage(sid).FLA_TIME_TARGET
    speed, _, meta = _fla_speed(sid, say=False)
    worst = speed.groupby(level=0, sort=False).max()  # the slower round of each shape
    bars = [{"shape": _two_line_shape(lab), "series": f"{load_stage(sid).SPEC.name} / FLA",
             "time": r[f"time {sid} / FLA"], "memory": r[f"peak {sid} / FLA"]} for lab, r in worst.iterrows()]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.6))
    plot_bars(bars, x="shape", y="time", by="series", ax=ax1, logy=False,
              ylabel=f"GPU time, stage {sid} / FLA (slower round)", value_fmt=".2f", value_rotation=0,
              value_fontsize=7, title="GPU time over FLA's")
    plot_bars(bars, x="shape", y="memory", by="series", ax=ax2, logy=True, ylabel=f"peak memory, stage {sid} / FLA",
              value_fmt=".2f", value_rotation=0, value_fontsize=7, title="Peak memory over FLA's")
    ax1.axhline(target, color="tab:red", lw=1, ls=":", label=f"target {target}x")
    for ax in (ax1, ax2):
        _ratio_panel(ax, 7)
    ax1.legend(handles=[ax1.lines[0]], fontsize=8, loc="upper left")
    fig.suptitle(f"Stage {sid} beside FLA chunk_kda, softplus gate ({results.label(meta)}; below 1: stage {sid} "
                 "faster or smaller)", fontsize=10)
    fig.tight_layout()
    return fig


def _products(stage_id, say: bool = True):
    """RECORDS["products"]: per shape, the stage as it runs (the products chosen per chunk, "as needed") against
    pair by pair pinned in every chunk, in one call on the same inputs. Returns (the table, the record's meta)."""
    (data,), meta = _stage_records(stage_id, "products", say)
    pr = {}
    for r in _part(data, "products"):
        pr.setdefault(bench.shape_label(r), {})[r["products"]] = r
    rows = []
    for lab, d in pr.items():
        chosen, pairwise = d["as needed"], d["pairwise"]
        rows.append({"shape": lab, "wide chunks": chosen["wide_chunks"], "chunks": chosen["chunks"],
                     "wide %": 100 * chosen["wide_chunks"] / chosen["chunks"], "as needed ms": chosen["graph_ms"],
                     "pairwise ms": pairwise["graph_ms"],
                     "pairwise / as needed": pairwise["graph_ms"] / chosen["graph_ms"],
                     "rel. diff of outputs": chosen["rel_diff_vs_pairwise"]})
    prod = pd.DataFrame(rows).set_index("shape")
    return prod, meta


def products_choice(stage_id="12"):
    """What the choice per chunk bought (:func:`_products`): the wide chunks of the benchmark's inputs, and the
    GPU time of pair by pair in every chunk over the stage's, with how far apart their outputs are."""
    prod, _ = _products(stage_id)
    print(f"wide chunks of the benchmark's inputs: {prod['wide %'].min():.3f}% to {prod['wide %'].max():.3f}%")
    print(f"pair by pair in every chunk takes {prod['pairwise / as needed'].min():.2f}x to "
          f"{prod['pairwise / as needed'].max():.2f}x the GPU time of as needed; outputs "
          f"{prod['rel. diff of outputs'].min():.1e} to {prod['rel. diff of outputs'].max():.1e} apart (bf16 "
          "round-off)")
    return prod.style.format({"wide %": "{:.3f}", "as needed ms": "{:.4f}", "pairwise ms": "{:.4f}",
                              "pairwise / as needed": "{:.3f}", "rel. diff of outputs": "{:.1e}"})


@figure
def products_choice_plot(stage_id="12"):
    """The figure of :func:`products_choice`: per shape, pair by pair in every chunk over the choice per chunk,
    GPU time; its title says where it was recorded."""
    prod, meta = _products(stage_id, say=False)
    bars = [{"shape": _two_line_shape(lab), "series": "pairwise everywhere / as needed",
             "x": r["pairwise / as needed"]} for lab, r in prod.iterrows()]
    ax = plot_bars(bars, x="shape", y="x", by="series", logy=False, value_fmt=".2f", value_rotation=0,
                   value_fontsize=8, ylabel="GPU time, pairwise in every chunk / as needed",
                   title=f"What choosing per chunk bought ({results.label(meta)}; above 1: the choice is faster)")
    _ratio_panel(ax, 8)
    ax.title.set_fontsize(10)
    ax.figure.set_size_inches(10, 4)
    ax.figure.tight_layout()
    return ax


def u_and_ring(stage_id="12"):
    """What u in two halves and K2's deeper ring cost and bought, each line after its record: u in halves
    against u once (RECORDS["accuracy"]), the fastest GPU time per ring depth at K = 128 (RECORDS["ring"]),
    and the table of each K = 64 ring variant's GPU time over fresh allocations (RECORDS["race"])."""
    sid = normalize(stage_id)
    (acc,), _ = _stage_records(sid, "accuracy")
    u = {}
    for r in _part(acc, "u"):
        u.setdefault(bench.shape_label(r), {})[r["u_halves"]] = r["graph_ms"]
    ratio = pd.Series({lab: d[True] / d[False] for lab, d in u.items()})
    print(f"u in two halves takes {ratio.min():.3f}x to {ratio.max():.3f}x the GPU time")
    (ring,), _ = _stage_records(sid, "ring")
    slots = declared_records("ring")[sid]["slots"]  # the ring's slots at K = 128 that each variant built
    k128 = pd.DataFrame([{"case": f"{r['path']} {bench.shape_label(r)}", "slots": slots[r["variant"]],
                          "ms": r["fwd_graph_ms"]} for r in ring["rows"] if r["K"] == 128])
    k128 = k128.groupby(["case", "slots"]).ms.min().unstack("slots")
    print("K = 128, fastest GPU ms per depth: "
          + "; ".join(f"{c}: " + ", ".join(f"{s} slots {v:.3f}" for s, v in row.items()) for c, row in k128.iterrows()))
    (race,), _ = _stage_records(sid, "race")
    rows, slots = race["rows"], declared_records("race")[sid]["slots"]  # at K = 64, each variant's
    ring64 = pd.DataFrame([{"slots": slots[r["variant"]], "us": 1e3 * r["fwd_graph_ms"]} for r in rows])
    ring64 = ring64.groupby("slots", sort=False).us.agg(["min", "max", "count"])
    if sid in declared_records("ring_switch"):  # the switch (deep_ring), one build, both gates
        (sw,), _ = _stage_records(sid, "ring_switch")
        t = {}
        for r in sw["rows"]:
            t.setdefault((bench.shape_label(r), r["gate"]), {}).setdefault(r["ring"], []).append(r["graph_ms"])
        ratio = pd.Series({k: float(pd.Series(d["4 slots"]).median() / pd.Series(d["rule"]).median()) for k, d in t.items()})
        print(f"K = 64, deep_ring(False) in the same build: 4 slots take {ratio.min():.3f}x to {ratio.max():.3f}x "
              f"the 8-slot ring's GPU time at {len({k[0] for k in t})} shapes, both gates (median of "
              f"{len(next(iter(t.values()))['rule'])} rounds); bitwise equal: "
              f"{all(r['bitwise_equal'] for r in sw['rows'])}")
    print(f"K = 64, {rows[0]['path']} {bench.shape_label(rows[0])}, one build per ring depth (slots): GPU us over "
          f"fresh allocations; stage.LONE_RING64 = {load_stage(sid).LONE_RING64}")
    return ring64.style.format("{:.1f}", subset=["min", "max"])


def times_across_calls(stage_id, shape: str = "B1 T1024 H64 K128 V128") -> pd.DataFrame:
    """Every recorded GPU time (graph replay) of one stage's own call at one shape, over all the H200's records
    (results/h200/): a ladder sweep, a paths table's reference rows, a tour. Its kernels are the same in every
    one of them; the spread between calls is what a ratio taken across two tables would carry, which is why
    each ratio in the chapters is taken within one call. One line per folder names the files and where they
    were recorded."""
    from .paths import RESULTS_DIR

    sid = normalize(stage_id)
    rows, metas = [], {}
    for f in sorted((RESULTS_DIR / "h200").rglob("*.json")):
        rel = os.path.relpath(f, RESULTS_DIR.parent)
        data = results.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            continue
        for r in data["rows"]:
            if not isinstance(r, dict) or str(r.get("stage", ""))[:2] != sid or r.get("path", "rule") != "rule":
                continue
            if r.get("variant") not in (None, "full", "stage") or not all(x in r for x in "BTHKV") \
                    or bench.shape_label(r) != shape:
                continue
            ms = r.get("fwd_graph_ms", r.get("graph_ms"))
            if isinstance(ms, (int, float)):
                rows.append({"record": rel, "commit": str(r.get("commit") or data["meta"].get("commit", ""))[:7],
                             "GPU ms": float(ms)})
                metas[rel] = data["meta"]
    if not rows:
        raise ValueError(f"no recorded GPU time of stage {sid} at {shape}")
    by_folder: dict = {}
    for rel in metas:
        by_folder.setdefault(os.path.dirname(rel), []).append(rel)
    for folder, files in by_folder.items():
        days = sorted({d for rel in files for d in re.findall(r"\d{4}-\d\d-\d\d", str(metas[rel].get("date", "")))})
        print(f"{folder}/ ({', '.join(os.path.basename(x) for x in files)}): recorded on "
              f"{metas[files[0]].get('device')}, {', '.join(days)}")
    table = pd.DataFrame(rows).sort_values("GPU ms").reset_index(drop=True)
    lo, hi = table["GPU ms"].min(), table["GPU ms"].max()
    print(f"stage {sid} at {shape}, its own call: {len(table)} records, {lo:.4f} to {hi:.4f} ms "
          f"({100 * (hi / lo - 1):.1f}% apart)")
    return table.style.format({"GPU ms": "{:.4f}"})


def ideas_at(stage_id) -> pd.DataFrame:
    """Each switch of a stage built beside it and timed in one call at more than one shape (RECORDS["ideas_at"]:
    scripts/try_variants.py, one variant per switch named by ``ideas``, the ABLATIONS entry it turns off):
    per case, the stage's GPU time, each variant's and how much slower the stage is without the idea."""
    sid = normalize(stage_id)
    (data,), _ = _stage_records(sid, "ideas_at")
    names = declared_records("ideas_at")[sid]["ideas"]
    rows, base = [], {}
    for r in data["rows"]:
        case = f"{r['path']} {bench.shape_label(r)}"
        if r["variant"] == "stage":
            base[case] = r["fwd_graph_ms"]
    for r in data["rows"]:
        case = f"{r['path']} {bench.shape_label(r)}"
        if r["variant"] != "stage":
            rows.append({"case": case, "without": names[r["variant"]], "stage ms": base[case],
                         "without ms": r["fwd_graph_ms"], "x slower without": r["fwd_graph_ms"] / base[case],
                         "difference from the stage": r["err_vs_stage"]})
    table = pd.DataFrame(rows).set_index(["case", "without"])
    return table.style.format({"stage ms": "{:.4f}", "without ms": "{:.4f}", "x slower without": "{:.3f}",
                               "difference from the stage": "{:.1e}"})


def bounded_pairwise(stage_id="12"):
    """The bounded gate: what the pairwise products cost (RECORDS["bounded_before"], an earlier kernel): the
    previous stage, the stage factored (bitwise the previous stage's) and the stage pinned pair by pair, in one
    call, per shape."""
    sid = normalize(stage_id)
    pid = previous(sid)
    prev_name = load_stage(pid).SPEC.name
    (data,), _ = _stage_records(sid, "bounded_before")
    bd = {}
    for r in _part(data, "bounded"):
        bd.setdefault(bench.shape_label(r), {})[pid if r["stage"] == prev_name else r["products"]] = r
    rows = []
    for lab, d in bd.items():
        tprev, tf, tp = d[pid]["graph_ms"], d["factored"]["graph_ms"], d["pairwise"]["graph_ms"]
        rows.append({"shape": lab, f"{pid} GPU ms": tprev, f"{sid} factored ms": tf,
                     f"bitwise = {pid}": d["factored"][f"equal_to_{pid}"], f"{sid} pairwise ms": tp,
                     f"pairwise rel. diff vs {pid}": d["pairwise"][f"rel_diff_vs_{pid}"],
                     f"factored / {pid}": tf / tprev, "pairwise / factored": tp / tf})
    bounded = pd.DataFrame(rows).set_index("shape")
    print(f"the pairwise products take {bounded['pairwise / factored'].min():.2f}x to "
          f"{bounded['pairwise / factored'].max():.2f}x the factored ones' GPU time on the bounded gate; every "
          f"factored call bitwise stage {pid}'s: {bool(bounded[f'bitwise = {pid}'].all())}")
    return bounded.style.format({c: "{:.4f}" for c in (f"{pid} GPU ms", f"{sid} factored ms", f"{sid} pairwise ms")}
                                | {c: "{:.3f}" for c in (f"factored / {pid}", "pairwise / factored")}
                                | {f"pairwise rel. diff vs {pid}": "{:.1e}"})


def summit_table(stage_id=None):
    """The last stage (default: the ladder's, stages.last_stage) beside stage 11 and FlashKDA on the bounded
    gate, and beside its earlier kernel with the softplus gate (RECORDS["summit"], scripts/bench_summit.py:
    one call, the same inputs per shape and round),
    judged by report.summit_rows / summit_verdict: ratios within a round, the median over rounds."""
    from .report import SUMMIT_BOUND, summit_rows, summit_verdict

    (data,), _ = _stage_records(stage_id or last_stage(), "summit")
    rows = summit_rows(data)
    v = summit_verdict(rows)
    worst = max(r["last / 11 worst"] for r in rows if r["last / 11 worst"] is not None)
    print(f"bounded gate: at most {v['bounded_worst']:.3f}x stage 11's GPU time (median of "
          f"{min(r['rounds'] for r in rows)} rounds; bound {SUMMIT_BOUND}x: "
          f"{'met at every shape' if v['bounded_ok'] else 'exceeded at ' + ', '.join(v['bounded_over'])}; "
          f"slowest single round {worst:.3f}x); stage 11's bits at every shape: {v['bitwise']}. "
          f"Softplus gate: at most {v['softplus_worst']:.3f}x the earlier kernel's time ({v['softplus_by']})"
          + (f" (slower at {', '.join(v['softplus_slower'])})." if v["softplus_slower"] else "."))
    cols = ["shape", "11 ms", "last ms", "last / 11", "last / 11 worst", "bitwise 11", "FlashKDA ms",
            "last / FlashKDA", "softplus ms", "before ms", "now / before"]
    if any(r["control / before"] is not None for r in rows):  # today's kernel also timed as the earlier one was
        cols.append("control / before")
    table = pd.DataFrame([{c: r[c] for c in cols} for r in rows]).set_index("shape")
    return table.style.format({c: "{:.4f}" for c in ("11 ms", "last ms", "FlashKDA ms", "softplus ms", "before ms")}
                              | {c: "{:.3f}" for c in ("last / 11", "last / 11 worst", "last / FlashKDA",
                                                        "now / before", "control / before") if c in cols},
                              na_rep="-")


def gate_profile(stage_id=None, shape="B1 T4096 H16 K128 V128"):
    """Where a gate without a bound costs, region by region (RECORDS["gate_profile"], scripts/profile_gates.py):
    clock64 cycles per chunk (:func:`chunks_per_block`) of stage 11 and the last stage on the bounded gate and of the last stage with the
    softplus gate, at one shape; ``softplus / bounded`` the last stage's two gates. Prints the regions that
    moved by more than 5% either way."""
    sid = normalize(stage_id or last_stage())
    (data,), _ = _stage_records(sid, "gate_profile")
    rows = [r for r in data["rows"] if bench.shape_label(r) == shape]
    if not rows:
        raise ValueError(f"the gate profile record has no rows at {shape}: "
                         f"{sorted({bench.shape_label(r) for r in data['rows']})}")
    T = rows[0]["T"]  # one shape
    table = pd.DataFrame([{"region": r["region"], "who": f"{r['stage'][:2]} {r['gate']}",
                           "cycles": r["value"] / chunks_per_block(r["region"], T)}
                          for r in rows]).pivot(index="region", columns="who", values="cycles")
    table = table.loc[list(dict.fromkeys(r["region"] for r in rows))]
    last = sid[:2]
    table["softplus / bounded"] = table[f"{last} softplus"] / table[f"{last} bounded"]
    moved = table["softplus / bounded"]
    print(f"{shape}: the softplus gate against the bounded gate's instantiation, cycles per chunk (K1 a block per "
          f"chunk, K2 its block over {chunks_per_block('K2', T)} chunks); moved by more than 5%: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in moved.items() if abs(v - 1) > 0.05))
    return table.style.format({c: "{:,.0f}" for c in table.columns if c != "softplus / bounded"}
                              | {"softplus / bounded": "{:.2f}"})


# ---- the op in a model (notebooks/use_in_a_model.ipynb): FLA's KDA layer with the kdalab backend ----

OP_RECORDS = (("stage11/op_e573e2b", 32), ("stage11/op_h96_f5a3805", 96))  # (record, the heads taken from it)
OP_COLUMNS = ["what", "H", "T", "kdalab_graph_ms", "fla_graph_ms", "speedup_graph_ms", "kdalab_ms", "fla_ms",
              "speedup_ms", "rel_err_vs_fla"]


def _op_rows(say: bool = True) -> list[dict]:
    """The rows of scripts/bench_op.py's records (the layer and the op alone, with the backend and on FLA's
    kernels), each record at its heads; with ``say``, one line naming the records."""
    recs = [(results.recorded(n), h) for n, h in OP_RECORDS]
    if say:
        _say_recorded({f: ", ".join(dict.fromkeys(str(r["meta"].get(f)) for r, _ in recs))
                       for f in ("device", "date", "commit", "file")})
    return [r for rec, h in recs for r in rec["rows"] if r["H"] == h]


def op_table() -> pd.DataFrame:
    """FLA's KimiDeltaAttention layer and chunk_kda alone, through the kdalab backend and on FLA's kernels
    (GPU time by graph replay, eager time, the output's difference from FLA's), as recorded."""
    return pd.DataFrame(_op_rows())[OP_COLUMNS].round(4)


@figure
def op_plot():
    """The op_table's GPU times as bars (log scale): the layer and the op alone, each way."""
    rows = _op_rows(say=False)
    bars = [dict(what=f"{r['what']} H{r['H']}", impl=impl, ms=r[f"{key}_graph_ms"])
            for r in rows for impl, key in (("FLA's kernels", "fla"), ("through kdalab", "kdalab"))]
    return plot_bars(bars, x="what", y="ms", by="impl", logy=True, value_rotation=0, value_fontsize=8,
                     ylabel="GPU time, ms", title="FLA's KDA layer and chunk_kda at T=4096, GPU time (recorded)")



# --------------------------------------------------------------------------
# stage 13: the backward
# --------------------------------------------------------------------------

@figure
def backward_picture(chunks: int = 6):
    """Stage 13's idea: the forward chain run again (B2, left to right, each chunk's entry state kept), the
    reverse chain of the state's gradient (B3, right to left, each chunk's exit gradient kept), and each
    chunk's adjoint (B4) fed by both, all chunks at once."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, ax = plt.subplots(figsize=(10, 3.4))
    w, gap = 1.0, 0.6
    for n in range(chunks):
        x = n * (w + gap)
        ax.add_patch(Rectangle((x, 0.0), w, 0.8, facecolor=(0.85, 0.9, 1.0), edgecolor="k"))
        ax.text(x + w / 2, 0.4, f"B4\nchunk {n}", ha="center", va="center", fontsize=8)
        for y, lab in ((2.0, f"S{n}"), (-1.2, f"dS{n + 1}")):
            ax.text(x + w / 2, y, lab, ha="center", va="center", fontsize=9)
            ax.add_patch(FancyArrowPatch((x + w / 2, y - 0.25 if y > 0 else y + 0.25), (x + w / 2, 0.85 if y > 0 else -0.05),
                                         arrowstyle="->", mutation_scale=10, color="0.4"))
        if n < chunks - 1:
            ax.add_patch(FancyArrowPatch((x + w / 2 + 0.25, 2.0), (x + w + gap + w / 2 - 0.25, 2.0), arrowstyle="->",
                                         mutation_scale=12, color="tab:blue"))
            ax.add_patch(FancyArrowPatch((x + w + gap + w / 2 - 0.3, -1.2), (x + w / 2 + 0.35, -1.2), arrowstyle="->",
                                         mutation_scale=12, color="tab:red"))
    right = chunks * (w + gap)
    ax.text(right, 2.0, "B2: the forward chain again\n(entry states kept)", va="center", fontsize=9, color="tab:blue")
    ax.text(right, -1.2, "B3: the state's gradient, back\n(exit gradients kept, dh0)", va="center", fontsize=9,
            color="tab:red")
    ax.text(right, 0.4, "B4: each chunk's gradients,\nall chunks at once", va="center", fontsize=9)
    ax.set_xlim(-0.3, right + 3.2)
    ax.set_ylim(-1.7, 2.5)
    ax.axis("off")
    ax.set_title("The backward: two chains over the chunks, then every chunk in parallel (B1 prepares their operands)")
    return fig


def backward_model_check(B: int = 2, T: int = 37, H: int = 2, K: int = 16, seed: int = 0) -> pd.DataFrame:
    """On the CPU, in fp64: the backward's algorithm as the kernels split it (common.backward_model: the two
    chains, each chunk's adjoint, then the pre-stage's adjoint) against autograd through the token loop, for both
    gates, with h0 and a tail. One row per gradient; raises CheckFailed above 1e-9."""
    from .backward_model import activation_backward, chunked_backward
    from .inputs import make_cotangents, make_inputs
    from .reference import activate, kda_reference

    rows, problems = [], []
    for gate, lb in (("softplus", None), ("bounded", -5.0)):
        kw = make_inputs(B, T, H, K, K, seed=seed, dtype=torch.float64, gate=gate, lower_bound=lb, h0=True,
                         chunk_size=16)
        do, dht = (x.double() for x in make_cotangents((B, T, H, K), (B, H, K, K), seed=seed))
        leaves = {n: kw[n].detach().double().requires_grad_() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias",
                                                                  "initial_state")}
        o, S = kda_reference(**leaves, gate=gate, lower_bound=lb, scale=K ** -0.5)
        torch.autograd.backward((o, S), (do, dht))
        x = {n: t.detach() for n, t in leaves.items()}
        qn, kn, b, a = activate(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], gate=gate, lower_bound=lb)
        m = chunked_backward(qn, kn, x["v"], b, a, do, dht, scale=K ** -0.5, initial_state=x["initial_state"])
        raw = activation_backward(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], m["dqn"], m["dkn"],
                                  m["db"], m["da"], gate=gate, lower_bound=lb)
        got = dict(q=raw["dq"], k=raw["dk"], v=m["dv"], g=raw["dg"], beta=raw["dbeta"], A_log=raw["dA_log"],
                   dt_bias=raw["ddt_bias"], initial_state=m["dh0"])
        for n, t in got.items():
            err = float((t - leaves[n].grad).norm() / leaves[n].grad.norm())
            rows.append(dict(gate=gate, gradient="d" + n, rel_err=err))
            if not err <= 1e-9:
                problems.append(f"{gate} d{n}: {err:.1e}")
    fail_if(problems, "the chunked backward's algorithm against autograd")
    return pd.DataFrame(rows).pivot(index="gradient", columns="gate", values="rel_err")


def backward_profile(record: str = "stage13/bwd_profile_4d6d8e6", device_dir: str = "h100",
                     gate: str = "softplus") -> pd.DataFrame:
    """Where stage 13's backward spends its time, from a record of scripts/profile_backward.py: clock64 cycles
    per chunk in each region of its kernels (B1 and B4 a block per chunk, a chain one step of one block), each
    region's share of its kernel, for the stage's build and each variant the record holds. Prints the record."""
    data = results.recorded(record, device_dir)
    if data is None:
        raise FileNotFoundError(f"results/{device_dir}/{record}.json is not there")
    _say_recorded(data["meta"])
    rows = [r for r in data["rows"] if r["gate"] == gate]
    df = pd.DataFrame([dict(build=r.get("variant") or "stage", kernel=r["region"][5:7],
                            region=r["region"][8:], cycles=r["value"]) for r in rows])
    df["share of its kernel"] = df["cycles"] / df.groupby(["build", "kernel"])["cycles"].transform("sum")
    return df.pivot_table(index=["kernel", "region"], columns="build", values=["cycles", "share of its kernel"],
                          sort=False).round(2)


# The memory's bandwidth by the vendors' datasheets (TB/s), and the SM clock at its boost (GHz): the floors'
# rates. A device-to-device copy reached about 3.0 (H100) and 4.3 (H200) TB/s here, counting both ways.
HBM_TBPS = {"h100": 3.35, "h200": 4.8}
BOOST_GHZ = 1.98


def backward_floors(train: str = "stage13/train_4d6d8e6", profile: str = "stage13/bwd_profile_4d6d8e6",
                    device_dir: str = "h100", gate: str = "softplus") -> pd.DataFrame:
    """Each of stage 13's backward kernels against its floors at the records' shape: its time (the profiler's,
    from a record of scripts/bench_train.py), the bytes it must move (stage.backward_traffic) over the memory's
    bandwidth, and for the chains the reverse chain's steps one after another (the chunks times the cycles of a
    step, from a record of scripts/profile_backward.py, at the boost clock). What bounds a kernel is its larger
    floor; the tensor cores' work is under 0.2 ms in every kernel at this shape and bounds none."""
    from .stages import load_next

    rec, prof = results.recorded(train, device_dir), results.recorded(profile, device_dir)
    if rec is None or prof is None:
        raise FileNotFoundError(f"results/{device_dir}/{train}.json or {profile}.json is not there")
    _say_recorded(rec["meta"])
    _say_recorded(prof["meta"])
    row = next(r for r in rec["rows"] if r["side"] == "kdalab" and r["gate"] == gate)
    B, T, H, K = (row[n] for n in ("B", "T", "H", "K"))
    steps = {r["region"]: r["value"] for r in prof["rows"] if r["gate"] == gate and not r.get("variant")
             and (r["B"], r["T"], r["H"], r["K"]) == (B, T, H, K)}
    if not steps:
        raise ValueError(f"{profile} has no profile of the stage at B{B} T{T} H{H} K{K}, {gate}")
    stage = load_next("13_backward")
    traffic = stage.backward_traffic(B, T, H, K)
    out = []
    for (name, kernel), (read, written) in zip(stage.BACKWARD_IO, traffic.values()):
        ms = sum(v[1] for k, v in row["kernels"].items() if kernel + "<" in k)
        floor = (read + written) / (HBM_TBPS[device_dir] * 1e12) * 1e3
        chain = None
        if "chains" in name:
            step = max(steps["bwd: B2 step"], steps["bwd: B3 step"])  # the two chains run side by side
            chain = -(-T // 16) * step / (BOOST_GHZ * 1e9) * 1e3
        bound = max(floor, chain or 0.0)
        out.append({"kernel": name, "ms": ms, "MB read": read / 1e6, "MB written": written / 1e6,
                    "bytes floor ms": floor, "chain floor ms": chain, "bound by": "the chain" if chain and
                    chain > floor else "bytes", "x its floor": ms / bound})
    return pd.DataFrame(out).set_index("kernel").round(3)


def loss_curves(record: str = "stage13/loss_4d6d8e6", device_dir: str = "h100"):
    """A small KDA model trained through FLA's kernels and through kdalab's, from two seeds (a record of
    scripts/train_small.py): the smoothed loss curves, and the largest gap past the first third between the two
    kernels from one seed and between one kernel's two seeds (its run-to-run noise), recomputed from the curves
    and checked against the record's. Returns the axes and a table of the gaps."""
    import matplotlib.pyplot as plt

    from .metrics import curve_gap, moving_mean

    data = results.recorded(record, device_dir)
    if data is None:
        raise FileNotFoundError(f"results/{device_dir}/{record}.json is not there")
    _say_recorded(data["meta"])
    runs, start = data["runs"], data["steps"] // 3
    seeds = sorted({n.split("seed")[1] for n in runs})
    rows = [dict(between=f"FLA and kdalab, seed {s}", gap=curve_gap(runs[f"fla_seed{s}"], runs[f"kdalab_seed{s}"],
                                                                    start)) for s in seeds]
    rows += [dict(between=f"{k}: seeds {' and '.join(seeds)}", gap=curve_gap(*(runs[f"{k}_seed{s}"] for s in seeds),
                                                                             start)) for k in ("fla", "kdalab")]
    want = [data["kernel_gap"][s] for s in seeds] + [data["seed_gap"][k] for k in ("fla", "kdalab")]
    fail_if([f"{r['between']}: {r['gap']:.3g}, the record says {w:.3g}" for r, w in zip(rows, want)
             if abs(r["gap"] - w) > 1e-9], "the loss curves' gaps against the record")
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, losses in runs.items():
        kernel, seed = name.split("_seed")
        ax.plot(moving_mean(losses), lw=1.2, ls="-" if kernel == "kdalab" else "--",
                label=f"{'kdalab' if kernel == 'kdalab' else 'FLA'}, seed {seed}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats, mean of 10 steps)")
    ax.legend(fontsize=8)
    ax.set_title("the four runs (they overlap)", fontsize=10)
    for s in seeds:  # the kernels' difference from one seed, beside the seeds' difference on one kernel
        d = [a - b for a, b in zip(moving_mean(runs[f"kdalab_seed{s}"]), moving_mean(runs[f"fla_seed{s}"]))]
        dx.plot(d, lw=1.2, label=f"kdalab - FLA, seed {s}")
    for k in ("fla", "kdalab"):
        d = [a - b for a, b in zip(*(moving_mean(runs[f"{k}_seed{s}"]) for s in reversed(seeds)))]
        dx.plot(d, lw=0.8, ls=":", label=f"{'FLA' if k == 'fla' else 'kdalab'}: seed {seeds[-1]} - seed {seeds[0]}")
    dx.axvline(start, color="grey", lw=0.6)
    dx.set_ylim(-0.08, 0.08)
    dx.set_xlabel("step (the gaps are taken right of the grey line)")
    dx.set_ylabel("difference of the smoothed losses")
    dx.legend(fontsize=8)
    dx.set_title("kernel against kernel, seed against seed", fontsize=10)
    fig.suptitle(f"A small KDA model trained {data['steps']} steps ({data['meta']['device']}, recorded)", fontsize=11)
    fig.tight_layout()
    return ax, pd.DataFrame(rows).set_index("between")


def backward_bytes(B: int = 1, T: int = 8192, H: int = 32, K: int = 128) -> pd.DataFrame:
    """What stage 13's backward keeps between its kernels, and the gradients it writes, in MB at a shape (Kimi
    Linear's by default): its stage.backward_bytes, which a test holds to the tensors the kernels are given.
    Nothing of the forward is kept but its inputs: the backward recomputes the rest."""
    from .stages import load_next

    got = load_next("13_backward").backward_bytes(B, T, H, K)
    rows = [dict(kept="between the kernels", tensor=n, MB=b / 1e6) for n, b in got["workspace"].items()]
    rows += [dict(kept="written (the gradients)", tensor=n, MB=b / 1e6) for n, b in got["gradients"].items()]
    rows.append(dict(kept="all", tensor="total", MB=got["total"] / 1e6))
    return pd.DataFrame(rows).set_index(["kept", "tensor"]).round(1)
