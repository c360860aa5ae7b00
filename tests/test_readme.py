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


# Stages with paths whose paths table is not yet recorded (no results/h200/stageNN/paths_*.json): their README has
# no paths table yet. A stage leaves this set with its first recorded paths file (the test below holds that).
PATHS_PENDING: set = {"12"}  # 12_softplus: its paths are stage 11's; recorded with its first H200 call


def test_the_paths_tables_peak_columns_are_their_paths():
    """In the stages with paths, "peak MB split" is the split path's peak and "peak MB rule" the rule's (the
    split column once held the rule's: 21 MB where the split path needs 109 at B1 T1024 H64)."""
    import json

    from common.stages import STAGE_DIRS, path_stages

    assert PATHS_PENDING <= set(path_stages()), "a PATHS_PENDING stage without paths: drop it from PATHS_PENDING"
    for sid in sorted(PATHS_PENDING):
        assert not list((REPO_ROOT / "results" / "h200" / f"stage{sid}").glob("paths_*.json")), \
            f"stage {sid} has a recorded paths file: drop it from PATHS_PENDING"
    for sid in path_stages():
        if sid in PATHS_PENDING:
            continue  # not yet measured (checked just above)
        text = (REPO_ROOT / "stages" / STAGE_DIRS[sid] / "README.md").read_text()
        lines = [line for line in text.splitlines() if line.startswith("| ") and "peak MB split" in line]
        assert len(lines) == 1, sid
        head = [c.strip() for c in lines[0].strip("|").split("|")]
        body = text.splitlines()[text.splitlines().index(lines[0]) + 2:]
        rec = sorted((REPO_ROOT / "results" / "h200" / f"stage{sid}").glob("paths_*.json"))
        rows = [r for p in rec for r in json.loads(p.read_text())["rows"]]
        checked = 0
        for line in body:
            if not line.startswith("| B"):
                break
            cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|"))))
            split = {r["peak_mb"] for r in rows if r.get("stage", "").startswith(sid) and r["path"] == "split1"
                     and "B%d T%d H%d K%d V%d" % (r["B"], r["T"], r["H"], r["K"], r["V"]) == cells["shape"]}
            if split and cells["peak MB split"] != "-":
                assert any(f"{v:.3g}" == cells["peak MB split"] for v in split), (sid, cells)
                checked += 1
        assert checked >= 4, sid
