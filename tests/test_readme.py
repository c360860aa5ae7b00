"""The front page stays a front page; the full results are generated into docs/RESULTS.md and must be current."""

import re

from common.paths import REPO_ROOT
from common.report import readme_block

README = (REPO_ROOT / "README.md").read_text()
RESULTS = (REPO_ROOT / "docs" / "RESULTS.md").read_text()


def test_results_block_is_current():
    assert readme_block() in RESULTS, "docs/RESULTS.md is stale: run `kdalab results --write-readme`"


def test_readme_is_a_front_page():
    """At most 1,200 words as `wc -w` counts them; the ladder is one table with a row per stage."""
    assert len(README.split()) <= 1200, len(README.split())
    from common.stages import STAGE_DIRS

    for sid, d in STAGE_DIRS.items():
        assert re.search(rf"^\| \[{sid}\]\(stages/{d}\) \|", README, re.M), f"no ladder row for stage {sid}"
    for row in re.findall(r"^\| \[\d\d\]\(stages/\w+\) \| ([^|]+) \|", README, re.M):
        assert len(row.split()) <= 12, f"a ladder idea of more than 12 words: {row}"


def test_readme_names_the_commands_and_the_documents():
    for cmd in ("pip install -e '.[dev]'", "pytest", "kdalab tour", "kdalab check 01"):
        assert cmd in README
    for doc in ("docs/GLOSSARY.md", "docs/RESULTS.md", "docs/GUIDE.md", "docs/DESIGN.md", "docs/PERF_NOTES.md",
                "notebooks/00_naive.ipynb"):
        assert f"]({doc})" in README, doc
        assert (REPO_ROOT / doc).exists(), doc


def test_the_recorded_figures_are_shown():
    from common.report import README_FIGURES

    assert "](docs/ladder.png)" in README
    for path in README_FIGURES.values():
        assert f"]({path.removeprefix('docs/')})" in RESULTS, f"docs/RESULTS.md does not show {path}"
        assert (REPO_ROOT / path).exists(), f"{path} missing: run `kdalab results --write-readme`"


def test_stage_readmes_measured_blocks_are_current():
    from common.report import MEASURED_START, stage_readme_block
    from common.stages import STAGE_DIRS

    for name in STAGE_DIRS.values():
        text = (REPO_ROOT / "stages" / name / "README.md").read_text()
        assert MEASURED_START in text, f"{name}/README.md has no generated measured block"
        assert stage_readme_block(name) in text, f"{name}/README.md is stale: run `kdalab results --write-readme`"
