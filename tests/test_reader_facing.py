"""What a reader sees is the tutorial, not the lab's log: no working sessions, device budgets, leases or call logs
in the READMEs, docs/ or the notebooks' prose (the history is in git), and each record's provenance in one short
line (common.results.label: device, day, commit; the command stays in the record)."""

import json
import re

from common import results
from common.paths import REPO_ROOT

LAB_LOG = re.compile(r"\bsessions?\b|\bdevice budget\b|\bbudget of the device\b|\blease\b|\bgpu_run_s\d+call|"
                     r"\bcall logs?\b|\bdevice copy\b|\.scratch/", re.I)


def reader_facing() -> dict:
    """{file: its text}: README.md, docs/*.md, the stage READMEs, the notebooks' markdown cells and printed outputs."""
    out = {p: p.read_text() for p in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
                                      *sorted((REPO_ROOT / "stages").glob("*/README.md"))]}
    for p in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        prose = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
        shown = ["".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                 for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])]  # what its cells print
        out[p] = "\n".join(prose + shown)
    return out


def lab_log_lines(texts: dict) -> list[str]:
    return [f"{p.relative_to(REPO_ROOT)}:{i}: {line.strip()[:120]}" for p, text in texts.items()
            for i, line in enumerate(text.splitlines(), 1) if LAB_LOG.search(line)]


def test_no_lab_log_in_what_a_reader_sees():
    bad = lab_log_lines(reader_facing())
    assert not bad, "working sessions, budgets or call logs in reader-facing prose (the history is git's):\n" + \
        "\n".join(bad)


def test_the_check_finds_a_lab_log_line():
    planted = {REPO_ROOT / "README.md": "One line.\nMeasured in session 16 (`gpu_run_s16call3.txt`), cut by the "
                                        "device budget.\n"}
    assert len(lab_log_lines(planted)) == 1


def test_provenance_is_one_short_line():
    """A record's label names the device, the day(s), the commit(s) and its file, not the command or its notes."""
    for name in ("tc_stages", "fp32_stages", "checks"):
        meta = results.recorded(name)["meta"]
        line = results.label(meta)
        assert len(line) <= 160 and meta["device"] in line and "command" not in line, line
        assert all(c[:7] in line for c in re.findall(r"\b[0-9a-f]{7,12}\b", meta["commit"])), line
