"""What a reader of the notebooks sees.

- The committed notebooks carry their outputs (executed on the CPU machine:
  live figures for 00-01, recorded H200 figures for the rest), and every cell
  that draws shows an image, so a reader browsing the repository sees them.
- When pytest executes the notebooks (nbval), the plugin common.nbcheck fails
  any cell that draws without an image; the last test here shows that it does.
"""

import json
import subprocess
import sys

import pytest

from common.nbcheck import draws, errors, figure_problem, missing_figures
from common.paths import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
# Stages without a notebook yet (added since the last GPU run: a notebook shows recorded H200 figures, and
# there are none yet). A stage leaves this set with its notebook (the test below holds that).
PENDING: set = set()  # none: 12_softplus got its notebook with its first H200 records


def _load(path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_executed_without_errors(path):
    assert errors(_load(path)) == [], f"run `python scripts/run_notebooks.py --write {path.name}`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_shows_every_figure(path):
    nb = _load(path)
    assert any(draws("".join(c["source"])) for c in nb["cells"] if c["cell_type"] == "code"), "draws nothing"
    assert missing_figures(nb) == []


def test_every_stage_has_a_notebook():
    from common.stages import STAGE_DIRS, stage_ids

    names = {p.stem for p in NOTEBOOKS}
    assert [STAGE_DIRS[s] for s in stage_ids() if STAGE_DIRS[s] not in names] == sorted(PENDING)
    assert "summary" in names


def test_the_figure_check_itself():
    png = [{"output_type": "display_data", "data": {"image/png": "iVBOR...", "text/plain": "<Figure>"}}]
    text = [{"output_type": "stream", "name": "stdout", "text": "recorded on ..."}]
    assert figure_problem('nb.profile("02");', text) is not None
    assert figure_problem('nb.profile("02");', png) is None
    assert figure_problem("ax, table = nb.tc_latency(['05'])\ntable", text) is not None
    assert figure_problem("plot_fragments();", []) is not None
    assert figure_problem("nb.error_table('02')", text) is None  # draws nothing
    assert figure_problem("# nb.profile('02') is not called here\nx = 1", []) is None
    broken = {"cells": [{"cell_type": "code", "source": ["nb.latency(['00']);"], "outputs": text,
                         "execution_count": 1}]}
    assert missing_figures(broken) == ["cell 0: cell `nb.latency(['00']);` draws a figure but shows no image"]


def _notebook(tmp_path, first_cell):
    cells = [first_cell, "from common import notebook as nb\nnb.profile('00', backward=False);"]
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": c}
                    for c in cells],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "figure.ipynb"
    path.write_text(json.dumps(nb))
    return path


@pytest.mark.parametrize("backend,fails", [("%matplotlib inline", False), ("import matplotlib\nmatplotlib.use('Agg')", True)],
                         ids=["inline", "agg"])
def test_nbval_run_fails_a_figure_that_does_not_render(tmp_path, backend, fails):
    """The same notebook under nbval with the plugin: passes with the inline
    backend, fails when the figures are drawn into nothing (Agg)."""
    path = _notebook(tmp_path, backend)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          "--nbval-lax", "--nbval-current-env", "-p", "common.nbcheck", str(path)],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    if fails:
        assert out.returncode != 0 and "draws a figure but shows no image" in out.stdout, out.stdout[-3000:]
    else:
        assert out.returncode == 0, out.stdout[-3000:]


# --------------------------------------------------------------------------
# a chapter's check cell fails when what it checks fails
# --------------------------------------------------------------------------

def _code(path) -> str:
    return "\n".join("".join(c["source"]) for c in _load(path)["cells"] if c["cell_type"] == "code")


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem[:2].isdigit()], ids=lambda p: p.stem)
def test_each_chapter_checks_its_own_stage(path):
    """Every stage's notebook has the check cell `nb.error_table("NN")` of its own stage, and checks no other
    stage with it (nb.error_table raises at run time too: test_a_check_cell_of_another_stage_raises)."""
    import re

    called = re.findall(r"nb\.error_table\(\s*['\"](\d\d)['\"]", _code(path))
    assert called == [path.stem[:2]], f"{path.name} checks {called}"


def test_a_check_cell_of_another_stage_raises(monkeypatch):
    from common import notebook as nb

    monkeypatch.setenv(nb.NOTEBOOK_ENV, str(REPO_ROOT / "notebooks" / "01_cpp.ipynb"))
    assert nb.chapter() == "01" and nb.own_stage("1") == "01"
    with pytest.raises(nb.CheckFailed, match="01_cpp.ipynb checks stage 00"):
        nb.error_table("00")
    monkeypatch.setenv(nb.NOTEBOOK_ENV, str(REPO_ROOT / "notebooks" / "summary.ipynb"))
    assert nb.chapter() is None and nb.own_stage("05") == "05"  # the summary may show any stage


def test_a_recorded_check_above_todays_tolerance_raises(monkeypatch):
    """A GPU stage's notebook on a CPU shows its recorded rows, judged by the stage's tolerance as it is
    now: a tolerance tightened below a recorded error, or a stage that declares its previous stage's bits
    where the record differs from them, fails the cell."""
    import dataclasses

    from common import notebook as nb
    from common.stages import load_stage

    nb.error_table("07")  # as recorded: within tolerance, stage 06's bits
    stage = load_stage("07")
    tight = dataclasses.replace(stage.SPEC, tolerance=dict(o=1e-3, S=5e-3))
    monkeypatch.setattr(stage, "SPEC", tight)
    with pytest.raises(nb.CheckFailed, match=r"07_movm_register \(recorded\).* o: 4\.1\de-03 against fp64"):
        nb.error_table("07")
    monkeypatch.undo()
    rec = nb.results.recorded("checks")
    rows = [dict(r, err_prev=1e-7) if r.get("stage") == "07_movm_register" else r for r in rec["rows"]]
    monkeypatch.setattr(nb, "_recorded", lambda name: (rec["meta"], rows))
    with pytest.raises(nb.CheckFailed, match="declares the previous stage bits"):
        nb.error_table("07")


def test_every_tensor_core_chapter_shows_its_neighbour_diff():
    """Chapters 05 on show the lesson as code: nb.diff of their own stage (the diff's size per file and the
    excerpt of its largest change, with the command that prints the rest)."""
    import json

    from common.paths import REPO_ROOT
    from common.stages import STAGE_DIRS, tensor_core_stages

    for sid in tensor_core_stages():
        cells = json.loads((REPO_ROOT / "notebooks" / f"{STAGE_DIRS[sid]}.ipynb").read_text())["cells"]
        assert any(f'nb.diff("{sid}")' in "".join(c["source"]) for c in cells if c["cell_type"] == "code"), sid


def test_the_diff_names_the_command_and_an_excerpt(capsys):
    from common import notebook as nb

    df = nb.diff("07")
    out = capsys.readouterr().out
    assert out.startswith("diff -ru stages/06_ws_pipeline stages/07_movm_register")
    assert "its largest change, in kda.cu" in out and "\n+" in out
    assert df.loc["kda.cu", "added"] > 0


def test_a_stage_may_declare_its_chapter_checks_record(monkeypatch):
    """Stage 12 declares RECORDS["checks"] (a row per stage compared with): its chapter's check cell shows stage 11's
    bits on the bounded cases and the softplus cases against stage 04, not both under stage 11's label."""
    from common import notebook as nb

    monkeypatch.setattr(nb, "notebook_path", lambda: None)
    t = nb.error_table("12").data
    vs11 = t[t["prev"] == "11_varlen"]
    assert len(vs11) == 2 and (vs11["err_prev"] == 0).all()
    assert (t[t["prev"] == "04_warp"]["err_prev"] > 0).all()


def test_no_table_cell_is_cut_short():
    """A stored table shows every cell whole: pandas cuts a cell at 50 characters by default (an ablation table's
    idea read "a load warp fills the slot ring (warp speciali..."); common.notebook turns that off."""
    import re

    import pandas as pd

    import common.notebook  # noqa: F401  (sets the display option on import)

    assert pd.get_option("display.max_colwidth") is None
    cut = []
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            for out in cell.get("outputs", []):
                html = "".join(out.get("data", {}).get("text/html", ""))
                cut += [f"{path.name} cell {i}: {m}" for m in re.findall(r"<td>[^<]{40,}\.\.\.</td>", html)]
    assert not cut, "table cells cut short (re-run the cell with common.notebook imported):\n" + "\n".join(cut)
