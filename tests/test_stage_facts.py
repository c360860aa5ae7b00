"""Facts about one stage live in its stage.py, with the kernel's value: a
constant there that mirrors a constant of the stage's kda.cu must equal it."""

import re

import pytest

from common.stages import STAGE_DIRS, load_stage, stage_ids
from common.paths import STAGES_DIR

# stage.py constant -> the constexpr of kda.cu it mirrors
MIRRORED = {"PREP_TEAMS": "kPrepTeams"}


def _constexpr(sid, name):
    src = (STAGES_DIR / STAGE_DIRS[sid] / "kda.cu").read_text()
    found = re.findall(rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", src)
    assert len(found) == 1, f"stage {sid}'s kda.cu defines {name} {len(found)} times"
    return int(found[0])


@pytest.mark.parametrize("sid", [s for s in stage_ids() if (STAGES_DIR / STAGE_DIRS[s] / "kda.cu").exists()])
def test_stage_constants_equal_the_kernels(sid):
    stage = load_stage(sid)
    for const, cu in MIRRORED.items():
        src = (STAGES_DIR / STAGE_DIRS[sid] / "kda.cu").read_text()
        if hasattr(stage, const) or re.search(rf"constexpr\s+int\s+{cu}\b", src):
            assert hasattr(stage, const), f"stage {sid}'s kda.cu has {cu} but its stage.py no {const}"
            assert getattr(stage, const) == _constexpr(sid, cu), (sid, const)


def test_the_fused_stages_have_their_prepare_teams():
    from common import notebook

    assert [s for s in stage_ids() if hasattr(load_stage(s), "PREP_TEAMS")] == ["08", "09"]
    assert notebook.prep_teams() == load_stage("08").PREP_TEAMS == notebook.prep_teams("09")
