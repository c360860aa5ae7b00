"""The results store: JSON files with the device, date, commit and command that
produced them. Recorded GPU figures live in results/ (committed) and are what a
machine without a GPU shows, labelled as recorded.

A results file is {"meta": {...}, "rows": [...]}; rows are flat dicts (stage,
shape, ms, graph_ms, errors, ...), rendered into tables and plots by
common.plotting and common.report.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from .fla_ref import FLASHKDA_NAME
from .inputs import shape_label
from .paths import REPO_ROOT, RESULTS_DIR


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        sha = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("KDALAB_COMMIT", "unknown")


def device_name(device=None) -> str:
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def metadata(command: str | None = None, device=None) -> dict:
    return {
        "device": device_name(device),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": os.environ.get("KDALAB_COMMIT") or git_commit(),
        "command": command or " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def save(path, rows, meta: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    return path


def load(path) -> dict:
    return json.loads(Path(path).read_text())


def recorded(name: str, device_dir: str = "h200") -> dict | None:
    """A recorded results file results/<device_dir>/<name>.json, or None."""
    p = RESULTS_DIR / device_dir / f"{name}.json"
    if not p.exists():
        return None
    data = load(p)
    if isinstance(data.get("meta"), dict):  # the file, for label (in memory only: records are saved with fresh meta)
        data["meta"].setdefault("file", os.path.relpath(os.path.normpath(p), REPO_ROOT))
    return data


def newest_anchor():
    """(data, path) of the newest file in results/anchors/ (names start with the
    date), or (None, None)."""
    files = sorted((RESULTS_DIR / "anchors").glob("*.json"))
    return (load(files[-1]), files[-1]) if files else (None, None)


FLA_TC = "FLA chunk_kda (bf16, safe gate)"  # FLA as benchmarked in the tensor-core regime
FLASHKDA = FLASHKDA_NAME  # the stage name of FlashKDA's rows in a benchmark (bench_stage("flashkda"))
FLASHKDA_MEASURED = "FlashKDA (measured)"  # measured live beside the stages (results/h200/tc_stages.json)


def flashkda_anchor_label(path) -> str:
    """The label of FlashKDA's figures taken from an anchor file."""
    return f"FlashKDA (anchor {Path(path).stem})"


def measured_flashkda_rows(data=None) -> list[dict]:
    """FlashKDA's rows measured live beside the stages: the rows of stage
    "FlashKDA" with a time in results/h200/tc_stages.json (or in ``data``, a
    results file's content), labelled "FlashKDA (measured)" and carrying the
    file's device, date and commit."""
    if data is None:
        data = recorded("tc_stages")
    meta = (data or {}).get("meta", {})
    out = []
    for r in (data or {}).get("rows", []):
        if r.get("stage") == FLASHKDA and (r.get("fwd_graph_ms") is not None or r.get("fwd_ms") is not None):
            out.append(dict(r, stage=FLASHKDA_MEASURED, measured_on=meta.get("device"),  # the row's own run first
                            date=r.get("run") or meta.get("date"), commit=r.get("commit") or meta.get("commit")))
    return out


def anchor_rows(fla_measured_at=frozenset(), flashkda_measured_at=None):
    """FLA / FlashKDA figures of the newest anchor file (results/anchors/,
    measured on the same H200 beside the stages), as rows like the benchmark's.
    FLA's anchor is left out at the shapes (inputs.shape_label) where FLA itself
    was measured by this project, FlashKDA's at the shapes in
    ``flashkda_measured_at`` (default: those of :func:`measured_flashkda_rows`).
    FlashKDA's rows are labelled "FlashKDA (anchor <file>)"."""
    if flashkda_measured_at is None:
        flashkda_measured_at = {shape_label(r) for r in measured_flashkda_rows()}
    data, path = newest_anchor()
    rows = []
    for r in (data or {}).get("rows", []):
        shape = dict(B=r["B"], T=r["T"], H=r["H"], K=r["D"], V=r["D"])
        fla, fk = r.get("fla_ms", r.get("fla_safe_graph_ms")), r.get("flashkda_ms", r.get("flashkda_graph_ms"))
        if fla is not None and shape_label(shape) not in fla_measured_at:
            rows.append(dict(stage=FLA_TC + " (anchor)", **shape, fwd_graph_ms=fla, anchor=path.name))
        if fk is not None and shape_label(shape) not in flashkda_measured_at:
            rows.append(dict(stage=flashkda_anchor_label(path), **shape, fwd_graph_ms=fk, anchor=path.name,
                             peak_mb=r.get("flashkda_peak_mb")))
    return rows


def flashkda_rows(measured=None) -> list[dict]:
    """FlashKDA at every shape it has figures for: measured live beside the
    stages where results/h200/tc_stages.json has it (``measured``: such rows
    instead), else the newest anchor's."""
    measured = measured_flashkda_rows() if measured is None else list(measured)
    at = {shape_label(r) for r in measured}
    return measured + [r for r in anchor_rows(flashkda_measured_at=at) if r["stage"].startswith(FLASHKDA)]


def label(meta: dict, rows=None) -> str:
    """One short line saying where recorded figures come from: the device, the day(s), the commit(s) and the
    file(s) (``meta["file"]``, set by :func:`recorded`; the command, its notes and the hours stay in the record's
    meta, for whoever re-runs it). With ``rows`` (those a table shows) that each name their commit, only those
    commits, and the days the meta gives them (its date and commit fields list calls in the same order, split
    by " / ")."""
    import re

    def found(pat, text):
        return list(dict.fromkeys(m[:7] if pat is _SHA else m for m in re.findall(pat, text)))

    date, commit = str(meta.get("date", "")), str(meta.get("commit", ""))
    days, commits = found(_DAY, date) or [date], found(_SHA, commit) or [commit[:7]]
    shown = [str(r.get("commit"))[:7] for r in rows or () if r.get("commit")]
    if rows and shown and len(shown) == len(list(rows)):
        calls_d, calls_c = date.split(" / "), commit.split(" / ")
        if len(calls_d) == len(calls_c):  # the days of the calls that recorded the rows shown
            picked = [d for d, c in zip(calls_d, calls_c) if set(found(_SHA, c)) & set(shown)]
            days = found(_DAY, " ".join(picked)) or days
        commits = list(dict.fromkeys(shown))
    files = [f for f in str(meta.get("file") or "").split(", ") if f]
    return (f"recorded on {meta.get('device')}, {', '.join(days)}, commit{'s' if len(commits) > 1 else ''} "
            f"{', '.join(commits)}" + (f" ({', '.join(files)})" if files else ""))


_DAY, _SHA = r"\d{4}-\d\d-\d\d", r"\b[0-9a-f]{7,12}\b"
