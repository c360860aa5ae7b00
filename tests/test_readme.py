"""The README's results table is generated from results/ and must be current."""

from common.paths import REPO_ROOT
from common.report import readme_block


def test_readme_results_block_is_current():
    text = (REPO_ROOT / "README.md").read_text()
    assert readme_block() in text, "README results are stale: run `kdalab results --write-readme`"


def test_readme_names_the_commands():
    text = (REPO_ROOT / "README.md").read_text()
    for cmd in ("pip install -e '.[dev]'", "pytest", "kdalab tour", "kdalab check 01"):
        assert cmd in text


def test_readme_shows_the_recorded_figures():
    from common.report import README_FIGURES

    text = (REPO_ROOT / "README.md").read_text()
    for path in README_FIGURES.values():
        assert path in text, f"README does not show {path}"
        assert (REPO_ROOT / path).exists(), f"{path} missing: run `kdalab results --write-readme`"


def test_stage_readmes_measured_blocks_are_current():
    from common.report import MEASURED_START, stage_readme_block
    from common.stages import STAGE_DIRS

    for name in STAGE_DIRS.values():
        text = (REPO_ROOT / "stages" / name / "README.md").read_text()
        assert MEASURED_START in text, f"{name}/README.md has no generated measured block"
        assert stage_readme_block(name) in text, f"{name}/README.md is stale: run `kdalab results --write-readme`"
