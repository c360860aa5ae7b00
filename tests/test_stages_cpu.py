"""Stages that run on the CPU (00, 01): checked against the fp64 reference and
the previous stage, forward and all eight gradients, outputs poisoned."""

import pytest
import torch

from common import checks
from common.stages import load_stage, stage_ids

CPU_STAGES = [s for s in stage_ids() if "cpu" in load_stage(s).SPEC.devices]


@pytest.mark.parametrize("sid", CPU_STAGES)
@pytest.mark.parametrize("case", checks.cpu_cases(), ids=lambda c: c.id)
def test_stage_matches_reference_and_previous(sid, case):
    rows = checks.check_case(sid, case, device="cpu")
    names = {r["output"] for r in rows}
    assert {"o", "S"} <= names
    if load_stage(sid).SPEC.backward:
        assert {"dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"} <= names
        assert ("dinitial_state" in names) == case.h0
    bad = [r for r in rows if not r["ok"]]
    assert not bad, checks.format_rows(bad)


@pytest.mark.parametrize("sid", CPU_STAGES)
def test_output_final_state_false(sid):
    kw = checks.case_inputs(checks.cpu_cases()[0])
    kw["output_final_state"] = False
    o, S = load_stage(sid).forward(**kw)
    assert S is None and torch.isfinite(o).all()


@pytest.mark.parametrize("sid", CPU_STAGES)
def test_bf16_inputs_give_bf16_output(sid):
    kw = checks.make_inputs(1, 40, 1, 16, 16, seed=3, dtype=torch.bfloat16, chunk_size=16)
    o, S = load_stage(sid).forward(**kw)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32


@pytest.mark.parametrize("sid", CPU_STAGES)
def test_deterministic(sid):
    assert checks.check_deterministic(sid, checks.cpu_cases()[2])


def test_poison_catches_an_unwritten_output():
    """The check machinery itself: an output left unwritten must fail."""
    from common.contract import alloc, poisoned

    with poisoned():
        x = alloc((3, 4))
    assert torch.isnan(x).all()
    from common.metrics import rel_err

    assert rel_err(x, torch.ones(3, 4)) == float("inf")


def test_profile_regions_cpu():
    for sid in CPU_STAGES:
        stage = load_stage(sid)
        kw = checks.make_inputs(1, 64, 1, 16, 16, seed=0)
        prof = stage.profile(**kw, backward=True)
        assert prof and all(v > 0 for v in prof.values())
        assert set(prof) <= set(stage.SPEC.regions)
