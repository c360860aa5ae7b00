"""The glossary explains every term the chapters use: a technical term of the lab's vocabulary that a chapter
(a stage README, a notebook's prose, the GUIDE) uses must be named in bold by an entry of docs/GLOSSARY.md."""

import json
import re

import pytest

from common.paths import REPO_ROOT

GLOSSARY = (REPO_ROOT / "docs" / "GLOSSARY.md").read_text()

# term as the glossary names it -> how a chapter writes it (a regular expression; case-insensitive but for
# CASE_SENSITIVE, whose capitals are the term)
VOCABULARY = {
    "hybrid": r"\bhybrid\b", "long_from": r"\blong_from\b", "FULL/EMPTY": r"\bFULL\b|\bEMPTY\b",
    "ring depth": r"\bring\b", "Af": r"\bAf\b", "u_halves": r"\bu_halves\b|\bu in (two )?halves\b",
    "width rule": r"\bwidth rule\b|\bsplit width\b", "racecheck": r"\bracecheck\b", "memcheck": r"\bmemcheck\b",
    "synccheck": r"\bsynccheck\b", "compute-sanitizer": r"\bcompute-sanitizer\b", "SASS": r"\bSASS\b",
    "ncu": r"\bncu\b|Nsight Compute", "graph replay": r"\bgraph replay\b", "bitwise": r"\bbitwise\b",
    "shuffle": r"\bshuffles?\b", "instantiation": r"\binstantiations?\b", "spill": r"\bspill(s|ed)?\b",
    "mbarrier": r"\bmbarriers?\b", "cp.async": r"\bcp\.async\b", "movmatrix": r"\bmovmatrix\b",
    "ldmatrix": r"\bldmatrix\b", "MUFU": r"\bMUFU\b", "setmaxnreg": r"\bsetmaxnreg\b",
    "warp specialisation": r"\bwarp[- ]speciali[sz]", "segments": r"\bsegments?\b", "prepare teams": r"\bprepare teams?\b",
    "WY": r"\bWY\b", "vcorr": r"\bvcorr\b", "poisoned": r"\bpoison(ed)?\b", "ablation": r"\bablations?\b",
    "anchor": r"\banchors?\b", "peak memory": r"\bpeak memory\b", "tail": r"\btails?\b",
    "wide chunk": r"\bwide chunks?\b", "reference point": r"\breference point\b", "cu_seqlens": r"\bcu_seqlens\b",
    "V-first": r"\bV-first\b", "unsteady": r"\bunsteady\b", "fused": r"\bfused (kernel|path)\b",
    "tensor cores": r"\btensor cores?\b", "fragments": r"\bfragments?\b", "named barrier": r"\bnamed barriers?\b",
}


CASE_SENSITIVE = {"FULL/EMPTY", "Af", "SASS", "WY", "MUFU", "V-first"}


def _chapters() -> dict:
    """{file: its prose}: the stage READMEs, the notebooks' markdown cells, the GUIDE and the README."""
    out = {p: p.read_text() for p in sorted((REPO_ROOT / "stages").glob("*/README.md"))}
    for p in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        out[p] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    for p in (REPO_ROOT / "docs" / "GUIDE.md", REPO_ROOT / "README.md"):
        out[p] = p.read_text()
    return out


def _named(term: str, glossary: str) -> bool:
    """The glossary names ``term`` in bold (an entry's name, or a bold word inside one)."""
    return any(term.lower() in b.lower() for b in re.findall(r"\*\*(.+?)\*\*", glossary))


def missing(glossary: str = GLOSSARY) -> dict:
    """{term: the first chapter that uses it} for the vocabulary's terms the glossary does not name."""
    out = {}
    chapters = _chapters()
    for term, pattern in VOCABULARY.items():
        if _named(term, glossary):
            continue
        flags = 0 if term in CASE_SENSITIVE else re.I
        for path, text in chapters.items():
            if re.search(pattern, text, flags):
                out[term] = str(path.relative_to(REPO_ROOT))
                break
    return out


def test_every_term_a_chapter_uses_is_in_the_glossary():
    gaps = missing()
    assert not gaps, "terms the chapters use that docs/GLOSSARY.md does not explain: " + \
        ", ".join(f"{t} ({p})" for t, p in gaps.items())


@pytest.mark.parametrize("term", ["hybrid", "racecheck", "Af"])
def test_a_term_dropped_from_the_glossary_is_found(term):
    """The check can fail: with a term's bold name removed from the glossary, a chapter's use of it shows."""
    spoiled = re.sub(r"\*\*([^*]*?)\*\*", lambda m: m.group(1) if term.lower() in m.group(1).lower() else m.group(0),
                     GLOSSARY)
    assert term in missing(spoiled)
