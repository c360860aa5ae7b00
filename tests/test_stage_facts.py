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
