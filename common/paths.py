"""Where things live in the repository."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STAGES_DIR = Path(os.environ.get("KDALAB_STAGES_DIR", REPO_ROOT / "stages"))  # a copy, for planted-bug tests
NEXT_DIR = REPO_ROOT / "next"  # stages on their way into the ladder
RESULTS_DIR = REPO_ROOT / "results"  # recorded figures, committed
REPORTS_DIR = Path(os.environ.get("KDALAB_REPORTS", REPO_ROOT / "reports"))  # generated
BUILD_DIR = Path(os.environ.get("KDALAB_BUILD", REPO_ROOT / "build"))  # extension builds
INCLUDE_DIR = Path(__file__).resolve().parent / "include"


def checkout_of(path) -> Path | None:
    """The KDA Lab checkout a path lies in (the nearest folder at or above it that holds common/ and
    stages/), or None. Notebooks, scripts and the command line run the checkout they are in."""
    p = Path(path).resolve()
    for d in (p, *p.parents):
        if (d / "common" / "notebook.py").exists() and (d / "stages").is_dir():
            return d
    return None
