"""The ladder as objects: one Stage per stage, resolved once, carrying its spec,
module, paths, ablations and previous stage (common.stages.stage / ladder)."""

from types import SimpleNamespace

import pytest

from common.stages import STAGE_DIRS, Stage, ladder, load_stage, stage, stage_ids


def test_one_object_per_stage_whatever_names_it():
    for sid in stage_ids():
        st = stage(sid)
        assert isinstance(st, Stage) and st.id == sid and st.dir == STAGE_DIRS[sid]
        assert stage(st) is st and stage(int(sid)) is st and stage(STAGE_DIRS[sid]) is st
        assert stage(load_stage(sid)) is st and st.module is load_stage(sid)
        assert st.spec is st.module.SPEC and st.name == st.spec.name


def test_the_ladder_links_each_stage_to_the_one_before():
    stages = ladder()
    assert [s.id for s in stages] == stage_ids()
    assert stages[0].previous is None
    for before, after in zip(stages, stages[1:]):
        assert after.previous is before


def test_a_stage_carries_its_paths_and_ablations_and_forwards_the_rest():
    st = stage("09")
    assert "fused8" in st.paths and {a.define for a in st.ablations} >= {"KDA_NO_FUSED"}
    assert st.forward is st.module.forward and st.build is st.module.build
    assert stage("00").paths == {} and stage("00").ablations == ()
    with pytest.raises(AttributeError):
        st.no_such_attribute  # noqa: B018


def test_a_stand_in_module_is_wrapped_not_cached():
    fake = SimpleNamespace(SPEC=load_stage("05").SPEC, forward=lambda *a, **k: None)
    st = stage(fake)
    assert st.module is fake and stage("05").module is load_stage("05")
    with pytest.raises(ValueError, match="unknown stage"):
        stage("99")
