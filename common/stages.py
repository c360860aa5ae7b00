"""The stage ladder: which stages exist and how to load one.

Stage directories start with a digit, so they are imported by path. Each holds
a ``stage.py`` exposing SPEC (a :class:`common.contract.StageSpec`),
``forward`` (the stage contract), ``build(profile=False)`` and, for stages with
kernels, ``profile``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from .build import import_module_from
from .paths import NEXT_DIR, REPO_ROOT, STAGES_DIR
from .results import recorded

_STAGE_DIR = re.compile(r"^(\d\d)_[a-z0-9_]+$")


def _discover() -> dict:
    """{id: directory name} of every stages/NN_name directory, in ladder order: a stage
    joins the ladder (the tour, the summary, the figures, RESULTS.md) by its directory alone."""
    found = {}
    for p in sorted(STAGES_DIR.iterdir()) if STAGES_DIR.is_dir() else ():
        m = _STAGE_DIR.match(p.name)
        if p.is_dir() and m:
            if m.group(1) in found:
                raise RuntimeError(f"two stage directories share id {m.group(1)}: {found[m.group(1)]}, {p.name}")
            found[m.group(1)] = p.name
    return found


STAGE_DIRS = _discover()

_CACHE: dict = {}


def stage_ids():
    """Ids of the stages that exist (have a stage.py), in ladder order."""
    return [sid for sid, d in STAGE_DIRS.items() if (STAGES_DIR / d / "stage.py").exists()]


def selected_ids(ids=None) -> list[str]:
    """``ids`` (default: every stage) less those that KDALAB_STAGES=05,06 leaves out: the
    GPU tests' way for a student to re-check one stage."""
    only = [normalize(s) for s in os.environ.get("KDALAB_STAGES", "").split(",") if s.strip()]
    return [s for s in (stage_ids() if ids is None else ids) if not only or s in only]


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


def load_next(name: str):
    """Import next/<name>/stage.py, a stage on its way into the ladder, and return the module (cached). It is no
    stage of the ladder: stage_ids() does not list it, so no tour, summary or record reads it."""
    key = f"next/{name}"
    if key not in _CACHE:
        path = NEXT_DIR / name / "stage.py"
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; next/ holds {sorted(p.name for p in NEXT_DIR.iterdir())}")
        _CACHE[key] = import_module_from(path, "kdalab_next_" + name.split("_")[0])
    return _CACHE[key]


def previous(stage_id):
    """The id of the stage a stage is checked against (None for 00)."""
    sid = normalize(stage_id)
    ids = list(STAGE_DIRS)
    i = ids.index(sid)
    return ids[i - 1] if i > 0 else None


class Stage:
    """One stage of the ladder, resolved once: its id and directory, its
    stage.py module, its spec, its paths and ablations, and the stage it is
    checked against. Built by :func:`stage` (cached, one object per stage).
    Attributes it does not define (forward, build, profile, path, ...) come
    from the module, so a Stage goes wherever a stage module does."""

    __slots__ = ("id", "dir", "module")

    def __init__(self, sid: str, module):
        self.id, self.dir, self.module = sid, STAGE_DIRS[sid], module

    @property
    def spec(self):
        return self.module.SPEC

    @property
    def SPEC(self):  # noqa: N802 - the name stage modules use
        return self.module.SPEC

    @property
    def name(self) -> str:
        return self.module.SPEC.name

    @property
    def paths(self) -> dict:
        return dict(getattr(self.module, "PATHS", {}) or {})

    @property
    def ablations(self) -> tuple:
        return tuple(getattr(self.module, "ABLATIONS", ()) or ())

    @property
    def records(self) -> dict:
        """The recorded files the stage declares (``RECORDS`` in stage.py; see :func:`declared_records`)."""
        return dict(getattr(self.module, "RECORDS", {}) or {})

    @property
    def previous(self) -> "Stage | None":
        pid = previous(self.id)
        return stage(pid) if pid is not None else None

    def __getattr__(self, attr):
        return getattr(self.module, attr)

    def __repr__(self) -> str:
        return f"Stage({self.id}, {self.dir})"


_STAGES: dict = {}


def stage(stage_id) -> Stage:
    """The :class:`Stage` of an id ("08", 8, "08_segments"), of a stage module,
    or a Stage itself (returned as it is): resolved once, then cached."""
    if isinstance(stage_id, Stage):
        return stage_id
    if hasattr(stage_id, "SPEC") and not isinstance(stage_id, (str, int)):
        sid = normalize(stage_id.SPEC.name[:2])
        if _CACHE.get(sid) is not stage_id:  # a stand-in (an ablation variant, a test's fake): not cached
            return Stage(sid, stage_id)
    else:
        sid = normalize(stage_id)
    if sid not in _STAGES:
        _STAGES[sid] = Stage(sid, load_stage(sid))
    return _STAGES[sid]


def ladder() -> list[Stage]:
    """Every stage that exists, in ladder order, as :class:`Stage` objects."""
    return [stage(sid) for sid in stage_ids()]


def path_stages() -> list[str]:
    """The stages with several paths (a ``PATHS`` table and ``path()`` in
    stage.py: 08, 09), in ladder order."""
    return [sid for sid in stage_ids() if getattr(load_stage(sid), "PATHS", None)]


# ---------------------------------------------------------------------------
# what the stages declare: the harness reads these, no shared table lists stage ids
# ---------------------------------------------------------------------------

def last_stage() -> str:
    """The id of the ladder's last stage: the summit, whose kernels ``kdalab.chunk_kda`` runs."""
    return stage_ids()[-1]


def tensor_core_stages() -> list[str]:
    """The stages on bf16 tensor cores (their spec's compute dtype), in ladder order: the README's
    tensor-core figure, the summary notebook's and RESULTS.md's table."""
    import torch

    return [sid for sid in stage_ids() if load_stage(sid).SPEC.compute_dtype == torch.bfloat16]


def fused_stage() -> str | None:
    """The first stage with a fused path (a ``PATHS`` name that starts with "fused"), or None."""
    return next((sid for sid in path_stages() if any(n.startswith("fused") for n in load_stage(sid).PATHS)), None)


def declared_records(key: str) -> dict:
    """{stage id: what its stage.py declares as ``RECORDS[key]``}, in ladder order, for the stages
    that declare it. The keys: "paths" (the recorded paths and the fused profile: scripts/bench_paths.py),
    "varlen" (packed sequences: scripts/bench_varlen.py), "latency" (the tensor-core shapes, where
    results/h200/tc_stages.json has no row of the stage: a record and the rows of it that are the stage's).
    A stage may declare more for its own chapter (stage 12: the records its notebook shows)."""
    out = {}
    for sid in stage_ids():
        rec = stage(sid).records
        if key in rec:
            out[sid] = rec[key]
    return out


def record_names(decl) -> list[str]:
    """The record files (names under results/h200/, without .json; "../h100/..." for another device's
    folder) of one ``RECORDS`` entry: a name, a list of names, or a dict that names them under "table",
    "profile" and "file"."""
    if isinstance(decl, str):
        return [decl]
    if isinstance(decl, dict):
        return [decl[k] for k in ("table", "profile", "file") if k in decl]
    return list(decl)


def varlen_record(stage_id) -> dict | None:
    """The recorded packed-sequence file ({"meta", "rows"}) a stage declares (``RECORDS["varlen"]``), or None."""
    name = declared_records("varlen").get(normalize(stage_id))
    return recorded(name) if name else None


# What `diff -ru stages/<previous> stages/<this>` counts: the code, not the README.
DIFF_SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h")

_DIRECTIVE = re.compile(r"^\s*#\s*(ifdef|ifndef|if|elif|else|endif)\b(.*)$")


def _eval_condition(kind: str, expr: str, off: set):
    """The value of a preprocessor condition when every macro in ``off`` is
    undefined, or None when it depends on anything else (left as it is)."""
    expr = re.sub(r"//.*|/\*.*?\*/", "", expr).strip()
    if kind in ("ifdef", "ifndef"):
        name = expr.split()[0] if expr else ""
        if name not in off:
            return None
        return kind == "ifndef"
    e = re.sub(r"defined\s*\(\s*(\w+)\s*\)|defined\s+(\w+)",
               lambda m: "0" if (m.group(1) or m.group(2)) in off else m.group(0), expr)
    if "defined" in e or re.search(r"[A-Za-z_]\w*", e.replace("&&", " ").replace("||", " ")):
        return None  # another macro: not an ablation switch
    e = e.replace("&&", " and ").replace("||", " or ").replace("!", " not ")
    return bool(eval(e, {"__builtins__": {}}, {}))  # noqa: S307 - only 0, 1, and, or, not, parentheses


def strip_ablations(text: str, defines) -> str:
    """The source as the stage's default build sees it: every branch of an
    ablation switch (``defines``, all undefined) resolved, its directives
    removed; other preprocessor conditionals (KDA_PROFILE, ...) kept."""
    off = set(defines)
    out, stack = [], []  # frame: [resolved?, parent active, this branch active, a branch taken]
    for line in text.splitlines():
        active = all(f[2] for f in stack)
        m = _DIRECTIVE.match(line)
        if m is None:
            if active:
                out.append(line)
            continue
        kind, expr = m.group(1), m.group(2)
        if kind in ("ifdef", "ifndef", "if"):
            v = _eval_condition(kind, expr, off)
            if v is None:
                stack.append([False, active, True, True])
                if active:
                    out.append(line)
            else:
                stack.append([True, active, v, v])
        elif kind == "elif":
            f = stack[-1]
            if not f[0]:
                if all(g[2] for g in stack[:-1]):
                    out.append(line)
                continue
            v = _eval_condition("if", expr, off)
            if v is None:
                raise ValueError(f"#elif mixing an ablation switch with other macros: {line.strip()}")
            f[2] = (not f[3]) and v
            f[3] = f[3] or v
        elif kind == "else":
            f = stack[-1]
            if not f[0]:
                if all(g[2] for g in stack[:-1]):
                    out.append(line)
                continue
            f[2] = not f[3]
            f[3] = True
        else:  # endif
            f = stack.pop()
            if not f[0] and all(g[2] for g in stack):
                out.append(line)
    if stack:
        raise ValueError("unbalanced #if / #endif")
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def lesson_source(stage_id, name: str) -> list[str]:
    """One file of a stage directory as its lesson: with the stage's ablation
    switches resolved to the default build (C++ sources), as lines."""
    sid = normalize(stage_id)
    path = STAGES_DIR / STAGE_DIRS[sid] / name
    if not path.exists():
        return []
    text = path.read_text()
    if path.suffix in (".cu", ".cuh", ".cpp", ".h"):
        stage = load_stage(sid)
        text = strip_ablations(text, [a.define for a in getattr(stage, "ABLATIONS", ())])
    return text.splitlines()


def neighbour_diff(stage_id, *, lesson: bool = False) -> list[dict]:
    """Lines added and removed per file from the previous stage's directory to
    this one's (the files `diff -ru` compares, READMEs left out): the size of
    the lesson. With ``lesson``, both sides as their default builds see them
    (:func:`lesson_source`: the ablation switches' alternative code left out).
    Empty for stage 00."""
    import difflib

    sid = normalize(stage_id)
    pid = previous(sid)
    if pid is None:
        return []
    a, b = STAGES_DIR / STAGE_DIRS[pid], STAGES_DIR / STAGE_DIRS[sid]
    names = sorted({p.name for d in (a, b) for p in d.iterdir() if p.suffix in DIFF_SUFFIXES})
    rows = []
    for n in names:
        if lesson:
            old, new = lesson_source(pid, n), lesson_source(sid, n)
        else:
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


def build_parallel(stage_ids, *, profile: bool = True, say=print, jobs: int | None = None,
                   ablations: bool = False) -> dict:
    """Build stages (and their profile variants, and with ``ablations`` every
    ablation variant of theirs) in parallel processes, one per extension, as a
    tour or a GPU session does before anything else. Returns {stage id (or
    "id -ablation"): the compiler's error lines} for those that failed."""
    from concurrent.futures import ThreadPoolExecutor

    code = ("import sys\nfrom common.build import CompileError\nfrom common.stages import load_stage\n"
            "try:\n    load_stage(sys.argv[1]).build(profile=sys.argv[2] == '1', "
            "**({'ablation': sys.argv[3]} if len(sys.argv) > 3 else {}))\n"
            "except CompileError as e:\n    print(e)\n    sys.exit(4)\n")
    todo = []
    for s in stage_ids:
        stage = load_stage(s)
        if not getattr(stage, "SOURCES", None):
            continue
        variants = [()] + ([(a.name,) for a in getattr(stage, "ABLATIONS", ())] if ablations else [])
        todo += [(s, p) + v for v in variants for p in (("0", "1") if profile else ("0",))]
    if not todo:
        return {}
    n = jobs or max(1, min(len(todo), (os.cpu_count() or 2) // 2))
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", str(max(1, (os.cpu_count() or 2) // n))))
    t0 = time.time()

    def one(job):
        sid, prof = job[:2]
        what = sid + "".join(f" -{a}" for a in job[2:])
        out = subprocess.run([sys.executable, "-c", code, *job], capture_output=True, text=True, cwd=REPO_ROOT,
                             env=env)
        say(f"{what}{' (profile)' if prof == '1' else ''}: {'built' if out.returncode == 0 else 'FAILED'} "
            f"({time.time() - t0:.0f} s)")
        return what, out.returncode, out.stdout + out.stderr

    failed = {}
    with ThreadPoolExecutor(n) as ex:
        for what, rc, text in ex.map(one, todo):
            if rc != 0:
                failed[what] = text.strip()[-3000:]
    return failed
