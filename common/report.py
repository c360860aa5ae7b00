"""Reports: the tour (build, check, time, profile every stage this machine can
run, list the others with their recorded figures) and the results tables."""

from __future__ import annotations

import json
from pathlib import Path

from . import bench, checks, results
from .paths import RESULTS_DIR
from .plotting import plot_latency, plot_profile
from .stages import STAGE_DIRS, load_stage, previous

# The shape a stage's profile is taken at, per device type.
PROFILE_SHAPE = {"cpu": dict(B=1, T=256, H=2, K=32, V=32), "cuda": dict(B=2, T=2048, H=4, K=64, V=64)}


def _fmt(v, spec="{:.3g}"):
    if v is None:
        return "-"
    if isinstance(v, float):
        return spec.format(v)
    return str(v)


def md_table(rows, columns, headers=None) -> str:
    headers = headers or columns
    out = "| " + " | ".join(headers) + " |\n|" + "---|" * len(columns) + "\n"
    for r in rows:
        out += "| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |\n"
    return out


def latency_table(rows) -> str:
    cols = ["stage", "B", "T", "H", "K", "V", "fwd_ms", "fwd_graph_ms", "bwd_ms", "bwd_graph_ms"]
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


def tour(stage_ids, *, out_dir: Path, quick: bool = False, say=print, record: bool = False) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, lat_rows, profiles, units, md, all_ok = [], [], {}, {}, [], True
    meta = results.metadata(command="kdalab tour" + (" --quick" if quick else "") + (" --record" if record else ""))
    md.append(f"# KDA Lab tour\n\n{meta['device']}, {meta['date']}, commit {meta['commit']}, "
              f"torch {meta['torch']}.\n")
    for sid in stage_ids:
        d = STAGE_DIRS[sid]
        try:
            stage = load_stage(sid)
        except FileNotFoundError:
            say(f"[tour] {d}: not written yet (see stages/{d}/README.md)")
            summary.append(dict(stage=d, status="not written yet"))
            continue
        spec = stage.SPEC
        ok, why = spec.runnable_here()
        if not ok:
            rec = recorded_rows(spec.name)
            say(f"[tour] {spec.name}: not run here ({why}); showing its recorded results" if rec else
                f"[tour] {spec.name}: not run here ({why}); no recorded results yet")
            summary.append(_recorded_summary(spec.name, why))
            md.append(f"## {spec.name}: not run here\n\n{why}.\n")
            for m, rows in rec:
                md.append(f"Recorded ({results.label(m)}):\n\n{latency_table(rows)}\n")
            continue
        say(f"[tour] {spec.name}: building ...")
        stage.build()
        if spec.regions and stage.build() is not None:
            stage.build(profile=True)
        dev = checks.stage_device(spec)
        cases = checks.cases_for(spec, dev, quick)
        say(f"[tour] {spec.name}: checking on {len(cases)} cases against the fp64 reference"
            + (f" and {load_stage(previous(sid)).SPEC.name}" if previous(sid) else "") + " ...")
        rows = checks.check_stage(sid, cases)
        worst = checks.summarize(rows)
        stage_ok = all(r["ok"] for r in rows)
        all_ok &= stage_ok
        shapes = bench.sweep_for(spec, dev, quick)
        say(f"[tour] {spec.name}: timing {len(shapes)} shapes on {dev.type} ...")
        lrows = bench.sweep([sid], shapes, budget_s=0.5 if quick else 1.0,
                            progress=lambda m: say(f"[tour]   {m}"))
        lat_rows += lrows
        pshape = PROFILE_SHAPE[dev.type]
        kw = checks.stage_inputs(spec, **pshape, device=dev)
        profiles[spec.name] = stage.profile(**kw, backward=spec.backward)
        units[spec.name] = spec.region_unit
        summary.append(dict(stage=spec.name, status=("ok" if stage_ok else "FAILED") + f", measured here ({dev.type})",
                            err_ref=max(r["err_ref"] for r in worst),
                            err_prev=max((r["err_prev"] for r in worst if r["err_prev"] is not None), default=None),
                            fwd_ms=bench.best_ms(lrows[-1]), bwd_ms=bench.best_ms(lrows[-1], "bwd"),
                            shape=bench.shape_label(lrows[-1])))
        md.append(f"## {spec.name}: {spec.title}\n\nChecks ({len(cases)} cases, worst per output):\n\n"
                  + checks.format_rows(worst, columns=("output", "err_ref", "err_prev", "tol", "ok")) + "\n"
                  + f"Profile at {bench.shape_label(pshape)} ({spec.region_unit}):\n\n"
                  + md_table([dict(region=k, value=v) for k, v in profiles[spec.name].items()], ["region", "value"])
                  + "\n")
    if lat_rows:
        ax = plot_latency([r for r in lat_rows if "fwd_ms" in r], y="fwd_ms", title="Forward latency (this machine)",
                          ylabel="ms")
        ax.figure.savefig(out_dir / "latency.png", dpi=110)
        md.append("## Latency\n\n![latency](latency.png)\n\n" + latency_table(lat_rows))
    for unit in sorted(set(units.values())):
        profs = {k: v for k, v in profiles.items() if units[k] == unit}
        if profs:
            ax = plot_profile(profs, unit, title=f"Where the time goes ({unit})")
            name = f"profile_{'cpu' if unit == 's' else 'gpu'}.png"
            ax.figure.savefig(out_dir / name, dpi=110)
            md.append(f"\n![profile]({name})\n")
    table = md_table(summary, ["stage", "status", "err_ref", "err_prev", "shape", "fwd_ms", "bwd_ms"],
                     ["stage", "status", "max err vs fp64", "max err vs prev", "at shape", "fwd ms", "bwd ms"])
    md.insert(1, "## Summary\n\n" + table)
    path = out_dir / "tour.md"
    path.write_text("\n".join(md))
    results.save(out_dir / "tour.json", lat_rows, meta)
    if record:
        results.save(RESULTS_DIR / "cpu" / "tour.json", lat_rows, meta)
    return dict(ok=all_ok, table=table, path=path, rows=lat_rows, profiles=profiles)


def _recorded_summary(stage_name: str, why: str) -> dict:
    """A summary row for a stage this machine cannot run, from results/: the
    recorded worst errors and the latency at the last shape of its sweep."""
    row = dict(stage=stage_name, status=f"not run here ({why}); recorded figures")
    devices = set()
    for meta, rows in recorded_rows(stage_name):
        for r in rows:
            if "err_ref" in r:
                row["err_ref"] = max(row.get("err_ref") or 0.0, r["err_ref"])
                if r.get("err_prev") is not None:
                    row["err_prev"] = max(row.get("err_prev") or 0.0, r["err_prev"])
                devices.add(meta.get("device"))
            elif r.get("fwd_ms") is not None:
                row["fwd_ms"], row["bwd_ms"] = bench.best_ms(r), bench.best_ms(r, "bwd")
                row["shape"] = shape_label_safe(r)
                devices.add(meta.get("device"))
    if devices:
        row["status"] = f"not run here ({why}); recorded on {', '.join(sorted(d for d in devices if d))}"
    return row


def shape_label_safe(r) -> str:
    try:
        return bench.shape_label(r)
    except KeyError:
        return "-"


def results_markdown() -> str:
    """The results table of the README, from the recorded JSON files."""
    lines = []
    for p in sorted(RESULTS_DIR.glob("*/*.json")):
        data = results.load(p)
        rows = [r for r in data.get("rows", []) if "fwd_ms" in r]
        if not rows:
            continue
        lines.append(f"**{p.relative_to(RESULTS_DIR.parent)}** — {results.label(data['meta'])}\n")
        lines.append(latency_table(rows))
    return "\n".join(lines) if lines else "(no recorded results yet)"


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def readme_block() -> str:
    return f"{README_START}\n{results_markdown()}\n{README_END}"


README_FIGURES = {"ladder": "docs/ladder.png", "tensor-core shapes": "docs/tc_latency.png"}


def write_figures(root) -> list:
    """The README's figures, drawn from the recorded results (no GPU needed):
    the ladder at the seed's shape and the tensor-core stages against FLA and
    FlashKDA at the six H200 shapes."""
    import matplotlib.pyplot as plt

    from . import notebook

    draw = {"ladder": notebook.ladder, "tensor-core shapes": lambda: notebook.tc_latency(["05", "06", "07"])}
    out = []
    for key, fn in draw.items():
        ax, _ = fn()
        path = Path(root) / README_FIGURES[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        ax.figure.savefig(path, dpi=110)
        out.append(path)
    plt.close("all")
    return out


def update_readme(path) -> bool:
    """Rewrite the results block of README.md from results/. Returns True if it changed."""
    text = Path(path).read_text()
    a, b = text.index(README_START), text.index(README_END) + len(README_END)
    new = text[:a] + readme_block() + text[b:]
    if new != text:
        Path(path).write_text(new)
    return new != text
