"""The stage ladder: which stages exist and how to load one.

Stage directories start with a digit, so they are imported by path. Each holds
a ``stage.py`` exposing SPEC (a :class:`common.contract.StageSpec`),
``forward`` (the stage contract), ``build(profile=False)`` and, for stages with
kernels, ``profile``.
"""

from __future__ import annotations

from .build import import_module_from
from .paths import STAGES_DIR

STAGE_DIRS = {
    "00": "00_naive",
    "01": "01_cpp",
    "02": "02_cuda_baseline",
    "03": "03_chunk_parallel",
    "04": "04_warp",
    "05": "05_cute_bf16",
    "06": "06_ws_pipeline",
    "07": "07_movm_register",
}

_CACHE: dict = {}


def stage_ids():
    """Ids of the stages that exist (have a stage.py), in ladder order."""
    return [sid for sid, d in STAGE_DIRS.items() if (STAGES_DIR / d / "stage.py").exists()]


def normalize(stage_id) -> str:
    s = str(stage_id).strip()
    if s in STAGE_DIRS:
        return s
    for sid, d in STAGE_DIRS.items():
        if s == d or s.lstrip("0") == sid.lstrip("0"):
            return sid
    raise ValueError(f"unknown stage {stage_id!r}; stages are {', '.join(STAGE_DIRS)}")


def load_stage(stage_id):
    """Import stages/<dir>/stage.py and return the module (cached)."""
    sid = normalize(stage_id)
    if sid in _CACHE:
        return _CACHE[sid]
    path = STAGES_DIR / STAGE_DIRS[sid] / "stage.py"
    if not path.exists():
        raise FileNotFoundError(f"stage {sid} ({STAGE_DIRS[sid]}) has no stage.py yet: see its README")
    mod = import_module_from(path, f"kdalab_stage_{sid}")
    _CACHE[sid] = mod
    return mod


def previous(stage_id):
    """The id of the stage a stage is checked against (None for 00)."""
    sid = normalize(stage_id)
    ids = list(STAGE_DIRS)
    i = ids.index(sid)
    return ids[i - 1] if i > 0 else None


# What `diff -ru stages/<previous> stages/<this>` counts: the code, not the README.
DIFF_SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h")


def neighbour_diff(stage_id) -> list[dict]:
    """Lines added and removed per file from the previous stage's directory to
    this one's (the files `diff -ru` compares, READMEs left out): the size of
    the lesson. Empty for stage 00."""
    import difflib

    sid = normalize(stage_id)
    pid = previous(sid)
    if pid is None:
        return []
    a, b = STAGES_DIR / STAGE_DIRS[pid], STAGES_DIR / STAGE_DIRS[sid]
    names = sorted({p.name for d in (a, b) for p in d.iterdir() if p.suffix in DIFF_SUFFIXES})
    rows = []
    for n in names:
        old = (a / n).read_text().splitlines() if (a / n).exists() else []
        new = (b / n).read_text().splitlines() if (b / n).exists() else []
        plus = minus = 0
        for line in difflib.unified_diff(old, new, lineterm="", n=0):
            if line.startswith("+") and not line.startswith("+++"):
                plus += 1
            elif line.startswith("-") and not line.startswith("---"):
                minus += 1
        if plus or minus:
            rows.append(dict(file=n, added=plus, removed=minus))
    return rows
