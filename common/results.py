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
    return load(p) if p.exists() else None


def newest_anchor():
    """(data, path) of the newest file in results/anchors/ (names start with the
    date), or (None, None)."""
    files = sorted((RESULTS_DIR / "anchors").glob("*.json"))
    return (load(files[-1]), files[-1]) if files else (None, None)


FLA_TC = "FLA chunk_kda (bf16, safe gate)"  # FLA as benchmarked in the tensor-core regime


def anchor_rows(fla_measured_at=frozenset()):
    """FLA / FlashKDA figures of the newest anchor file (results/anchors/,
    measured on the same H200 beside the stages), as rows like the benchmark's.
    FLA's anchor is left out at the shapes (bench.shape_label) where FLA itself
    was measured by this project."""
    from .bench import shape_label

    data, path = newest_anchor()
    rows = []
    for r in (data or {}).get("rows", []):
        shape = dict(B=r["B"], T=r["T"], H=r["H"], K=r["D"], V=r["D"])
        fla, fk = r.get("fla_ms", r.get("fla_safe_graph_ms")), r.get("flashkda_ms", r.get("flashkda_graph_ms"))
        if fla is not None and shape_label(shape) not in fla_measured_at:
            rows.append(dict(stage=FLA_TC + " (anchor)", **shape, fwd_graph_ms=fla, anchor=path.name))
        if fk is not None:
            rows.append(dict(stage="FlashKDA (anchor)", **shape, fwd_graph_ms=fk, anchor=path.name,
                             peak_mb=r.get("flashkda_peak_mb")))
    return rows


def label(meta: dict) -> str:
    """One line saying where recorded figures come from."""
    return (f"recorded on {meta.get('device')} at {meta.get('date')}, commit {meta.get('commit')}, "
            f"command: {meta.get('command')}")
