"""Facts about one stage live in its stage.py, with the kernel's value: a
constant there that mirrors a constant of the stage's kda.cu must equal it."""

import re

import pytest

from common.stages import STAGE_DIRS, lesson_source, load_stage, stage_ids, strip_ablations
from common.paths import STAGES_DIR

# stage.py constant -> the constexpr of the stage's sources it mirrors
MIRRORED = {"PREP_TEAMS": "kPrepTeams", "SEGMENT_CHUNKS": "kSegmentChunks", "LONE_RING64": "kLoneStages64"}


def _sources(sid) -> str:
    """Every source file of the stage as its default build sees it (the ablation switches resolved)."""
    d = STAGES_DIR / STAGE_DIRS[sid]
    return "\n".join("\n".join(lesson_source(sid, f.name)) for f in sorted(d.iterdir())
                     if f.suffix in (".cu", ".cuh", ".h", ".cpp"))


def _constexpr(sid, name):
    found = re.findall(rf"constexpr\s+(?:int|int64_t)\s+{name}\s*=\s*(\d+)\s*;", _sources(sid))
    assert len(found) == 1, f"stage {sid}'s default build defines {name} {len(found)} times"
    return int(found[0])


@pytest.mark.parametrize("sid", [s for s in stage_ids() if (STAGES_DIR / STAGE_DIRS[s] / "kda.cu").exists()])
def test_stage_constants_equal_the_kernels(sid):
    stage = load_stage(sid)
    src = _sources(sid)
    for const, cu in MIRRORED.items():
        if hasattr(stage, const) or re.search(rf"constexpr\s+(?:int|int64_t)\s+{cu}\b", src):
            assert hasattr(stage, const), f"stage {sid}'s sources have {cu} but its stage.py no {const}"
            assert getattr(stage, const) == _constexpr(sid, cu), (sid, const)


def test_default_build_drops_an_ablation_branch():
    text = "#ifdef KDA_ONE\nconstexpr int kX = 1;\n#else\nconstexpr int kX = 2;\n#endif\n#ifdef KDA_PROFILE\nkeep\n#endif"
    seen = strip_ablations(text, ["KDA_ONE"])
    assert re.findall(r"kX = (\d)", seen) == ["2"] and "keep" in seen  # the default's value; the profile build's code


def test_the_fused_stages_have_their_prepare_teams():
    from common import notebook

    assert [s for s in stage_ids() if hasattr(load_stage(s), "PREP_TEAMS")] == ["09", "10", "11", "12"]
    assert notebook.prep_teams() == load_stage("09").PREP_TEAMS == notebook.prep_teams("10") == notebook.prep_teams("11")
    assert notebook.prep_teams("12") == notebook.prep_teams("11")


# ---------------------------------------------------------------------------
# what the stages declare, and where the harness shows it: no shared table lists stage ids
# ---------------------------------------------------------------------------

def test_a_stage_directory_joins_the_ladder_by_itself(tmp_path, monkeypatch):
    """The ladder is the stages/NN_name directories: a new one needs no shared table."""
    from common import stages

    for name in ("00_naive", "01_cpp", "13_backward", "notes", "1x_draft", "14_split_chain"):
        (tmp_path / name).mkdir()
    (tmp_path / "15_file_not_dir").write_text("")
    monkeypatch.setattr(stages, "STAGES_DIR", tmp_path)
    assert stages._discover() == {"00": "00_naive", "01": "01_cpp", "13": "13_backward", "14": "14_split_chain"}
    (tmp_path / "13_other").mkdir()
    with pytest.raises(RuntimeError, match="share id 13"):
        stages._discover()


def test_the_harness_reads_the_stages_declarations():
    from common import notebook, stages
    import kdalab.op as op

    assert list(STAGE_DIRS.values()) == sorted(p.name for p in STAGES_DIR.iterdir() if re.match(r"\d\d_", p.name))
    assert op.STAGE == stages.last_stage() == stage_ids()[-1]  # the op runs the summit
    assert stages.tensor_core_stages() == [s for s in stage_ids() if s >= "05"]
    assert stages.fused_stage() == "09" and notebook.prep_teams() == load_stage("09").PREP_TEAMS
    # each record a stage declares exists, under every key (the harness's and a chapter's own: stage 12's notebook)
    from common.paths import RESULTS_DIR

    declared = {(sid, key): stages.record_names(decl) for sid in stage_ids()
                for key, decl in stages.stage(sid).records.items()}
    assert {"paths", "varlen", "latency", "accuracy", "fla_speed"} <= {key for _, key in declared}
    assert len(declared[("12", "fla_speed")]) == 4
    for (sid, key), names in declared.items():
        assert names and all(isinstance(n, str) for n in names), (sid, key)
        for n in names:
            assert (RESULTS_DIR / "h200" / f"{n}.json").exists(), (sid, key, n)


def _row_of(table: str, name: str) -> list[str]:
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith(f"| {name} |")]
    assert rows, f"{name} is missing"
    return [c.strip() for c in rows[0]]


def test_every_stage_is_in_the_summary_with_its_time():
    """The tour's and the summary notebook's ladder (recorded): a row with a time for every stage."""
    from common import report

    summary = report.recorded_summary_markdown()
    for sid in stage_ids():
        name = load_stage(sid).SPEC.name
        assert _row_of(summary, name)[4] != "-", f"{name} has no recorded time in the summary"


def test_every_tensor_core_stage_is_in_results_and_the_readme_figures():
    from common import notebook, report
    from common.paths import REPO_ROOT
    from common.stages import tensor_core_stages

    names = [load_stage(s).SPEC.name for s in tensor_core_stages()]
    head = report.tc_markdown().splitlines()[0]
    results_md = (REPO_ROOT / "docs" / "RESULTS.md").read_text()
    assert head in results_md  # RESULTS.md's table is today's (test_readme holds the whole block)
    _, ladder = notebook.ladder()
    _, tc = notebook.tc_latency(tensor_core_stages())
    for name in names:
        assert f" {name} |" in head, f"{name} is missing from RESULTS.md's tensor-core table"
        assert any(s.startswith(name) and ms == ms for s, ms in zip(ladder["stage"], ladder["fwd_ms"])), \
            f"{name} is missing from the ladder figure"
        assert any(c.startswith(name) for c in tc.columns), f"{name} is missing from the tensor-core figure"
    import matplotlib.pyplot as plt

    plt.close("all")


def test_the_summary_notebook_shows_every_tensor_core_stage():
    import json

    from common.paths import REPO_ROOT
    from common.stages import tensor_core_stages

    nb = json.loads((REPO_ROOT / "notebooks" / "summary.ipynb").read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code" and "nb.tc_latency(" in "".join(c["source"])]
    assert cells and all("nb.tc_latency(nb.tensor_core_stages())" in "".join(c["source"]) for c in cells)
    shown = "".join("".join(o.get("data", {}).get("text/plain", "")) for c in cells for o in c.get("outputs", []))
    for sid in tensor_core_stages():
        assert load_stage(sid).SPEC.name in shown, f"summary.ipynb's tensor-core table lacks stage {sid}: re-execute it"
