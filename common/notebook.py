"""What the notebooks call: each function measures live when this machine can
run the stage, and otherwise shows the recorded GPU figures, labelled as
recorded (device, date, commit, command). Notebooks stay narrative + calls."""

from __future__ import annotations

import pandas as pd
import torch

from . import bench, checks, results
from .build import resource_usage
from .fla_ref import fla_available
from .plotting import plot_bars, plot_latency, plot_profile
from .report import PROFILE_SHAPE
from .stages import STAGE_DIRS, load_stage, previous
from .paths import STAGES_DIR


def environment() -> str:
    """One line about this machine (what the notebook will do live)."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    line = f"torch {torch.__version__}, {gpu}"
    print(line)
    return line


def build(stage_id, profile=True):
    """Build a stage (and its profile variant); returns the stage module."""
    stage = load_stage(stage_id)
    stage.build()
    if profile and stage.build() is not None:
        stage.build(profile=True)
    return stage


def _recorded(name):
    data = results.recorded(name)
    return (data["meta"], data["rows"]) if data else (None, [])


def error_table(stage_id, *, quick: bool = False) -> pd.DataFrame:
    """Worst relative error per output against the fp64 reference and the
    previous stage. Live when the stage runs here, else recorded."""
    stage = load_stage(stage_id)
    spec = stage.SPEC
    ok, why = spec.runnable_here()
    if ok:
        dev = checks.stage_device(spec)
        cases = checks.cases_for(spec, dev, quick)
        rows = checks.check_stage(stage_id, cases)
        worst = checks.summarize(rows)
        bad = [r for r in rows if not r["ok"]]
        print(f"measured live on {dev}: {len(cases)} cases, {len(rows)} comparisons, "
              f"{'all within ' + format(worst[0]['tol'], 'g') if not bad else str(len(bad)) + ' ABOVE tolerance'}")
    else:
        meta, rows = _recorded("checks")
        worst = [r for r in rows if r.get("stage") == spec.name]
        if not worst:
            print(f"{spec.name} cannot run here ({why}) and has no recorded checks yet")
            return pd.DataFrame()
        print(f"{spec.name} cannot run here ({why}); showing figures {results.label(meta)}")
    df = pd.DataFrame(worst)
    cols = [c for c in ("output", "err_ref", "err_prev", "prev", "tol", "ok", "cases") if c in df]
    return df[cols].style.format({"err_ref": "{:.2e}", "err_prev": "{:.2e}", "tol": "{:.0e}"}, na_rep="-")


def profile(stage_id, *, compare_previous: bool = True, backward: bool = True):
    """Stacked bars of the region profile of a stage next to the previous one
    (same unit only). Live when possible, else recorded."""
    ids = [stage_id]
    pid = previous(stage_id)
    if compare_previous and pid is not None:
        ids.insert(0, pid)
    unit = load_stage(stage_id).SPEC.region_unit
    profs, notes = {}, []
    meta, rec = _recorded("profiles")
    for sid in ids:
        spec = load_stage(sid).SPEC
        if spec.region_unit != unit:
            continue
        ok, why = spec.runnable_here()
        if ok:
            dev = checks.stage_device(spec)
            kw = checks.stage_inputs(spec, **PROFILE_SHAPE[dev.type], device=dev)
            profs[spec.name] = load_stage(sid).profile(**kw, backward=backward and spec.backward)
            notes.append(f"{spec.name}: live on {dev}")
        else:
            rows = [r for r in rec if r.get("stage") == spec.name]
            if rows:
                profs[spec.name] = {r["region"]: r["value"] for r in rows}
                notes.append(f"{spec.name}: recorded")
            else:
                notes.append(f"{spec.name}: no figures ({why})")
    shape = PROFILE_SHAPE["cpu" if unit == "s" else "cuda"]
    print("; ".join(notes) + f" -- shape {bench.shape_label(shape)}")
    if meta is not None and any("recorded" in n for n in notes):
        print("recorded: " + results.label(meta))
    if not profs:
        return None
    profs = split_parallel(profs)
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(4.5 + 2.6 * len(profs), 4.2))
    what = "wall time" if unit == "s" else "clock64 cycles per block"
    plot_profile(profs, unit, title=f"Region profile ({what})", ax=a1)
    a1.get_legend().remove()
    plot_profile(profs, unit, title="Share of each region", ax=a2, normalize=True)
    fig.tight_layout()
    return a1


def split_parallel(profs: dict) -> dict:
    """A warp-specialised kernel has two timelines in one block: the compute
    warps' and the load warp's (regions named "... load warp: ..."). Stacking
    them would add up time that overlaps, so the load warp gets its own bar."""
    out = {}
    for label, prof in profs.items():
        main = {k: v for k, v in prof.items() if "load warp" not in k}
        side = {k: v for k, v in prof.items() if "load warp" in k}
        out[label] = main
        if side:
            out[f"{label}\n(load warp)"] = side
    return out


def latency(stage_ids, *, y: str = "fwd", title=None):
    """Latency against T for a few stages: live for the stages that run here
    (CPU sweep on a CPU), recorded H200 figures for the rest. ``y`` is "fwd"
    or "bwd": GPU time (graph replay) where there is one, else the eager time."""
    live_rows, rec_rows = [], []
    meta, rec = _recorded("fp32_stages")
    for sid in stage_ids:
        if sid == "fla":
            if fla_available()[0]:
                live_rows += _live_sweep("fla", bench.FP32_GPU_SWEEP)
            else:
                rec_rows += [r for r in rec if r.get("stage") == "FLA chunk_kda"]
            continue
        spec = load_stage(sid).SPEC
        ok, _ = spec.runnable_here()
        if ok:
            dev = checks.stage_device(spec)
            live_rows += _live_sweep(sid, bench.sweep_for(spec, dev))
        else:
            rec_rows += [r for r in rec if r.get("stage") == spec.name]
    figs = []
    key = f"{y}_best_ms"
    for rows, where in ((live_rows, "measured live"), (rec_rows, "recorded")):
        for r in rows:
            r[key] = bench.best_ms(r, y)
        rows = [dict(r, series=f"{r['stage']} (B{r['B']} H{r['H']} K{r['K']})" + _eager_mark(r, y)) for r in rows
                if r.get(key) is not None]
        sweep_rows = [r for r in rows if not (r["H"] == 64 and r["K"] == 128)]
        if not sweep_rows:
            continue
        ax = plot_latency(sweep_rows, y=key, by="series", ylabel=f"{y} ms (GPU time where measured)",
                          title=(title or f"{y} latency vs T") + f" ({where})")
        figs.append(ax)
        if where == "recorded" and meta is not None:
            print("recorded: " + results.label(meta))
    if not figs:
        print("no latency figures for these stages on this machine yet")
    return figs


def _eager_mark(row: dict, y: str) -> str:
    """' eager' for a row timed without graph replay although a call is short
    enough for launch overhead to count (FLA's backward goes through autograd)."""
    short = row.get(f"{y}_ms") is not None and row[f"{y}_ms"] < 1e3 * bench.LONG_CALL_S
    return " eager" if short and row.get(f"{y}_graph_ms") is None else ""


_LIVE: dict = {}


def _live_sweep(sid, shapes, tc: bool = False):
    """A live latency sweep, measured once per notebook session and reused.
    FLA is timed forward only: its fp32 backward autotunes for about five minutes on a
    fresh H200 (recorded FLA backward rows are in results/h200/fp32_stages.json).
    ``tc``: the tensor-core regime (bf16 inputs, bounded gate, chunk 16, forward)."""
    key = (sid, tc, tuple(tuple(sorted(x.items())) for x in shapes))
    if key not in _LIVE:
        kw = dict(dtype=torch.bfloat16, gate="bounded", chunk=16, backward=False) if tc else \
            dict(backward=False if sid == "fla" else None)
        _LIVE[key] = bench.sweep([sid], shapes, budget_s=0.3, **kw)
    return [dict(r) for r in _LIVE[key]]


def latency_rows(stage_ids, name: str = "fp32_stages") -> pd.DataFrame:
    """The recorded latency rows of some stages as a table."""
    meta, rec = _recorded(name)
    names = [("FLA chunk_kda" if s == "fla" else load_stage(s).SPEC.name) for s in stage_ids]
    rows = [r for r in rec if r.get("stage") in names]
    if meta is not None:
        print("recorded: " + results.label(meta))
    cols = ["stage", "B", "T", "H", "K", "V", "fwd_ms", "fwd_graph_ms", "bwd_ms", "bwd_graph_ms"]
    df = pd.DataFrame(rows)
    return df[[c for c in cols if c in df]] if len(df) else df


def resources(stage_id) -> pd.DataFrame:
    """Registers, shared memory, stack and spills per kernel (ptxas -v, sm_90),
    compiled here: no GPU needed."""
    stage = load_stage(stage_id)
    rows = resource_usage(STAGES_DIR / STAGE_DIRS[stage.SPEC.id], stage.SOURCES,
                          cutlass=stage.SPEC.extra.get("cutlass", False))
    return pd.DataFrame(rows)


FLA_TC = "FLA chunk_kda (bf16, safe gate)"  # FLA as benchmarked in the tensor-core regime


def _anchor_rows(fla_measured_at=frozenset()):
    """FLA / FlashKDA figures measured on the same H200 before this project
    (results/anchors/), as rows like the benchmark's. FLA's anchor is left out
    at the shapes (bench.shape_label) where FLA itself was measured."""
    from .paths import RESULTS_DIR
    import json

    rows = []
    for p in sorted((RESULTS_DIR / "anchors").glob("*.json")):
        data = json.loads(p.read_text())
        for r in data.get("rows", []):
            shape = dict(B=r["B"], T=r["T"], H=r["H"], K=r["D"], V=r["D"])
            if r.get("fla_safe_graph_ms") is not None and bench.shape_label(shape) not in fla_measured_at:
                rows.append(dict(stage="FLA chunk_kda (bf16, safe gate; anchor)", **shape,
                                 fwd_graph_ms=r["fla_safe_graph_ms"], fwd_ms=r.get("fla_safe_ms")))
            if r.get("flashkda_graph_ms") is not None:
                rows.append(dict(stage="FlashKDA (anchor)", **shape, fwd_graph_ms=r["flashkda_graph_ms"],
                                 fwd_ms=r.get("flashkda_ms")))
    return rows


def tc_latency(stage_ids=("05",)):
    """Tensor-core stages against FLA and FlashKDA at the six H200 shapes, GPU
    time (graph replay) where measured, else eager. On a GPU the stages (and
    FLA, when fla-core is installed) are measured live; otherwise the recorded
    figures are shown: the stages and FLA as measured on one H200 lease, and
    FlashKDA (not installable here) from results/anchors/."""
    meta, rec = _recorded("tc_stages")
    rows, where = [], "recorded"
    if torch.cuda.is_available():
        where = "measured live"
        for sid in stage_ids:
            rows += _live_sweep(sid, bench.TC_GPU_SHAPES, tc=True)
        if fla_available()[0]:
            rows += _live_sweep("fla", bench.TC_GPU_SHAPES, tc=True)
    else:
        names = [load_stage(s).SPEC.name for s in stage_ids] + ["FLA chunk_kda"]
        rows = [dict(r) for r in rec if r.get("stage") in names]
    for r in rows:
        if r["stage"] == "FLA chunk_kda":
            r["stage"] = FLA_TC
    rows += _anchor_rows({bench.shape_label(r) for r in rows if r["stage"] == FLA_TC})
    for r in rows:
        r["shape"] = bench.shape_label(r)
        r["ms"] = bench.best_ms(r)
    if where == "recorded" and meta is not None:
        print("recorded: " + results.label(meta))
    print("FlashKDA (and FLA where not measured): anchors measured on the same H200 (results/anchors/, 2026-11-29)")
    ax = plot_bars(rows, x="shape", y="ms", by="stage",
                   title=f"Forward latency on the H200 (GPU time, ms; {where})", ylabel="ms")
    df = pd.DataFrame(rows)
    return ax, df.pivot_table(index="shape", columns="stage", values="ms", sort=False)


def ladder(shape=dict(B=1, T=1024, H=64, K=128, V=128)):
    """The whole ladder at one shape, from the recorded figures: forward
    latency per stage (GPU time where recorded) plus the references."""
    rows = []
    for name in ("fp32_stages", "tc_stages"):
        meta, rec = _recorded(name)
        for r in rec:
            if all(r.get(k) == v for k, v in shape.items()):
                label = r["stage"]
                if label == "FLA chunk_kda":
                    label = "FLA chunk_kda (fp32, softplus)" if name == "fp32_stages" else FLA_TC
                rows.append(dict(stage=label, fwd_ms=bench.best_ms(r), bwd_ms=bench.best_ms(r, "bwd"),
                                 note=r.get("error") or r.get("note") or ""))
    fla_at = {bench.shape_label(shape)} if any(r["stage"] == FLA_TC for r in rows) else frozenset()
    rows += [dict(stage=r["stage"], fwd_ms=r["fwd_graph_ms"], bwd_ms=None, note="anchor")
             for r in _anchor_rows(fla_at) if all(r.get(k) == v for k, v in shape.items())]
    order = {n: i for i, n in enumerate(STAGE_DIRS.values())}
    rows.sort(key=lambda r: order.get(r["stage"], 100))
    df = pd.DataFrame(rows)
    ok = df[df["fwd_ms"].notna()]
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(ok["stage"], ok["fwd_ms"])
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("forward ms (log scale)")
    ax.set_title(f"The ladder at {bench.shape_label(shape)} (H200, recorded)")
    fig.tight_layout()
    return ax, df
