"""Every measured figure in prose is checked against the results files.

The README (outside its generated block), the stage READMEs, docs/PERF_NOTES.md
and the notebooks' markdown cells quote latencies, errors, cycle counts and
speed-ups. Each such number with two or more significant digits must be what
some recorded value rounds to:

- "N ms" / "N s" and "N us" (and "N against M ms"): a latency of results/ (ms, or in seconds);
- "N.Ne-M" and "N.NeM": an error, a cycle count, or a sum of a profile's
  regions per kernel (the "K2 compute timeline"), or the fused kernel's
  timeline per chunk (common.notebook.chunk_profile: each region and the
  totals of the prepare warps, the compute warps, their wait and the chain);
- "N.Nx" and ranges "N-Mx": a ratio of two recorded latencies at the same shape;
- "N MB" and "N against M MB": a recorded peak memory (a field ending in "_mb").

A number that does not come from a results file (a constant of the method, a
figure of the seed's H20, a derived estimate) is listed in ALLOWED with the
reason. One-digit figures ("about 4e-3") are approximate by their own words and
are not checked.
"""

from __future__ import annotations

import json
import math
import re
from itertools import combinations

import pytest

from common.notebook import FUSED_KERNELS, FUSED_PREP_TEAMS, chunk_profile, chunk_totals
from common.paths import REPO_ROOT, RESULTS_DIR
from common.report import README_END, README_START

# file (relative to the repository) -> {quoted text: why it is not from results/}
ALLOWED = {
    "README.md": {"330 s that lease": "the time limit of a run that did not finish (results/h200/notebooks.json, note)"},
    "docs/PERF_NOTES.md": {
        "0.02 ms": "the byte count at the measured copy rate (a derived estimate)",
        "0.06-0.13 ms": "an estimate of the chain's floor (1-2 us per chunk step x 64 chunks)",
        "0.69 GB": "the byte count of K1's workspace", "0.54 GB": "the byte count of the inputs",
        "0.13 GB": "the byte count of o", "16.8 MB": "the byte count of one bf16 input",
        "1.8e3 per": "the compute timeline divided by its 128 chunks",
        "cycles per chunk": "a region's clock64 cycles (results/h200/stage08/) divided by the block's 64 chunks",
        "3-5e3 cycles": "the prediction before stage 08 was built",
    },
    "stages/07_movm_register/README.md": {"1.8e3 per": "the compute timeline divided by its 128 chunks"},
    "stages/05_cute_bf16/README.md": {"5.5e34": "e^80, a constant", "3.4e38": "the largest bf16 value"},
}


def _docs():
    out = []
    readme = (REPO_ROOT / "README.md").read_text()
    a, b = readme.index(README_START), readme.index(README_END)
    out.append(("README.md", readme[:a] + readme[b:]))
    for p in sorted((REPO_ROOT / "stages").glob("*/README.md")):
        out.append((str(p.relative_to(REPO_ROOT)), p.read_text()))
    out.append(("docs/PERF_NOTES.md", (REPO_ROOT / "docs" / "PERF_NOTES.md").read_text()))
    for p in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(p.read_text())
        text = "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        out.append((str(p.relative_to(REPO_ROOT)), text))
    return out


def _walk(obj, key=""):
    """(key, number) pairs of a JSON document, the key of the nearest dict."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        if math.isfinite(obj):
            yield key, float(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, k)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v, key)


def _pools(commit=None):
    """(latencies in ms, errors and cycle counts, latencies by shape, peak memories in MB) of every results file
    (``commit``: only the files recorded at that commit, by their metadata)."""
    ms, values, by_shape, mb = set(), set(), {}, set()
    anchors = sorted((RESULTS_DIR / "anchors").glob("*.json"))
    for p in RESULTS_DIR.rglob("*.json"):
        if p in anchors[:-1]:  # the newest anchor is the reference; older ones are history
            continue
        data = json.loads(p.read_text())
        if commit is not None and commit not in str((data.get("meta") or {}).get("commit", "") if isinstance(data, dict) else ""):
            continue
        for k, v in _walk(data):
            if k.endswith("_ms") and "min" not in k:
                ms.add(v)
            elif k == "seconds":  # wall times of notebooks and the tour
                ms.add(v * 1e3)
            elif k.endswith("_mb"):  # peak memory of a call
                mb.add(v)
            elif "err" in k or k in ("o", "S", "value"):
                values.add(v)
        rows = data.get("rows", []) if isinstance(data, dict) else []
        sums = {}
        for r in rows:
            if "region" in r and "value" in r:  # a profile row: also the sum per stage and kernel (one bar)
                key = (r["stage"], r["region"].split(":")[0])
                sums[key] = sums.get(key, 0.0) + r["value"]
            if "B" in r and "T" in r:  # a latency row: its best forward and backward time, for ratios
                shape = (r["B"], r["T"], r["H"], r.get("K", r.get("D")))
                for y in ("fwd", "bwd"):
                    g, e = r.get(f"{y}_graph_ms"), r.get(f"{y}_ms")
                    if (g or e) is not None:
                        by_shape.setdefault((shape, y), set()).add(float(g if g is not None else e))
                for k in ("fla_ms", "flashkda_ms", "fla_safe_graph_ms", "flashkda_graph_ms"):  # anchors
                    if isinstance(r.get(k), (int, float)):
                        by_shape.setdefault((shape, "fwd"), set()).add(float(r[k]))
            if isinstance(r.get("profile"), dict):  # an ablation row: its region profile, cycles per block
                values.update(float(v) for v in r["profile"].values() if v)
                if set(r.get("kernels") or ()) == FUSED_KERNELS:  # a fused-kernel row: its timeline per chunk too
                    groups = None
                    for teams in (FUSED_PREP_TEAMS, 1):  # two prepare teams since 3758aa5, one before
                        try:
                            groups = chunk_profile(r["profile"], r["T"], teams=teams)
                            break
                        except ValueError:  # another team count, or an early profile without the producer's regions
                            pass
                    if groups is not None:
                        values.update(v for g in groups.values() for v in g.values())
                        values.update(chunk_totals(groups).values())
            if "region" in r and "value" in r:  # the same region in two stages: a ratio the profile prose may quote
                by_shape.setdefault(("region", r["region"]), set()).add(float(r["value"]))
        values.update(sums.values())
        for (stage, bar), v in sums.items():
            by_shape.setdefault(("bar", bar), set()).add(v)
    return ms, values, by_shape, mb


MS, VALUES, BY_SHAPE, MB = _pools()
MS_POOL = MS | {v / 1e3 for v in MS}
RATIOS = {a / b for vals in BY_SHAPE.values() for x, y in combinations(sorted(vals), 2) for a, b in ((x, y), (y, x))}


def _sig(text: str) -> int:
    """Significant digits as printed ("100" and "20" have one, "0.0728" three)."""
    t = text.replace(",", "")
    digits = t.replace(".", "").lstrip("0")
    return len(digits if "." in t else digits.rstrip("0"))


def _matches(text: str, pool) -> bool:
    x = float(text.replace(",", ""))
    n = _sig(text.split("e")[0])
    for v in pool:
        if v == 0:
            continue
        if float(f"{v:.{n}g}") == x or float(f"{x:.{n}g}") == float(f"{v:.{n}g}"):
            return True
    return False


NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
PATTERNS = [  # (regex, pool, kind)
    (re.compile(rf"(?<![\w.^])({NUM})(?:\s*(?:-|–|to|against)\s*({NUM}))?\s*(ms|s|us|µs)\b"), "time"),
    (re.compile(r"(?<![\w.^])(\d+\.\d+e[+-]?\d+)(?:\s*(?:-|–|/)\s*(\d+\.\d+e[+-]?\d+))?"), "value"),
    (re.compile(rf"(?<![\w.^])({NUM})(?:\s*(?:-|–)\s*({NUM}))?\s*x\b(?!\s*\d)"), "ratio"),
    (re.compile(rf"(?<![\w.^])({NUM})(?:\s*(?:-|–|to|against)\s*({NUM}))?\s*MB\b"), "memory"),
]


def _claims():
    for path, text in _docs():
        for lineno, line in enumerate(text.splitlines(), 1):
            for rx, kind in PATTERNS:
                for m in rx.finditer(line):
                    for g in (m.group(1), m.group(2)):
                        if g is None or _sig(g.split("e")[0]) < 2:
                            continue
                        yield path, lineno, line, m.group(0), g, kind


def _ok(path, line, quoted, number, kind) -> bool:
    if any(a in line for a in ALLOWED.get(path, {})) or "H20" in line:  # allowed, or the seed's H20 figures
        return True
    if kind == "ratio" and re.search(r"predict|expect|should|at least|>=", line):  # a prediction, not a result
        return True
    pool = {"time": MS_POOL, "value": VALUES, "ratio": RATIOS, "memory": MB}[kind]
    return _matches(number, pool)


def test_every_measured_figure_in_prose_is_in_the_results():
    bad = [f"{path}:{lineno}: {number} ({kind}) in: {line.strip()[:160]}"
           for path, lineno, line, quoted, number, kind in _claims()
           if not _ok(path, line, quoted, number, kind)]
    assert not bad, "figures in prose that no results file backs:\n" + "\n".join(bad)


def test_the_prose_check_catches_a_stale_figure():
    assert _matches("0.567", MS_POOL) and _matches("12.3", MS_POOL)  # stage 05's graph time, stage 02's 12.3 s
    # a figure no file holds (stage 05's old eager figure, 0.82 ms, is now close to a recorded path time: 0.8169)
    assert not _matches("0.8213", MS_POOL)
    assert not _matches("0.123456", MS_POOL)
    assert _matches("872", MB) and _matches("168", MB)  # stage 08's split and fused paths at B=8 (peak_mb)
    assert not _matches("871", MB)
    assert _matches("1.08e4", VALUES) and _matches("2.69e3", VALUES)  # the fused kernel per chunk: prepare, chain
    assert not _matches("7.77e3", VALUES)  # (2.5e3 is a recorded per-chunk figure now)


@pytest.mark.parametrize("doc", [d for d, _ in _docs()])
def test_documents_are_found(doc):
    assert (REPO_ROOT / doc).exists()


SHA = re.compile(r"\bcommit ([0-9a-f]{7})\b")


def _stale_in_notebook_cells(pools_of):
    """Figures of a notebook markdown cell that names one commit ("Recorded ... commit abc1234") and that no
    results file recorded at that commit backs: such a cell describes that record, not any record."""
    bad = []
    for p in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        for i, c in enumerate(json.loads(p.read_text())["cells"]):
            text = "".join(c["source"])
            shas = set(SHA.findall(text))
            if c["cell_type"] != "markdown" or len(shas) != 1:
                continue
            ms, values, by_shape, mb = pools_of(shas.pop())
            ratios = {a / b for vals in by_shape.values() for x, y in combinations(sorted(vals), 2)
                      for a, b in ((x, y), (y, x))}
            pool = {"time": ms | {v / 1e3 for v in ms}, "value": values, "ratio": ratios, "memory": mb}
            for line in text.splitlines():
                for rx, kind in PATTERNS:
                    for m in rx.finditer(line):
                        for g in (m.group(1), m.group(2)):
                            if g is not None and _sig(g.split("e")[0]) >= 2 and not _matches(g, pool[kind]):
                                bad.append(f"{p.name} cell {i}: {g} ({kind}) in: {line.strip()[:120]}")
    return bad


def test_a_notebook_cell_naming_a_commit_quotes_that_record():
    bad = _stale_in_notebook_cells(_pools)
    assert not bad, "figures that the record of the named commit does not hold:\n" + "\n".join(bad)


def test_the_commit_check_catches_figures_of_another_record():
    """Planted: the cells read against the record before (43a6112, the kernel of stage 09 before the split path ran
    in segments) must fail, since they quote d91b051's."""
    assert _stale_in_notebook_cells(lambda sha: _pools("43a6112" if sha == "d91b051" else sha))
