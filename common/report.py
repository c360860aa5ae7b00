"""Reports: the tour (build, check, time, profile every stage this machine can
run, list the others with their recorded figures) and the results tables of
the README, all generated from the recorded JSON files.

The tour's summary is one table per regime, every row at that regime's one
shape, so that a column can be read down the ladder:

- fp32 on the CPU (stages 00, 01): B1 T512 H2 K=V=32, softplus gate, chunk 64;
- fp32 on the GPU (stages 02-04, FLA in fp32): B2 T2048 H4 K=V=64, softplus, chunk 64;
- bf16 tensor cores (stages 05-08, FLA bf16, FlashKDA): B1 T1024 H64 K=V=128,
  bounded gate, chunk 16.

A stage's errors are its own (against the fp64 reference, and against the
previous stage of the ladder); FLA and FlashKDA are rows of their own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import bench, checks, results
from .bench import PROFILE_SHAPE, REGIMES, regime  # noqa: F401 (report.REGIMES, report.regime)
from .metrics import worst
from .paths import RESULTS_DIR
from .plotting import plot_bars, plot_latency, plot_profile, split_bars
from .stages import STAGE_DIRS, declared_records, load_stage, previous

TOUR_BUDGET_S = 60.0  # seconds of live timing per GPU stage; recorded figures for the shapes beyond it


def _fmt(v, spec="{:.3g}"):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1e3 else spec.format(v)
    return str(v)


def md_table(rows, columns, headers=None) -> str:
    headers = headers or columns
    out = "| " + " | ".join(headers) + " |\n|" + "---|" * len(columns) + "\n"
    for r in rows:
        out += "| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |\n"
    return out


def latency_table(rows) -> str:
    cols = ["stage", "B", "T", "H", "K", "V", "fwd_ms", "fwd_graph_ms", "bwd_ms", "bwd_graph_ms", "error"]
    return md_table(rows, [c for c in cols if any(c in r for r in rows)])


def recorded_rows(stage_name: str) -> list[tuple[dict, list]]:
    """[(meta, rows)] of every recorded results file that has rows for a stage."""
    out = []
    for p in sorted(RESULTS_DIR.glob("*/*.json")):
        try:
            data = results.load(p)
        except (OSError, json.JSONDecodeError):
            continue
        rows = [r for r in data.get("rows", []) if r.get("stage") == stage_name]
        if rows:
            out.append((data.get("meta", {}), rows))
    return out


def _recorded_errors(stage_name: str):
    """(worst err vs fp64, worst err vs previous, previous stage's name) of a
    stage's own recorded checks (the FLA comparison rows are not its errors)."""
    rows = [r for sub in ("cpu", "h200") for r in (results.recorded("checks", sub) or {"rows": []})["rows"]]
    own = [r for r in rows if r.get("stage") == stage_name and "err_ref" in r]
    if not own:
        return None, None, None
    return (worst(r["err_ref"] for r in own), *checks.vs_previous(own))


def _at(rows, shape):
    lab = bench.shape_label(shape)
    hit = [r for r in rows if "B" in r and bench.shape_label(r) == lab and bench.best_ms(r) is not None]
    return hit[-1] if hit else None


def _recorded_latency(name: str, reg: str):
    """(row, meta) of a recorded latency at the regime's shape, or (None, None)."""
    sub, name_ = REGIMES[reg]["results"]
    data = results.recorded(name_, sub)
    meta, rows = (data["meta"], data["rows"]) if data else (None, [])
    if reg == "tc-gpu":  # with the stages' declared records (a stage with no row in tc_stages.json)
        meta, rows = bench.recorded_tc_rows()
    row = _at([r for r in rows if r.get("stage") == name], REGIMES[reg]["shape"])
    if row is not None and row.get("record"):  # its own record's provenance
        meta = dict(meta or {}, device=row.get("device"), date=row.get("run") or "", commit=row.get("commit"))
    return (row, meta) if meta is not None else (None, None)


def _flashkda_errors():
    """(worst error of o and the final state against fp64, where from):
    FlashKDA's own checks measured beside the stages (stage "FlashKDA" in
    results/h200/checks.json) where recorded, else the newest anchor's."""
    data = results.recorded("checks")
    own = [r for r in (data or {}).get("rows", []) if r.get("stage") == results.FLASHKDA and "err_ref" in r]
    if own:  # the rows name their commit; the file's date may be a list of dates, the first of another stage's run
        commits = sorted({str(r["commit"]) for r in own if r.get("commit")})
        when = f"commit {', '.join(commits)}" if commits else data["meta"].get("date", "")[:10]
        return worst(r["err_ref"] for r in own), f"checks.json, {when}"
    anchor, path = results.newest_anchor()
    acc = ((anchor or {}).get("accuracy_vs_fp64") or {}).get("flashkda", {})
    return (max(acc["o"] + acc["S"]), f"anchor {path.name}") if acc else (None, None)


def _flashkda_ref_row(shape, live: dict | None = None) -> dict | None:
    """FlashKDA's summary row at a shape: timed here (``live``), else measured
    beside the stages (results/h200/tc_stages.json), else the newest anchor;
    labelled "FlashKDA (measured)" or "FlashKDA (anchor <file>)"."""
    err, err_from = _flashkda_errors()
    if live is not None:
        row, where, src = live, "measured here", "here"
    else:
        row = _at(results.flashkda_rows(), shape)
        if row is None:
            return None
        if row["stage"] == results.FLASHKDA_MEASURED:
            where = f"recorded on {row.get('measured_on')}, {str(row.get('date'))[:10]}, commit {row.get('commit')}"
            src = "checks.json"
        else:
            anchor, _ = results.newest_anchor()
            device = str(anchor.get("device", "")).split(",")[0]
            where, src = f"anchor, recorded on {device}, {anchor.get('date', '')}", "anchor"
    if err_from is not None and not err_from.startswith(src):
        where += f"; error from {err_from}"
    stage = results.FLASHKDA_MEASURED if live is not None else row["stage"]
    return dict(stage=stage, where=where, err_ref=err, fwd_ms=bench.best_ms(row))


def _ref_rows(reg: str, live_fla: dict | None, live_flashkda: dict | None = None) -> list[dict]:
    """FLA and FlashKDA rows of a regime: FLA live if it was timed here, else
    recorded beside the stages; FlashKDA live if timed here, else measured
    beside the stages where recorded, else from the newest anchor."""
    out = []
    if "FLA chunk_kda" in REGIMES[reg]["refs"]:
        prec = "bf16, safe gate" if reg == "tc-gpu" else "fp32, softplus"
        if live_fla is not None:
            out.append(dict(stage=f"FLA chunk_kda ({prec})", where="measured here",
                            fwd_ms=bench.best_ms(live_fla), bwd_ms=bench.best_ms(live_fla, "bwd")))
        else:
            row, meta = _recorded_latency("FLA chunk_kda", reg)
            checks_rows = (results.recorded("checks") or {"rows": []})["rows"]
            fla_err = worst(r["fla_err_ref"] for r in checks_rows if "fla_err_ref" in r) if reg == "tc-gpu" else None
            if row is not None:
                out.append(dict(stage=f"FLA chunk_kda ({prec})", where=f"recorded on {meta['device']}, {meta['date'][:10]}",
                                err_ref=fla_err, fwd_ms=bench.best_ms(row), bwd_ms=bench.best_ms(row, "bwd")))
    if "FlashKDA" in REGIMES[reg]["refs"]:
        row = _flashkda_ref_row(REGIMES[reg]["shape"], live_flashkda)
        if row is not None:
            out.append(row)
    return out


def flashkda_column(shapes) -> tuple[str, dict]:
    """FlashKDA's forward ms at some shapes (bench.shape_label strings), for a
    table column: measured beside the stages where recorded, else the newest
    anchor's. Returns (the column's label, {shape: cell}); the label says
    where the figures come from, and when they come from both, each anchor
    cell is marked "(anchor)"."""
    got = {}
    for r in results.flashkda_rows():
        lab = bench.shape_label(r)
        if lab in shapes and bench.best_ms(r) is not None:
            got[lab] = r
    measured = {r["stage"] == results.FLASHKDA_MEASURED for r in got.values()}
    anchors = sorted({r["anchor"] for r in got.values() if "anchor" in r})
    if measured == {True}:
        head = results.FLASHKDA_MEASURED
    elif measured == {False}:
        head = results.flashkda_anchor_label(anchors[-1])
    else:
        head = f"FlashKDA (measured; anchor {Path(anchors[-1]).stem} where marked)"
    mark = len(measured) > 1
    cells = {lab: _fmt(bench.best_ms(r)) + (" (anchor)" if mark and "anchor" in r else "") for lab, r in got.items()}
    return head, cells


def _summary_tables(summary: list[dict], live_fla: dict, live_flashkda: dict | None = None) -> str:
    cols = ["stage", "where", "err_ref", "vs_prev", "fwd_ms", "bwd_ms"]
    heads = ["stage", "where", "max err vs fp64", "max err vs previous stage", "fwd ms", "bwd ms"]
    out = []
    for reg, info in REGIMES.items():
        rows = [r for r in summary if r.get("regime") == reg]
        if not rows:
            continue
        rows = rows + _ref_rows(reg, live_fla.get(reg), live_flashkda if reg == "tc-gpu" else None)
        for r in rows:
            if r.get("err_prev") is not None:
                r["vs_prev"] = (f"bitwise equal to {r['prev']}" if r["err_prev"] == 0
                                else f"{r['err_prev']:.1e} vs {r['prev']}")
            if isinstance(r.get("err_ref"), float):
                r["err_ref"] = f"{r['err_ref']:.1e}"
        what = "wall time" if reg == "cpu" else "GPU time by graph replay where measured, else eager"
        out.append(f"**{info['title']}**: ms at {bench.shape_label(info['shape'])} ({what}):\n\n"
                   + md_table(rows, cols, heads))
    return "\n".join(out)


def _timed_shapes(spec, dev, quick: bool):
    """The shapes a stage is timed at in the tour: its sweep (shorter with
    --quick), always with its regime's summary shape."""
    shapes = bench.sweep_for(spec, dev, quick)
    want = REGIMES[regime(spec)]["shape"]
    if bench.shape_label(want) not in {bench.shape_label(s) for s in shapes}:
        shapes = list(shapes) + [want]
    return shapes


def tour(stage_ids, *, out_dir: Path, quick: bool = False, say=print, record: bool = False) -> dict:
    import torch

    from .stages import build_parallel

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, lat_rows, profiles, units, md, all_ok, check_rows = [], [], {}, {}, [], True, []
    meta = results.metadata(command="kdalab tour" + (" --quick" if quick else "") + (" --record" if record else ""))
    md.append(f"# KDA Lab tour\n\n{meta['device']}, {meta['date']}, commit {meta['commit']}, "
              f"torch {meta['torch']}.\n")
    runnable = []
    for sid in stage_ids:
        try:
            spec = load_stage(sid).SPEC
        except FileNotFoundError:
            say(f"[tour] {STAGE_DIRS[sid]}: not written yet (see stages/{STAGE_DIRS[sid]}/README.md)")
            continue
        if spec.runnable_here()[0]:
            runnable.append(sid)
    to_build = sorted(set(runnable) | {previous(s) for s in runnable if previous(s)})
    if to_build:
        say(f"[tour] building {len(to_build)} stages (normal and profile builds, in parallel) ...")
        failed = build_parallel(to_build, say=lambda m: say(f"[tour]   {m}"))
        if failed:
            for sid, err in failed.items():
                say(f"[tour] {STAGE_DIRS[sid]}: COMPILE ERROR\n{err}")
            return dict(ok=False, table="compile errors: " + ", ".join(failed), path=None, rows=[], profiles={})
    live_fla = {}
    for sid in stage_ids:
        try:
            stage = load_stage(sid)
        except FileNotFoundError:
            continue
        spec = stage.SPEC
        reg = regime(spec)
        ok, why = spec.runnable_here()
        if not ok:
            summary.append(_recorded_summary(spec.name, why, reg))
            rec = recorded_rows(spec.name)
            say(f"[tour] {spec.name}: not run here ({why}); showing its recorded results" if rec else
                f"[tour] {spec.name}: not run here ({why}); no recorded results yet")
            md.append(f"## {spec.name}: not run here\n\n{why}.\n")
            for m, rows in rec:
                if any("fwd_ms" in r for r in rows):
                    md.append(f"Recorded ({results.label(m)}):\n\n{latency_table(rows)}\n")
            own = [r for r in bench.declared_latency_rows() if r["stage"] == spec.name]
            if own:  # the record its stage.py declares (RECORDS["latency"])
                md.append(f"Recorded (`{own[0]['record']}`, commit {own[0]['commit']}, {own[0]['run']}):\n\n"
                          f"{latency_table(own)}\n")
            continue
        dev = checks.stage_device(spec)
        cases = checks.cases_for(spec, dev, quick)
        say(f"[tour] {spec.name}: checking on {len(cases)} cases against the fp64 reference"
            + (f" and {load_stage(previous(sid)).SPEC.name}" if previous(sid) else "") + " ...")
        rows = checks.check_stage(sid, cases, progress=lambda i, n, case, r: say(
            f"[tour]   [{i}/{n}] {case.id}: {'ok' if all(x['ok'] for x in r) else 'FAIL'}"))
        worst_rows = checks.summarize(rows)
        check_rows += [dict(r, device=dev.type) for r in worst_rows]
        stage_ok = all(r["ok"] for r in rows)
        all_ok &= stage_ok
        shapes = _timed_shapes(spec, dev, quick)
        rec_data = results.recorded(REGIMES[reg]["results"][1], REGIMES[reg]["results"][0]) \
            if dev.type == "cuda" else None
        live, skipped, need, rest = bench.fit_budget(spec.name, shapes, (rec_data or {}).get("rows", []),
                                                     TOUR_BUDGET_S)
        say(f"[tour] {spec.name}: timing {len(live)} shapes on {dev.type}"
            + (f" (about {need:.0f} s)" if need else "")
            + (f"; {len(skipped)} more would take about {rest:.0f} s: their recorded figures are shown" if skipped
               else "") + " ...")
        tc = reg == "tc-gpu"
        lrows = bench.sweep([sid], live, budget_s=0.3 if quick else 0.5, progress=lambda m: say(f"[tour]   {m}"),
                            **(dict(dtype=torch.bfloat16, gate="bounded", chunk=16, backward=False) if tc else {}))
        lat_rows += [dict(r, where="live") for r in lrows]
        lat_rows += [dict(r, where="recorded") for r in skipped]
        pshape = PROFILE_SHAPE[dev.type]
        kw = checks.stage_inputs(spec, **pshape, device=dev)
        say(f"[tour] {spec.name}: profiling at {bench.shape_label(pshape)} ...")
        profiles[spec.name] = stage.profile(**kw, backward=spec.backward)
        units[spec.name] = spec.region_unit
        at = _at(lrows, REGIMES[reg]["shape"])
        where = f"measured here ({dev.type})" + (", UNSTEADY: see below" if at and bench.unsteady(at) else "")
        if at is None:
            at, m = _recorded_latency(spec.name, reg)
            where += "; times recorded" if at is not None else ""
        summary.append(dict(stage=spec.name, regime=reg, where=("" if stage_ok else "FAILED, ") + where,
                            err_ref=worst(r["err_ref"] for r in worst_rows),
                            **dict(zip(("err_prev", "prev"), checks.vs_previous(worst_rows))),
                            fwd_ms=bench.best_ms(at) if at else None, bwd_ms=bench.best_ms(at, "bwd") if at else None))
        md.append(f"## {spec.name}: {spec.title}\n\nChecks ({len(cases)} cases, worst per output):\n\n"
                  + checks.format_rows(worst_rows, columns=("output", "err_ref", "err_prev", "tol", "ok")) + "\n"
                  + f"Profile at {bench.shape_label(pshape)} ({'seconds' if spec.region_unit == 's' else 'cycles per block'}):\n\n"
                  + md_table([dict(region=k, value=v) for k, v in profiles[spec.name].items()], ["region", "value"])
                  + "\n")
    if os.environ.get("KDALAB_LIVE_FLA") == "1":
        from .fla_ref import fla_available

        if fla_available()[0]:
            for reg in ("fp32-gpu", "tc-gpu"):
                if any(r.get("regime") == reg for r in summary):
                    say(f"[tour] FLA chunk_kda at {bench.shape_label(REGIMES[reg]['shape'])} (first use autotunes "
                        "its Triton kernels: minutes) ...")
                    kw = dict(dtype=torch.bfloat16, gate="bounded", chunk=16, backward=False) if reg == "tc-gpu" \
                        else dict(backward=False)
                    live_fla[reg] = bench.bench_stage("fla", REGIMES[reg]["shape"], **kw)
    live_flashkda = None
    if any(r.get("regime") == "tc-gpu" for r in summary):
        from .fla_ref import flashkda_available

        if flashkda_available()[0]:  # no autotuning: timed whenever it is importable (built)
            say(f"[tour] FlashKDA at {bench.shape_label(REGIMES['tc-gpu']['shape'])} ...")
            try:
                live_flashkda = bench.bench_stage("flashkda", REGIMES["tc-gpu"]["shape"], budget_s=0.5)
            except RuntimeError as e:
                say(f"[tour] FlashKDA not timed: {str(e).splitlines()[0]}")
    figs = []
    for reg in REGIMES:
        rows = [dict(r) for r in lat_rows if regime(load_stage(r["stage"][:2]).SPEC) == reg and bench.best_ms(r)
                and not (r["H"] == 64 and r["K"] == 128 and reg == "fp32-gpu")]  # the seed's shape: not a T sweep
        if not rows:
            continue
        for r in rows:
            r["series"] = f"{r['stage']} (B{r['B']} H{r['H']} K{r['K']})"
            r["fwd_best_ms"] = bench.best_ms(r)
            r["recorded"] = r["where"] == "recorded"
        if reg == "tc-gpu":  # six shapes, not a T sweep: one bar group per shape
            for r in rows:
                r["shape"] = bench.shape_label(r)
            ax = plot_bars(rows, x="shape", y="fwd_best_ms", by="stage", ylabel="forward ms",
                           title=f"Forward latency: {REGIMES[reg]['title']}")
        else:
            ax = plot_latency(rows, y="fwd_best_ms", by="series", ylabel="forward ms",
                              title=f"Forward latency: {REGIMES[reg]['title']}")
        name = f"latency_{reg}.png"
        ax.figure.savefig(out_dir / name, dpi=110)
        figs.append(name)
    if lat_rows:
        md.append("## Latency\n\n" + "".join(f"![latency]({f})\n\n" for f in figs) + latency_table(lat_rows))
        shaky = [m for r in lat_rows if r["where"] == "live" for m in bench.unsteady(r)]
        if shaky:
            md.append("**Unsteady timings** (their repeats disagree: rerun on an idle machine before quoting "
                      "them):\n\n" + "".join(f"- {m}\n" for m in shaky))
    for unit in sorted(set(units.values())):
        bars = {}
        for k, v in profiles.items():
            if units[k] == unit:
                bars.update(split_bars(k, v))
        if bars:
            what = "wall time" if unit == "s" else "clock64 cycles per block"
            ax = plot_profile(bars, unit, title=f"Where the time goes ({what})")
            name = f"profile_{'cpu' if unit == 's' else 'gpu'}.png"
            ax.figure.savefig(out_dir / name, dpi=110, bbox_inches="tight")
            md.append(f"\n![profile]({name})\n")
    table = _summary_tables(summary, live_fla, live_flashkda)
    md.insert(1, "## Summary\n\n" + table)
    path = out_dir / "tour.md"
    path.write_text("\n".join(md))
    results.save(out_dir / "tour.json", [r for r in lat_rows if r["where"] == "live"], meta)
    if record:  # what ran on this machine's CPU becomes the recorded CPU figures
        cpu = [r for r in lat_rows if r["where"] == "live" and r.get("device") == "cpu"]
        results.save(RESULTS_DIR / "cpu" / "tour.json", cpu, meta)
        results.save(RESULTS_DIR / "cpu" / "checks.json", [r for r in check_rows if r["device"] == "cpu"], meta)
    import matplotlib.pyplot as plt

    plt.close("all")
    return dict(ok=all_ok, table=table, path=path, rows=lat_rows, profiles=profiles, summary=summary)


def _recorded_summary(stage_name: str, why: str, reg: str) -> dict:
    """A summary row for a stage from the recorded results: its own worst
    errors and its latency at the regime's shape."""
    err_ref, err_prev, prev = _recorded_errors(stage_name)
    row, meta = _recorded_latency(stage_name, reg)
    # a row measured apart from the file's first run carries its own date ("run")
    where = f"recorded on {meta['device']}, {(row.get('run') or meta['date'])[:10]}" if row else f"not run here ({why})"
    return dict(stage=stage_name, regime=reg, where=where, err_ref=err_ref, err_prev=err_prev, prev=prev,
                fwd_ms=bench.best_ms(row) if row else None, bwd_ms=bench.best_ms(row, "bwd") if row else None)


def recorded_summary_markdown() -> str:
    """The tour's summary tables from the recorded results alone (every stage,
    FLA and FlashKDA; no measurement): the README's and the summary notebook's
    ladder by regime."""
    summary = []
    for sid in STAGE_DIRS:
        try:
            spec = load_stage(sid).SPEC
        except FileNotFoundError:
            continue
        summary.append(_recorded_summary(spec.name, "no recorded figures", regime(spec)))
    return _summary_tables(summary, {})


def correctness_markdown() -> str:
    """The README's correctness table, from results/h200/checks.json and
    results/cpu/checks.json: each stage's own worst errors, and each
    tensor-core stage against FLA."""
    lines = ["| stage | vs fp64 reference | vs previous stage | where |", "|---|---|---|---|"]
    for sub in ("cpu", "h200"):
        data = results.recorded("checks", sub)
        if not data:
            continue
        names = [n for n in STAGE_DIRS.values() if any(r.get("stage") == n and "err_ref" in r for r in data["rows"])]
        for name in names:
            own = [r for r in data["rows"] if r.get("stage") == name and "err_ref" in r]
            by = {r["output"]: r for r in own}
            if "o" in by and len(own) == 2:  # forward only: o and the state apart
                ref = f"{by['o']['err_ref']:.1e} (o), {by['S']['err_ref']:.1e} (state)"
            else:
                ref = f"{worst(r['err_ref'] for r in own):.1e}"
            p, pname = checks.vs_previous(own)
            prev = "-" if p is None else (f"bitwise equal to {pname}" if p == 0 else f"{p:.1e} vs {pname}")
            lines.append(f"| {name} | {ref} | {prev} | {data['meta']['device']}, {len(own)} outputs x "
                         f"{own[0]['cases']} cases |")
        fk = {r["output"]: r for r in data["rows"] if r.get("stage") == results.FLASHKDA and "err_ref" in r}
        if "o" in fk and "S" in fk:  # FlashKDA's own errors, measured beside the stages
            lines.append(f"| {results.FLASHKDA_MEASURED} | {fk['o']['err_ref']:.1e} (o), {fk['S']['err_ref']:.1e} "
                         f"(state) | - | {data['meta']['device']}, 2 outputs x {fk['o']['cases']} cases |")
        fla = [r for r in data["rows"] if "err_fla" in r]
        for name in dict.fromkeys(r["stage"] for r in fla):
            mine = {r["output"]: r for r in fla if r["stage"] == name}
            lines.append(f"| {name} vs FLA chunk_kda | FLA itself: {mine['o']['fla_err_ref']:.1e} (o), "
                         f"{mine['S']['fla_err_ref']:.1e} (state) | {mine['o']['err_fla']:.1e} (o), "
                         f"{mine['S']['err_fla']:.1e} (state) vs FLA | {data['meta']['device']}, tolerance "
                         f"{mine['o']['tol_fla']:g} |")
    return "\n".join(lines) + "\n"


def tc_markdown() -> str:
    """The tensor-core stages, FLA and FlashKDA at the H200 shapes (forward, GPU
    time in ms), from results/h200/tc_stages.json; FlashKDA measured there
    where recorded, else from the newest anchor (see :func:`flashkda_column`)."""
    meta, all_rows = bench.recorded_tc_rows()
    if meta is None:
        return ""
    names = [n for n in dict.fromkeys(r["stage"] for r in all_rows) if n != results.FLASHKDA]
    order = {n: i for i, n in enumerate(STAGE_DIRS.values())}  # the stages in ladder order, the references last
    names.sort(key=lambda n: order.get(n, len(order)))
    rows = [dict(r) for r in all_rows]
    shapes = list(dict.fromkeys(bench.shape_label(r) for r in all_rows if r.get("stage") != results.FLASHKDA))
    fk_head, fk = flashkda_column(shapes)
    heads = [n.replace("FLA chunk_kda", "FLA") for n in names] + [fk_head]
    out = "| shape | " + " | ".join(heads) + " |\n|" + "---|" * (len(names) + 2) + "\n"
    for s in shapes:
        cells = []
        for n in names:
            hit = [r for r in rows if r["stage"] == n and bench.shape_label(r) == s and bench.best_ms(r)]
            cells.append(f"{bench.best_ms(hit[-1]):.3g}" if hit else "-")
        cells.append(fk.get(s, "-"))
        out += f"| {s} | " + " | ".join(cells) + " |\n"
    return out


def results_markdown() -> str:
    """The results block of the README, from the recorded JSON files."""
    lines = ["**The ladder by regime** (each stage's own worst error over its check cases and outputs, and its "
             "latency at one shape per regime; `results/`):\n", recorded_summary_markdown(),
             "**Correctness per stage** (`results/*/checks.json`):\n", correctness_markdown()]
    tc = tc_markdown()
    if tc:
        _, path = results.newest_anchor()
        measured = bool(results.measured_flashkda_rows())
        anchor = f"`results/anchors/{path.name if path else '-'}`"
        fk = (f"FlashKDA measured beside them there, the anchor {anchor} where it was not" if measured
              else f"FlashKDA from the anchor {anchor}")
        _, rows = bench.recorded_tc_rows()
        own = {}  # (record, commit) -> the stages whose rows come from it (RECORDS["latency"] in stage.py)
        for r in rows:
            if r.get("record"):
                own.setdefault((r["record"], r["commit"]), {})[r["stage"][:2]] = None
        decl = "".join(f"; stages {', '.join(ids)} from `{rec}` (commit {commit})" for (rec, commit), ids in own.items())
        lines += [f"**The tensor-core stages against FLA and FlashKDA** (forward, GPU time by CUDA-graph replay, "
                  f"ms; stages and FLA from `results/h200/tc_stages.json`{decl}, {fk}):\n", tc]
    abl = ablations_overview_markdown()
    if abl:
        lines += ["**What each idea bought** (the multi-idea stages with one idea turned off at a time by its "
                  "compile-time switch, every variant checked like the stage; `results/h200/ablations.json`, "
                  "details in each stage's README):\n", abl]
    for p in sorted(RESULTS_DIR.glob("*/*.json")):
        data = results.load(p)
        rows = [r for r in data.get("rows", []) if "fwd_ms" in r and "variant" not in r]
        if not rows:
            continue
        lines.append(f"**{p.relative_to(RESULTS_DIR.parent)}** — {results.label(data['meta'])}\n")
        lines.append(latency_table(rows))
    return "\n".join(lines)


def stage_measured_markdown(stage_name: str) -> str:
    """A stage README's measured figures, generated from results/: its own
    checks, its latency rows (with FLA and FlashKDA at the same shapes) and its
    region profile, each with where it was recorded."""
    out = []
    for sub in ("cpu", "h200"):
        data = results.recorded("checks", sub)
        own = [r for r in (data or {}).get("rows", []) if r.get("stage") == stage_name and "err_ref" in r]
        if own:
            prevs = list(dict.fromkeys(r["prev"] for r in own))
            e = lambda v: "-" if v is None else f"{v:.2e}"  # noqa: E731
            cols, heads = ["output", "err_ref"], ["output", "vs fp64 reference"]
            if len(prevs) == 1:
                out.append(f"Checks ({results.label(data['meta'])}): worst relative error per output over "
                           f"{own[0]['cases']} cases, tolerance {own[0]['tol']:g}.\n")
                if prevs[0]:
                    cols, heads = cols + ["err_prev"], heads + [f"vs {prevs[0]}"]
            else:  # compared with more than one stage (by gate): a row per output and stage compared with
                out.append(f"Checks ({results.label(data['meta'])}): worst relative error per output and stage "
                           f"compared with, over its cases, tolerance {own[0]['tol']:g}.\n")
                cols, heads = cols + ["prev", "err_prev", "cases"], heads + ["compared with", "difference", "cases"]
            out.append(md_table([dict(r, err_ref=e(r["err_ref"]), err_prev=e(r["err_prev"])) for r in own], cols, heads))
        fla = [r for r in (data or {}).get("rows", []) if r.get("stage") == stage_name and "err_fla" in r]
        if fla:
            out.append("Against FLA `chunk_kda` on the same bf16 inputs (tolerance "
                       f"{fla[0]['tol_fla']:g}, the two bf16 bounds added):\n")
            out.append(md_table([dict(r, err_fla=f"{r['err_fla']:.2e}", fla_err_ref=f"{r['fla_err_ref']:.2e}") for r in fla],
                                ["output", "err_fla", "fla_err_ref", "cases"], ["output", "stage vs FLA", "FLA vs fp64", "cases"]))
    for sub, name in (("cpu", "tour"), ("h200", "fp32_stages"), ("h200", "tc_stages")):
        data = results.recorded(name, sub)
        mine = [r for r in (data or {}).get("rows", []) if r.get("stage") == stage_name]
        if not mine:
            continue
        refs = {}
        for r in data["rows"]:
            if r.get("stage") == "FLA chunk_kda":
                refs.setdefault(bench.shape_label(r), {})["FLA"] = bench.best_ms(r)
        fk_head, fk = flashkda_column({bench.shape_label(r) for r in mine}) if name == "tc_stages" else ("", {})
        for lab, cell in fk.items():
            refs.setdefault(lab, {})["FlashKDA"] = cell
        rows = []
        for r in mine:
            ref = refs.get(bench.shape_label(r), {})
            rows.append(dict(shape=bench.shape_label(r), fwd=bench.best_ms(r), bwd=bench.best_ms(r, "bwd"),
                             fla=ref.get("FLA"), fk=ref.get("FlashKDA")))
        cols, heads = ["shape", "fwd"], ["shape", "forward ms"]
        if any(r["bwd"] is not None for r in rows):
            cols, heads = cols + ["bwd"], heads + ["backward ms"]
        if any(r["fla"] is not None for r in rows):
            cols, heads = cols + ["fla"], heads + ["FLA forward ms"]
        if any(r["fk"] is not None for r in rows):
            cols, heads = cols + ["fk"], heads + [fk_head.replace("FlashKDA", "FlashKDA ms", 1)]
        what = "wall time" if sub == "cpu" else "GPU time by CUDA-graph replay where a call is short, else eager"
        out.append(f"Latency ({what}; {results.label(data['meta'])}):\n")
        out.append(md_table(rows, cols, heads))
    out += paths_markdown(stage_name)
    data = results.recorded("profiles")
    prof = [r for r in (data or {}).get("rows", []) if r.get("stage") == stage_name]
    if prof:
        out.append(f"Region profile at {bench.shape_label(prof[0])} (clock64 cycles per block, mean over blocks; "
                   f"{results.label(data['meta'])}):\n")
        out.append(md_table([dict(region=r["region"], value=f"{r['value']:.3g}") for r in prof], ["region", "value"]))
    out += ablation_markdown(stage_name)
    out += diff_markdown(stage_name)
    return "\n".join(out) if out else "(no recorded figures yet)\n"


def paths_markdown(stage_name: str) -> list[str]:
    """A stage with several paths (its stage.py's RECORDS["paths"]): every path per
    shape beside the previous stage and FlashKDA, measured in one call
    (scripts/bench_paths.py): GPU time, and the peak memory of the split
    path, the fused path and FlashKDA."""
    sid = stage_name[:2]
    info = declared_records("paths").get(sid)
    data = results.recorded(info["table"]) if info else None
    if not data:
        return []
    pid = previous(sid)
    rows = data["rows"]
    paths = list(dict.fromkeys(r["path"] for r in rows if r["stage"] == sid))
    cols = [pid] + paths + [results.FLASHKDA]
    table = []
    for lab in dict.fromkeys(bench.shape_label(r) for r in rows):
        at = [r for r in rows if bench.shape_label(r) == lab and not r.get("error")]

        def cell(stage, path=None, key=None):
            hit = [r for r in at if r["stage"] == stage and (path is None or r["path"] == path)]
            if not hit:
                return None
            return hit[0].get(key) if key else bench.best_ms(hit[0])

        d = dict(shape=lab, **{c: cell(pid) if c == pid else cell(results.FLASHKDA) if c == results.FLASHKDA
                               else cell(sid, c) for c in cols})
        fused = [r.get("peak_mb") for r in at if r["stage"] == sid and r["path"].startswith("fused")]
        split = [r.get("peak_mb") for r in at if r["stage"] == sid and r["path"].startswith("split")]
        d.update(mem_rule=cell(sid, "rule", "peak_mb"), mem_split=split[0] if split else None,
                 mem_fused=fused[0] if fused else None, mem_fk=cell(results.FLASHKDA, key="peak_mb"))
        table.append(d)
    heads = ["shape", f"{pid} ms"] + [f"{p} ms" for p in paths] + ["FlashKDA ms", "peak MB rule", "peak MB split",
                                                                  "peak MB fused", "peak MB FlashKDA"]
    return [f"Every path (`stage.path`), stage {pid} and FlashKDA measured in one call by `scripts/bench_paths.py` "
            f"(GPU time by CUDA-graph replay; peak memory above the inputs during one call; "
            f"`results/h200/{info['table']}.json`, {results.label(data['meta'])}):\n",
            md_table(table, ["shape"] + cols + ["mem_rule", "mem_split", "mem_fused", "mem_fk"], heads)]


def ablations_overview_markdown() -> str:
    """One row per ablation of every stage: how much slower the stage is
    without the idea, forward and backward."""
    from . import ablation

    table = []
    for sid in ablation.stages_with_ablations():
        _, rows = ablation.recorded_rows(sid)
        if not rows:
            continue
        full = next(r for r in rows if r["variant"] == "full")
        for b in ablation.bought(rows):
            table.append(dict(stage=full["stage"], shape=b["shape"], idea=b["idea"],
                              fwd=f"x{b['fwd_speedup']:.2f}" if "fwd_speedup" in b else "-",
                              bwd=f"x{b['bwd_speedup']:.2f}" if "bwd_speedup" in b else "-",
                              checks="ok" if b["checks_ok"] else "FAILED"))
    if not table:
        return ""
    return md_table(table, ["stage", "shape", "idea", "fwd", "bwd", "checks"],
                    ["stage", "shape", "idea turned off", "forward: time without / with it",
                     "backward: time without / with it", "checks"])


def ablation_markdown(stage_name: str) -> list[str]:
    """What each idea of the stage bought (results/h200/ablations.json)."""
    from . import ablation

    sid = stage_name[:2]
    if not ablation.ablations(sid):
        return []
    meta, rows = ablation.recorded_rows(sid)
    if not rows:
        return ["What each idea bought: not measured yet (`kdalab ablate " + sid + "` on a GPU).\n"]
    full = next(r for r in rows if r["variant"] == "full")
    shapes = {b["shape"] for b in ablation.bought(rows)}
    at = f"at {bench.shape_label(full)}" if len(shapes) == 1 else "at the shape where each idea runs"
    out = [f"What each idea bought, {at} (each idea turned off alone by its compile-time "
           f"switch, every variant checked like the stage; GPU time per call, and the profile region the idea "
           f"moved in clock64 cycles per block; {results.label(meta)}):\n"]
    table = []
    for b in ablation.bought(rows):
        d = dict(idea=b["idea"], instead=b["instead"], checks="ok" if b["checks_ok"] else "FAILED",
                 err=f"{b['err_full']:.1e}", shape=b["shape"])
        if "peak_mb_without" in b:
            d["peak"] = f"{b['peak_mb_without']:.3g} / {b['peak_mb_with']:.3g}"
        for y in ("fwd", "bwd"):
            if b.get(f"{y}_ms_without") is not None:
                d[y] = (f"{b[f'{y}_ms_without']:.3g} / {b[f'{y}_ms_with']:.3g} "
                        f"(x{b[f'{y}_speedup']:.2f})")
        if b.get("region"):
            d["region"] = f"{b['region']}: {b['region_without']:.3g} / {b['region_with']:.3g}"
        table.append(d)
    cols, heads = ["idea", "instead"], ["idea turned off", "instead"]
    if len(shapes) > 1:
        cols, heads = cols + ["shape"], heads + ["shape"]
    for y, h in (("fwd", "forward ms without / with"), ("bwd", "backward ms without / with")):
        if any(y in d for d in table):
            cols, heads = cols + [y], heads + [h]
    if any("peak" in d for d in table):
        cols, heads = cols + ["peak"], heads + ["peak MB without / with"]
    cols += ["region", "checks", "err"]
    heads += ["region: without / with", "checks", "vs the full stage"]
    out.append(md_table(table, cols, heads))
    return out


def diff_markdown(stage_name: str) -> list[str]:
    """The size of this stage's lesson: `diff -ru` against the previous stage,
    as the files are and as the default builds see them (`kdalab diff`: the
    ablation switches' alternative code of either side left out)."""
    from .stages import DIFF_SUFFIXES, STAGE_DIRS, neighbour_diff, previous

    sid = stage_name[:2]
    pid = previous(sid)
    raw = neighbour_diff(sid)
    if pid is None or not raw:
        return []
    les = {r["file"]: r for r in neighbour_diff(sid, lesson=True)}
    tot = lambda rows, k: sum(r[k] for r in rows)  # noqa: E731
    lesv = list(les.values())
    out = [f"The diff from stage {pid} (`diff -ru stages/{STAGE_DIRS[pid]} stages/{stage_name}`, "
           f"{', '.join(DIFF_SUFFIXES)} files): +{tot(raw, 'added')} / -{tot(raw, 'removed')} lines; "
           f"as the default builds see the sources (`kdalab diff {pid} {sid}`, the ablation switches' alternative "
           f"code left out): +{tot(lesv, 'added')} / -{tot(lesv, 'removed')}.\n"]
    rows = []
    for r in raw:
        lr = les.get(r["file"], dict(added=0, removed=0))
        rows.append(dict(file=r["file"], raw=f"+{r['added']} / -{r['removed']}",
                         lesson=f"+{lr['added']} / -{lr['removed']}"))
    out.append(md_table(rows, ["file", "raw", "lesson"], ["file", "diff -ru", "kdalab diff"]))
    return out


MEASURED_START, MEASURED_END = "<!-- measured:start (generated by `kdalab results --write-readme`) -->", \
    "<!-- measured:end -->"


def stage_readme_block(stage_name: str) -> str:
    return f"{MEASURED_START}\n{stage_measured_markdown(stage_name)}{MEASURED_END}"


def update_stage_readmes() -> list:
    """Rewrite the generated block of each stage README that has one."""
    from .paths import STAGES_DIR

    changed = []
    for name in STAGE_DIRS.values():
        path = STAGES_DIR / name / "README.md"
        if not path.exists() or MEASURED_START not in path.read_text():
            continue
        text = path.read_text()
        a, b = text.index(MEASURED_START), text.index(MEASURED_END) + len(MEASURED_END)
        new = text[:a] + stage_readme_block(name) + text[b:]
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def readme_block() -> str:
    return f"{README_START}\n{results_markdown()}\n{README_END}"


README_FIGURES = {"ladder": "docs/ladder.png", "tensor-core shapes": "docs/tc_latency.png"}
def update_readme(path) -> bool:
    """Rewrite the results block of a document (docs/RESULTS.md) from results/. Returns True if it changed."""
    text = Path(path).read_text()
    a, b = text.index(README_START), text.index(README_END) + len(README_END)
    new = text[:a] + readme_block() + text[b:]
    if new != text:
        Path(path).write_text(new)
    return new != text


SUMMIT_BOUND = 1.02  # issue 36: on the bounded gate the last stage takes at most this times stage 11's GPU time


def summit_rows(data: dict) -> list[dict]:
    """One row per shape of a bench_summit.py record ({"meta", "rows"}). Each round times every
    kernel once on the same inputs, so a ratio is taken within a round and then the median over
    rounds (the device notes' rule: repeat, take the median; a single round can catch the GPU
    mid-drift). Times are the median over rounds too; the worst round's ratio stays in the row.

    - bounded gate: stage 11, the last stage, FlashKDA; ``last / 11`` (and ``last / 11 worst``);
      ``bitwise 11``: the last stage's outputs were stage 11's bits in every round;
    - softplus gate: the last stage now and the earlier kernel (``kernel == "before"``);
      ``now / before`` (and ``now / before worst``); with ``--control`` rows (``kernel ==
      "control"``: today's kernel timed from a subprocess, as the earlier one is) ``control /
      before``, the two kernels timed the same way.
    """
    from statistics import median

    from .inputs import shape_label

    by: dict = {}
    for r in data["rows"]:
        who = {"11_varlen": "11", "FlashKDA": "FlashKDA"}.get(r["stage"], "last")
        if r.get("kernel") in ("before", "control"):
            who = r["kernel"]
        by.setdefault(shape_label(r), {}).setdefault((r["part"], who), {})[r.get("round", 0)] = r

    def ms(d, key):
        return median(x["graph_ms"] for x in d[key].values()) if key in d else None

    def ratios(d, a, b):
        if a not in d or b not in d:
            return []
        return [d[a][k]["graph_ms"] / d[b][k]["graph_ms"] for k in d[a] if k in d[b]]

    out = []
    for lab, d in by.items():
        bd, sp = ("bounded", "last"), ("softplus", "last")
        r11, rfk, rbf = ratios(d, bd, ("bounded", "11")), ratios(d, bd, ("bounded", "FlashKDA")), \
            ratios(d, sp, ("softplus", "before"))
        rcb = ratios(d, ("softplus", "control"), ("softplus", "before"))
        out.append({"shape": lab, "rounds": max(len(v) for v in d.values()),
                    "11 ms": ms(d, ("bounded", "11")), "last ms": ms(d, bd), "FlashKDA ms": ms(d, ("bounded", "FlashKDA")),
                    "last / 11": median(r11) if r11 else None, "last / 11 worst": max(r11, default=None),
                    "last / FlashKDA": median(rfk) if rfk else None,
                    "bitwise 11": all(x.get("equal_to_11") for x in d[bd].values()) if bd in d else None,
                    "softplus ms": ms(d, sp), "before ms": ms(d, ("softplus", "before")),
                    "now / before": median(rbf) if rbf else None, "now / before worst": max(rbf, default=None),
                    "control / before": median(rcb) if rcb else None})
    return out


def summit_verdict(rows: list[dict]) -> dict:
    """Issue 36's two criteria on summit_rows (medians over rounds): ``bounded_ok`` (last / 11 <=
    SUMMIT_BOUND at every shape timed on both), ``softplus_worst`` (the largest control / before
    where the record has control rows, else now / before: ``softplus_by``) and the shapes of each."""
    b = [r for r in rows if r["last / 11"] is not None]
    # the softplus gate against the earlier kernel like for like: today's kernel timed from a subprocess as the
    # earlier one is (control / before) where the record has it, else as timed (now / before)
    key = "control / before" if any(r.get("control / before") is not None for r in rows) else "now / before"
    s = [r for r in rows if r.get(key) is not None]
    return dict(bounded_ok=bool(b) and all(r["last / 11"] <= SUMMIT_BOUND for r in b),
                bounded_worst=max((r["last / 11"] for r in b), default=None),
                bounded_over=[r["shape"] for r in b if r["last / 11"] > SUMMIT_BOUND],
                bitwise=bool(b) and all(r["bitwise 11"] for r in b),
                softplus_by=key,
                softplus_worst=max((r[key] for r in s), default=None),
                softplus_slower=[r["shape"] for r in s if r[key] > 1.0])
