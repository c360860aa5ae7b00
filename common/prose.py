"""Every measured figure in the prose, tied to the one record it quotes.

The READMEs (outside their generated blocks), docs/ and the notebooks' markdown
cells quote latencies, errors, cycle counts, memory, speed-ups and percentages.
Each such figure (two or more significant digits) has an entry in the figure
index, docs/figures.json, that names where it comes from:

- ``{"of": ATOM}``: the figure is that recorded value (in the figure's unit);
- ``{"ratio": [A, B]}``: a speed-up or a fraction, value A / value B;
- ``{"pct": [A, B], "op": "share" | "change" | "saving"}``: 100 A/B, 100 (A/B - 1)
  or 100 (1 - A/B);
- ``{"not_measured": "why"}``: a figure that no run records (a constant, an estimate,
  a prediction), with the reason.

An ATOM is one number of results/: ``FILE#/json/pointer`` (a leaf), or a value
derived from one record (``FILE#sum/...``: the regions of one kernel added up, as
its profile bar shows; ``FILE#/rows/N/profile@chunkT/...``: the fused kernel's
profile per chunk, common.notebook.chunk_profile).

A figure is found in the index by its document, its line with every figure masked
(so that changing a figure does not unbind it), which of the document's lines of
that masked text it is, and its place in the line. :func:`check` holds every
figure to its entry: the entry's value must round to the printed figure. A figure
without an entry fails, and so does an entry no figure uses. ``python
scripts/bind_figures.py`` proposes entries for new figures (by the stage, shape,
path and quantity that the figure's context names) and keeps the others.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from functools import lru_cache

from .paths import REPO_ROOT, RESULTS_DIR

INDEX = REPO_ROOT / "docs" / "figures.json"

# ---------------------------------------------------------------------------
# the documents and their figures
# ---------------------------------------------------------------------------

_GENERATED = [("<!-- results:start -->", "<!-- results:end -->"),
              ("<!-- measured:start", "<!-- measured:end -->")]


def _strip_generated(text: str) -> str:
    """The text with its generated blocks blanked (same line count): those are
    regenerated from results/ and compared whole (tests/test_readme.py)."""
    for start, end in _GENERATED:
        while start in text:
            a = text.index(start)
            b = text.index(end, a) + len(end)
            text = text[:a] + "\n" * text[a:b].count("\n") + text[b:]
    return text


def documents() -> list[tuple[str, str]]:
    """(path, prose) of every document whose figures are checked: README.md,
    docs/*.md, each stage README and each notebook's markdown cells (joined)."""
    out = [("README.md", _strip_generated((REPO_ROOT / "README.md").read_text()))]
    for p in sorted((REPO_ROOT / "docs").glob("*.md")):
        out.append((str(p.relative_to(REPO_ROOT)), _strip_generated(p.read_text())))
    for p in sorted((REPO_ROOT / "stages").glob("*/README.md")):
        out.append((str(p.relative_to(REPO_ROOT)), _strip_generated(p.read_text())))
    for p in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(p.read_text())
        text = CELL_SEP.join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        out.append((str(p.relative_to(REPO_ROOT)), text))
    return out


CELL_SEP = "\n\n<!-- cell -->\n\n"  # between a notebook's markdown cells in its prose


def passage(doc_lines: list[str], i: int) -> tuple[int, int]:
    """Lines [lo, hi] of the passage around line i: its notebook cell, else its paragraph."""
    sep = CELL_SEP.strip()
    if any(line == sep for line in doc_lines):
        lo, hi = i, i
        while lo > 0 and doc_lines[lo - 1] != sep:
            lo -= 1
        while hi + 1 < len(doc_lines) and doc_lines[hi + 1] != sep:
            hi += 1
        return lo, hi
    lo, hi = i, i
    while lo > 0 and doc_lines[lo - 1].strip():
        lo -= 1
    while hi + 1 < len(doc_lines) and doc_lines[hi + 1].strip():
        hi += 1
    return lo, hi


NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
_SEP = r"\s*(?:-|–|to|against|/)\s*"
PATTERNS = [  # (kind, regex with the figures in groups 1 and 2, the unit in group 3)
    ("time", re.compile(rf"(?<![\w.^/=])({NUM})(?:{_SEP}({NUM}))?\s*(ms|s|us|µs)\b")),
    ("value", re.compile(r"(?<![\w.^])(\d+\.\d+e[+-]?\d+)(?:\s*(?:-|–|/|to|->|→)\s*(\d+\.\d+e[+-]?\d+))?()")),
    ("ratio", re.compile(rf"(?<![\w.^=])({NUM})(?:\s*(?:-|–|to)\s*({NUM}))?\s*(x)\b(?!\s*\d)(?!\s+[A-Za-z_]\w*\s+x\b)")),
    ("memory", re.compile(rf"(?<![\w.^])({NUM})(?:{_SEP}({NUM}))?\s*(MB|GB)\b")),
    ("percent", re.compile(rf"(?<![\w.^])({NUM})(?:\s*(?:-|–|to)\s*({NUM}))?\s*(%)")),
    # clock64 cycles written out ("407 cycles per chunk", "317 → 189 cycles"): a value, like "4.86e3 cycles"
    ("cycles", re.compile(rf"(?<![\w.^])({NUM})(?:\s*(?:-|–|to|against|/|->|→)\s*({NUM}))?(?=\s*cycles\b)()")),
    # a decimal without a unit ("0.1657, 0.7620 and 1.1732 ms", "0.42 warps per cycle"): in the unit of the
    # record it quotes. Not a version ("CUDA 13.0", "Python 3.11", "2.11.0") and not inside `code`.
    ("decimal", re.compile(r"(?<![\w.^/\-])(\d+\.\d+)(?![\w.]*\w)(?!\.\d)()()")),
]
_VERSION = re.compile(r"(?:Python|CUDA|cuda|nvcc|torch|triton|fla-core|sm)`?\s*$")  # "CUDA 13.0", "`nvcc` 13.0"
DECIMAL = "num"  # the unit of a decimal printed without one: any record's unit, as it is


def sig_digits(text: str) -> int:
    """Significant digits as printed ("100" and "20" have one, "0.0728" three, "1.5e3" two)."""
    t = text.split("e")[0].replace(",", "")
    digits = t.replace(".", "").lstrip("0")
    return len(digits if "." in t else digits.rstrip("0"))


@dataclass(frozen=True)
class Figure:
    doc: str
    lineno: int  # 1-based line of the document's prose
    line: str
    start: int  # span of the number in the line
    end: int
    text: str  # the number as printed
    kind: str  # time, value, ratio, memory, percent
    unit: str  # ms, s, us, MB, GB, x, %, "" (a value)
    key: tuple = field(default=(), compare=False)  # (doc, masked-line hash, occurrence, index in line)

    @property
    def number(self) -> float:
        return float(self.text.replace(",", ""))


_CODE = re.compile(r"`[^`]*`")


def _spans(line: str):
    """(start, end, text, kind, unit) of every figure in a line, left to right, one per number."""
    seen, out = set(), []
    code = [m.span() for m in _CODE.finditer(line)]
    for kind, rx in PATTERNS:
        for m in rx.finditer(line):
            for gi in (1, 2):
                if not m.group(gi) or m.start(gi) in seen:
                    continue
                if kind == "decimal" and (any(a <= m.start(gi) < b for a, b in code)
                                          or _VERSION.search(line[:m.start(gi)])):
                    continue
                seen.add(m.start(gi))
                unit = DECIMAL if kind == "decimal" else {"us": "us", "µs": "us"}.get(m.group(3), m.group(3))
                out.append((m.start(gi), m.end(gi), m.group(gi), kind, unit))
    out.sort()
    for i in range(len(out) - 2, -1, -1):  # a decimal in a list that ends in a unit has that unit
        s, e, text, kind, unit = out[i]
        nxt = out[i + 1]
        if kind == "decimal" and nxt[3] in ("time", "memory") and _LIST_GAP.fullmatch(line[e:nxt[0]]):
            out[i] = (s, e, text, nxt[3], nxt[4])
    return out


_LIST_GAP = re.compile(r"\s*(?:,|;|and|against|vs\.?|or|->|→|/|-|–|to)?\s*(?:and\s+)?")


def mask(line: str) -> str:
    """The line with every figure's number replaced by '#'."""
    out, at = [], 0
    for s, e, *_ in _spans(line):
        out += [line[at:s], "#"]
        at = e
    return "".join(out + [line[at:]])


def figures(doc: str, text: str) -> list[Figure]:
    """The figures of one document (one significant digit included: "about 2 GB", "within 0.7x"), keyed."""
    out, seen = [], {}
    for lineno, line in enumerate(text.splitlines(), 1):
        spans = _spans(line)
        if not spans:
            continue
        h = hashlib.sha1(mask(line).strip().encode()).hexdigest()[:12]
        occ = seen[h] = seen.get(h, -1) + 1
        for i, (s, e, t, kind, unit) in enumerate(spans):
            out.append(Figure(doc, lineno, line, s, e, t, kind, unit, key=(doc, h, occ, i)))
    return out


def all_figures(docs=None) -> list[Figure]:
    return [f for d, t in (docs or documents()) for f in figures(d, t)]


def matches(printed: str, value: float) -> bool:
    """Does ``value`` round to the printed figure (at its significant digits)?"""
    if value is None or not math.isfinite(value) or value == 0:
        return False
    x, n = float(printed.replace(",", "")), sig_digits(printed)
    return float(f"{value:.{n}g}") == float(f"{x:.{n}g}")


def bound_of(value: float, n: int, upper: bool) -> float:
    """The tightest bound of ``value`` printed with ``n`` significant digits: rounded up (an upper bound,
    "within 0.7x" of 0.66x) or down (a lower bound, "at least 1.2x" of 1.27x)."""
    e = math.floor(math.log10(abs(value))) - max(n, 1) + 1
    q = value / 10 ** e
    q = math.ceil(q - 1e-9) if upper else math.floor(q + 1e-9)
    return float(f"{q * 10 ** e:.{max(n, 1) + 1}g}")


def bounds(printed: str, value: float, upper: bool) -> bool:
    """Is the printed figure the tightest bound of ``value`` at its digits (see :func:`bound_of`)?"""
    if value is None or not math.isfinite(value) or value == 0:
        return False
    x = float(printed.replace(",", ""))
    return math.isclose(bound_of(value, sig_digits(printed), upper), x, rel_tol=1e-9)


# ---------------------------------------------------------------------------
# the recorded values (atoms)
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Atom:
    id: str
    value: float
    unit: str  # ms, s, MB, value
    tags: frozenset  # "stage:09", "B:8", "path:fused8", "out:o", "commit:d91b051", "key:fwd_graph_ms", ...
    group: tuple | None = None  # atoms whose ratios prose may quote: same shape and direction, region or bar


_SHA = re.compile(r"\b[0-9a-f]{7}\b")
_ROW_TAGS = ("stage", "path", "variant", "output", "region", "case", "against", "kernel", "gate", "notebook",
             "series", "direction", "define", "idea", "where", "run")


def stage_tag(name) -> str | None:
    s = str(name)
    if re.match(r"^\d\d(_|$)", s):
        return "stage:" + s[:2]
    low = s.lower()
    if "flashkda" in low:
        return "stage:flashkda"
    if low.startswith("fla"):
        return "stage:fla"
    return None


def _unit(key: str, in_profile: bool) -> str | None:
    if in_profile:
        return "value"  # a region of a profile: clock64 cycles
    if key.endswith("_ms") and "min" not in key:
        return "ms"
    if key == "seconds":
        return "s"
    if key.endswith("_mb"):
        return "MB"
    if "err" in key or key in ("o", "S", "value") or key.endswith("_relerr"):
        return "value"
    return None


def _row_tags(d: dict) -> set:
    tags = set()
    for k in _ROW_TAGS:
        v = d.get(k)
        if isinstance(v, str):
            tags.add(f"{k}:{v}")
            if k == "stage" and stage_tag(v):
                tags.add(stage_tag(v))
            if k == "region":
                tags.add("region:" + v.split(":", 1)[-1].strip())
    for k in ("B", "T", "H", "K", "V"):
        if isinstance(d.get(k), int):
            tags.add(f"{k}:{d[k]}")
    if isinstance(d.get("D"), int):
        tags |= {f"K:{d['D']}", f"V:{d['D']}"}
    if isinstance(d.get("commit"), str):
        tags |= {"commit:" + c for c in _SHA.findall(d["commit"])}
    return tags


def _shape(d: dict):
    if all(isinstance(d.get(k), int) for k in ("B", "T", "H")):
        return (d["B"], d["T"], d["H"], d.get("K", d.get("D")))
    return None


def _walk(obj, ptr, tags, key, in_profile, row, out):
    """Collect (pointer, value, unit, tags, row) of the numbers under ``obj``; ``row`` is the
    nearest enclosing dict that names a stage or a shape."""
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        unit = _unit(key, in_profile)
        if unit is not None and math.isfinite(obj):
            t = tags | {"key:" + key}
            if in_profile:
                t |= {f"region:{key}", "region:" + key.split(":", 1)[-1].strip()}
            st = stage_tag(key[:-3]) if key.endswith(("_ms", "_mb")) else None
            out.append((ptr, float(obj), unit, t | ({st} if st else set()), row))
        return
    if isinstance(obj, dict):
        here = tags | _row_tags(obj)
        r = obj if (_shape(obj) or "stage" in obj) else row
        for k, v in obj.items():
            _walk(v, f"{ptr}/{k}", here, k, k == "profile" or in_profile, r, out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _walk(v, f"{ptr}/{i}", tags, key, in_profile, row, out)


def _leaves(path, data) -> list:
    """(pointer, value, unit, tags, row) of every recorded number of one file."""
    meta = data.get("meta") if isinstance(data, dict) else None
    tags = {"file:" + path}
    if isinstance(meta, dict):
        tags |= {"commit:" + c for c in _SHA.findall(str(meta.get("commit", "")))}
    tags |= {"commit:" + c for c in _SHA.findall(path)}
    out = []
    _walk(data, "", frozenset(tags), "", False, None, out)
    return out


def _file_atoms(rel: str, data) -> list[Atom]:
    from .notebook import FUSED_KERNELS, chunk_profile, chunk_totals, prep_teams

    atoms = []
    for ptr, v, unit, tags, row in _leaves(rel, data):
        group = None
        if unit == "ms" and row is not None and _shape(row):
            key = ptr.rsplit("/", 1)[-1]
            direction = "bwd" if key.startswith("bwd") else "fwd"
            group = ("shape", _shape(row), direction)
        elif unit == "value":
            full = sorted(t for t in tags if t.startswith("region:") and ":" in t[7:])
            group = ("region", full[0]) if full else None
        atoms.append(Atom(f"{rel}#{ptr}", v, unit, frozenset(tags), group))
    rows = data.get("rows", []) if isinstance(data, dict) else []
    meta = data.get("meta") if isinstance(data, dict) else None
    file_tags = {"file:" + rel} | {"commit:" + c for c in _SHA.findall(str((meta or {}).get("commit", "")) + " " + rel)}
    sums: dict = {}
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            continue
        base = frozenset(file_tags | _row_tags(r))
        if "region" in r and isinstance(r.get("value"), (int, float)):
            bar = r["region"].split(":")[0]
            k = (r.get("stage"), _shape(r), bar)
            sums.setdefault(k, [0.0, base - {t for t in base if t.startswith("region:")}])[0] += r["value"]
            per = _per_chunk(r["region"], r.get("T"))
            if per:
                atoms.append(Atom(f"{rel}#/rows/{i}/value@chunk", r["value"] / per, "value", base | {"per:chunk"}))
        prof = r.get("profile")
        if isinstance(prof, dict) and set(r.get("kernels") or ()) == FUSED_KERNELS and isinstance(r.get("T"), int):
            for teams in (prep_teams(r.get("stage", "09")[:2]), 1):  # the stage's teams; one before 3758aa5
                try:
                    groups = chunk_profile(prof, r["T"], teams=teams)
                except ValueError:
                    continue
                for gname, vals in list(groups.items()) + [("total", chunk_totals(groups))]:
                    for name, val in vals.items():
                        atoms.append(Atom(f"{rel}#/rows/{i}/profile@chunk{teams}/{gname}/{name}", float(val), "value",
                                          base | {f"region:{name}", "per:chunk"}, None))
                break
    for (stage, shape, bar), (v, tags) in sums.items():
        atoms.append(Atom(f"{rel}#sum/{stage}/{'x'.join(map(str, shape or ()))}/{bar}", v, "value",
                          tags | {f"bar:{bar}"}, ("bar", bar)))
        per = _per_chunk(bar, shape[1] if shape else None)
        if per:
            atoms.append(Atom(f"{rel}#sum/{stage}/{'x'.join(map(str, shape))}/{bar}@chunk", v / per, "value",
                              tags | {f"bar:{bar}", "per:chunk"}))
    return atoms


def _per_chunk(region: str, T) -> int | None:
    """common.notebook.chunks_per_block for a recorded row: None also where the row names no T."""
    from .notebook import chunks_per_block

    return chunks_per_block(region, T) if isinstance(T, int) and T >= 1 else None


@lru_cache(maxsize=1)
def atoms() -> dict[str, Atom]:
    """Every recorded number of results/ (and the derived per-kernel sums and per-chunk profiles), by id."""
    out = {}
    for p in sorted(RESULTS_DIR.rglob("*.json")):
        rel = str(p.relative_to(REPO_ROOT))
        for a in _file_atoms(rel, json.loads(p.read_text())):
            out[a.id] = a
    return out


# ---------------------------------------------------------------------------
# entries: resolving and checking
# ---------------------------------------------------------------------------

TO_UNIT = {  # (figure unit, atom unit) -> factor from the atom's value to the figure's
    ("ms", "ms"): 1.0, ("s", "ms"): 1e-3, ("us", "ms"): 1e3, ("s", "s"): 1.0, ("ms", "s"): 1e3,
    ("MB", "MB"): 1.0, ("GB", "MB"): 1e-3, ("", "value"): 1.0,
    (DECIMAL, "ms"): 1.0, (DECIMAL, "s"): 1.0, (DECIMAL, "MB"): 1.0, (DECIMAL, "value"): 1.0,
}
BOUNDS = {"at_most": (max, True), "at_least": (min, False)}  # a claim that bounds a set of records
EXTREMES = {"max": max, "min": min}  # the end of a range ("11-21%"): the extreme of a set, rounded
PCT = {"share": lambda r: 100 * r, "change": lambda r: 100 * (r - 1), "saving": lambda r: 100 * (1 - r)}


def value_of(entry: dict, unit: str, table=None):
    """The value an entry gives for a figure printed in ``unit``; None for a figure
    that is not measured. KeyError names a missing atom."""
    table = table or atoms()
    if "not_measured" in entry:
        return None
    if "of" in entry:
        a = table[entry["of"]]
        f = TO_UNIT.get((unit, a.unit))
        if f is None:
            raise KeyError(f"{entry['of']} is in {a.unit}, the figure in {unit or 'no unit'}")
        return a.value * f
    if "ratio" in entry:
        a, b = (table[x].value for x in entry["ratio"])
        return a / b
    if "pct" in entry:
        a, b = (table[x].value for x in entry["pct"])
        return PCT[entry["op"]](a / b)
    for kind, (pick, _) in BOUNDS.items():
        if kind in entry:
            return pick(value_of(e, unit, table) for e in entry[kind])
    for kind, pick in EXTREMES.items():
        if kind in entry:
            return pick(value_of(e, unit, table) for e in entry[kind])
    if "fact" in entry:
        return fact(entry["fact"])
    raise KeyError(f"an entry is of, ratio, pct, at_most, at_least, min, max, fact or not_measured: {entry}")


def fact(name: str) -> float:
    """A number a stage declares in its stage.py ("12:FLA_TIME_TARGET"): an aim or a constant the prose
    quotes, read where it is defined. KeyError names what is missing."""
    from .stages import load_stage

    sid, _, attr = name.partition(":")
    value = getattr(load_stage(sid), attr, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KeyError(f"stage {sid}'s stage.py declares no number {attr}")
    return float(value)


def figure_problem(f, entry: dict, table=None) -> str | None:
    """Why a figure is not what its entry says (None: it is): its value does not round to the figure or,
    for a bound (at_most / at_least), the figure is not the tightest bound at its digits."""
    try:
        v = value_of(entry, f.unit, table)
    except KeyError as err:
        return str(err)
    if v is None:
        return None
    upper = next((up for kind, (_, up) in BOUNDS.items() if kind in entry), None)
    ok = matches(f.text, v) if upper is None else bounds(f.text, v, upper)
    if ok:
        return None
    how = "" if upper is None else (" as an upper bound (rounded up)" if upper else " as a lower bound (rounded down)")
    shown = {k2: entry[k2] for k2 in entry if k2 in ("of", "ratio", "pct", "op", "fact", *BOUNDS, *EXTREMES)}
    return f"the record says {v:.4g}{how} ({json.dumps(shown)[:300]})"


def key_str(key) -> str:
    doc, h, occ, i = key
    return f"{doc}|{h}|{occ}|{i}"


def load_index(path=INDEX) -> dict:
    """{key string: entry} of the figure index."""
    if not path.exists():
        return {}
    return {e["key"]: e for e in json.loads(path.read_text())["figures"]}


def check(figs=None, index=None, table=None) -> list[str]:
    """What is wrong between the prose and the index: a figure without an entry, an
    entry whose value does not round to the printed figure (or names a missing
    record), an entry that no figure uses. Empty: every figure is its record."""
    figs = all_figures() if figs is None else figs
    index = load_index() if index is None else index
    table = table or atoms()
    bad, used = [], set()
    for f in figs:
        k = key_str(f.key)
        e = index.get(k)
        where = f"{f.doc}:{f.lineno}: {f.text} {f.unit}".rstrip()
        if e is None:
            bad.append(f"{where}: no entry in docs/figures.json (run scripts/bind_figures.py) in: {f.line.strip()[:140]}")
            continue
        used.add(k)
        why = figure_problem(f, e, table)
        if why is not None:
            bad.append(f"{where}: {why} in: {f.line.strip()[:140]}")
    bad += [f"docs/figures.json: entry {k} ({e.get('at', '')!r}) is used by no figure" for k, e in index.items()
            if k not in used]
    return bad


# ---------------------------------------------------------------------------
# proposing entries (scripts/bind_figures.py)
# ---------------------------------------------------------------------------

_OUTPUTS = {"o": "o", "S": "S", "dq": "dq", "dk": "dk", "dv": "dv", "dg": "dg", "dbeta": "dbeta",
            "dA_log": "dA_log", "ddt_bias": "ddt_bias", "dh0": "dinitial_state", "dinitial_state": "dinitial_state"}
_TAG_RX = [
    (re.compile(r"\bstages? (\d{1,2})\b"), lambda m: ["stage:%02d" % int(m.group(1))]),
    (re.compile(r"(?<![\w.\-/])(0\d)(?![\w.\-/])"), lambda m: ["stage:" + m.group(1)]),
    (re.compile(r"\b(?:FlashKDA|FK)\b"), lambda m: ["stage:flashkda"]),
    (re.compile(r"\bFLA\b"), lambda m: ["stage:fla"]),
    (re.compile(r"\b([BTHKVD])\s*=?\s*(\d+)\b"),
     lambda m: [f"{'K' if m.group(1) == 'D' else m.group(1)}:{m.group(2)}"] + (
         [f"V:{m.group(2)}"] if m.group(1) == "D" else [])),
    (re.compile(r"\b(\d+) heads\b"), lambda m: [f"H:{m.group(1)}"]),
    (re.compile(r"\b(fused\d|split\d?|rule)\b"), lambda m: ["path:" + m.group(1)]),
    (re.compile(r"(?<![\w`])`?(" + "|".join(_OUTPUTS) + r")`?(?![\w(])"), lambda m: ["out:" + _OUTPUTS[m.group(1)]]),
    (re.compile(r"\b([0-9a-f]{7})\b"), lambda m: ["commit:" + m.group(1)] if re.search(r"[a-f]", m.group(1)) else []),
    (re.compile(r"\b(backward|bwd)\b"), lambda m: ["dir:bwd"]),
    (re.compile(r"\b(forward|fwd)\b"), lambda m: ["dir:fwd"]),
    (re.compile(r"\beager\b"), lambda m: ["kind:eager"]),
]


def text_tags(text: str, regions=()) -> set:
    tags = set()
    for rx, fn in _TAG_RX:
        for m in rx.finditer(text):
            tags.update(fn(m))
    tags.update("region:" + r for r in regions if r in text)
    return tags


def _category(tag: str) -> str:
    return tag.split(":", 1)[0]


def atom_tags(a: Atom) -> set:
    tags = {t for t in a.tags if _category(t) in ("stage", "B", "T", "H", "K", "V", "path", "commit", "region")}
    tags |= {"out:" + t[7:] for t in a.tags if t.startswith("output:")}
    key = next((t[4:] for t in a.tags if t.startswith("key:")), "")
    tags.add("dir:" + ("bwd" if key.startswith("bwd") else "fwd"))
    if key.endswith("_ms") and "graph" not in key and key.startswith(("fwd", "bwd")):
        tags.add("kind:eager")
    return tags


PRIMARY = ("results/h200/tc_stages.json", "results/h200/fp32_stages.json", "results/h200/checks.json",
           "results/h200/profiles.json", "results/cpu/")


def context(doc_lines: list[str], fig: Figure, default_stage: str | None, regions=()) -> dict:
    """{tag: weight} of what the figure's surroundings name: its table cell, column header and row label
    (3, 2, 2) or its sentence (3), its line (1), the section heading above it (1), the document's stage (1)."""
    weights: dict = {}

    def add(text, w):
        for t in text_tags(text, regions):
            weights[t] = max(weights.get(t, 0), w)

    line = fig.line
    i = fig.lineno - 1
    if line.lstrip().startswith("|"):
        cells, pos, at = line.split("|"), 0, 0
        for ci, c in enumerate(cells):
            if at <= fig.start < at + len(c) + 1:
                pos = ci
                break
            at += len(c) + 1
        top = i
        while top > 0 and doc_lines[top - 1].lstrip().startswith("|"):
            top -= 1
        head = doc_lines[top].split("|")
        add(cells[pos] if pos < len(cells) else "", 3)
        add(head[pos] if pos < len(head) else "", 2)
        add(cells[1] if len(cells) > 1 else "", 2)
    else:
        a = max(line.rfind(". ", 0, fig.start), line.rfind("; ", 0, fig.start))
        b = min([x for x in (line.find(". ", fig.end), line.find("; ", fig.end)) if x >= 0] or [len(line)])
        add(line[a + 1:b], 3)
    add(line, 1)
    lo, hi = passage(doc_lines, i)  # the commit that its cell or paragraph names
    for t in text_tags("\n".join(doc_lines[lo:hi + 1])):
        if t.startswith("commit:"):
            weights[t] = max(weights.get(t, 0), 2)
    for j in range(i, -1, -1):
        if doc_lines[j].startswith("#"):
            add(doc_lines[j], 1)
            break
    if default_stage:
        weights.setdefault("stage:" + default_stage, 1)
    return weights


def score(tags: set, ctx: dict) -> float:
    """Matches of an atom's tags in the context, minus the categories the context names with other values."""
    s = 0.0
    for cat in {_category(t) for t in ctx}:
        want = {t: w for t, w in ctx.items() if _category(t) == cat}
        have = {t for t in tags if _category(t) == cat}
        hit = [w for t, w in want.items() if t in have]
        if hit:
            s += max(hit)
        elif have and cat not in ("region", "kind"):
            s -= 0.5 * max(want.values())
    return s


def _prior(a: Atom) -> float:
    """A little for the ladder's own records, a little less for an eager time (prose quotes GPU time)."""
    eager = any(t in a.tags for t in ("key:fwd_ms", "key:bwd_ms"))
    return 0.1 * a.id.startswith(PRIMARY) - 0.05 * eager


class Binder:
    """Proposes an entry for a figure: among the records whose value rounds to it, the one whose
    tags its context names best (a ratio or percentage: the best pair of one group)."""

    def __init__(self, table=None):
        self.table = table or atoms()
        self.by_unit: dict = {}
        for a in self.table.values():
            self.by_unit.setdefault(a.unit, []).append(a)
        # where a ratio's two records are looked for, in order (the first that has a match is taken):
        # one file and one quantity (two rows of one measurement), one file, then any file
        self.tiers = []
        for kinds in (("shape",), ("region", "bar")):  # times first: most ratios are speed-ups
            for part in (lambda a: (a.group, a.id.split("#")[0], _key(a)), lambda a: (a.group, a.id.split("#")[0]),
                         lambda a: a.group):
                tier: dict = {}
                for a in self.table.values():
                    if a.group is not None and a.group[0] in kinds:
                        tier.setdefault(part(a), []).append(a)
                for k, g in tier.items():
                    g.sort(key=lambda a: a.value)
                    tier[k] = (g, [a.value for a in g])
                self.tiers.append(tier)
        self.tags = {a.id: atom_tags(a) for a in self.table.values()}
        self.regions = sorted({t[7:] for a in self.table.values() for t in a.tags
                               if t.startswith("region:") and len(t) > 11})
        self.shares: dict = {}  # sum atom id -> the region atoms it adds up
        for a in self.table.values():
            if "#sum/" in a.id:
                self.shares[a.id] = []
        rows = {}
        for a in self.table.values():
            if a.id.endswith("/value") and a.group and a.group[0] == "region":
                rows.setdefault(a.id.split("#")[0], []).append(a)
        for sid in self.shares:
            file, rest = sid.split("#sum/")
            stage, shape, bar = rest.split("/", 2)
            for a in rows.get(file, []):
                if f"stage:{stage}" in a.tags and a.group[1].startswith(f"region:{bar}:"):
                    if shape == "x".join(str(x) for x in _tag_shape(a.tags)):
                        self.shares[sid].append(a)

    def candidates(self, fig: Figure, near=()):
        """(entry, atoms) whose value rounds to the figure. A ratio or percentage is first looked for
        among ``near``, the records of the figures beside it (its line's "0.58 against 0.82 ms")."""
        x = fig.number
        if fig.kind in ("time", "memory", "value", "decimal", "cycles"):
            for (fu, au), f in TO_UNIT.items():
                if fu != fig.unit:
                    continue
                for a in self.by_unit.get(au, ()):
                    if matches(fig.text, a.value * f):
                        yield {"of": a.id}, (a,)
            return
        if near:
            found = list(self._pairs(fig, {"near": (sorted(near, key=lambda a: a.value),
                                                    sorted(a.value for a in near))}))
            if found:
                yield from (({**e, "from": "the figures beside it"}, ats) for e, ats in found)
                return
        for tier in self.tiers:
            found = list(self._pairs(fig, tier))
            if found:
                yield from found
                return

    def _pairs(self, fig: Figure, tier: dict):
        """Pairs (a, b) of one partition of ``tier`` whose ratio (or percentage) rounds to the figure."""
        x, n = fig.number, sig_digits(fig.text)
        half = 0.5 * 10 ** (math.floor(math.log10(x)) - n + 1) if x > 0 else 0.5
        lo, hi = x - half, x + half
        ops = [("ratio", None, lambda r: r)] if fig.kind == "ratio" else [("pct", op, fn) for op, fn in PCT.items()]
        for g, vals in tier.values():
            for b in g:
                if b.value <= 0:
                    continue
                for name, op, fn in ops:
                    ends = sorted(self._inverse(fn, lo, hi, b.value))
                    for a in g[bisect_left(vals, ends[0]):bisect_right(vals, ends[1])]:
                        if a is not b and matches(fig.text, fn(a.value / b.value)):
                            yield ({"ratio": [a.id, b.id]} if op is None else {"pct": [a.id, b.id], "op": op}), (a, b)
        if fig.kind == "percent" and self.tiers and tier is self.tiers[0]:
            for sid, parts in self.shares.items():
                s = self.table[sid]
                for a in parts:
                    if s.value > 0 and matches(fig.text, 100 * a.value / s.value):
                        yield {"pct": [a.id, sid], "op": "share"}, (a, s)

    @staticmethod
    def _inverse(fn, lo, hi, b):
        """The values of a for which fn(a / b) lies in [lo, hi] (fn linear: r, 100 r, 100 (r - 1), 100 (1 - r))."""
        f0, f1 = fn(0.0), fn(1.0)
        slope = f1 - f0
        return ((lo - f0) / slope * b, (hi - f0) / slope * b)

    def propose(self, fig: Figure, ctx: dict, near=()):
        """(entry, score, number of candidates at the best score, number of candidates) or None."""
        best, top, n = None, [], 0
        cands = list(self.candidates(fig, near))
        named = {t for t, w in ctx.items() if t.startswith("commit:") and w >= 2}
        if len(named) == 1:  # a passage that names one commit quotes that commit's records, where it can
            own = [(e, ats) for e, ats in cands if all(named <= a.tags for a in ats)]
            cands = own or cands
        for entry, ats in cands:
            n += 1
            s = sum(score(self.tags[a.id], ctx) + _prior(a) for a in ats) / len(ats)
            if best is None or s > best + 1e-9:
                best, top = s, [entry]
            elif abs(s - best) <= 1e-9:
                top.append(entry)
        if best is None:
            return None
        top.sort(key=json.dumps)
        return top[0], best, len(top), n


def _key(a: Atom) -> str:
    """The quantity of an atom: its JSON key, with the stage prefix of an anchor's keys dropped, so that a
    stage's fwd_graph_ms and FlashKDA's flashkda_ms of one call are one quantity ("ms")."""
    if a.id.split("#")[-1].startswith("sum/") or "/profile" in a.id:
        return "cycles"
    key = next((t[4:] for t in a.tags if t.startswith("key:")), "")
    graph = key.endswith("_graph_ms")
    anchor = key in ("fla_ms", "flashkda_ms", "fla_safe_graph_ms", "flashkda_graph_ms")
    return "ms" if graph or anchor else key


def _tag_shape(tags) -> tuple:
    d = {t.split(":")[0]: t.split(":")[1] for t in tags if t.split(":")[0] in ("B", "T", "H", "K")}
    return tuple(d.get(k) for k in ("B", "T", "H", "K")) if d else ()
