"""Profile regions that can fail: each stage's expected regions are written out
here, apart from the code under test (the stage's SPEC), and every one must
record a positive time. A region that stops recording is dropped as zero by
common.extrun.profile, so it shows up as missing."""

import pytest

from common import checks
from common.stages import load_stage, stage_ids

FP32_FWD = ["fwd: pre-stage", "fwd: WY transform", "fwd: Aqk", "fwd: recurrence"]
FP32_GPU_BWD = ["bwd: recurrence", "bwd: WY/Aqk adjoint", "bwd: pre-stage adjoint"]
K1 = ["K1: load+pre-stage", "K1: L/Aqk products", "K1: inverse", "K1: w/u + store"]
K2_WS = ["K2: wait for operands", "K2: w@S", "K2: qd@S", "K2: vcorr", "K2: Aqk@vcorr", "K2: o store", "K2: S decay",
         "K2: kr^T@vcorr", "K2: S to bf16", "K2 load warp: wait for a free slot", "K2 load warp: issue cp.async"]

EXPECTED = {
    "00": FP32_FWD + ["bwd: autograd"],
    "01": FP32_FWD + ["bwd: recompute", "bwd: reverse recurrence", "bwd: WY adjoint", "bwd: pre-stage adjoint"],
    "02": FP32_FWD + FP32_GPU_BWD,
    "03": FP32_FWD + FP32_GPU_BWD,
    "04": FP32_FWD + FP32_GPU_BWD,
    "05": K1 + ["K2: loads / barriers", "K2: w@S", "K2: qd@S + Aqk@vcorr", "K2: S update"],
    "06": K1 + K2_WS,
    "07": K1 + K2_WS,
    "08": K1 + K2_WS,
    "09": K1 + K2_WS[:-2] + ["K2 producer: wait (free slot, barrier)", "K2 producer: issue loads (+ stage rows, fused)"],
    "10": K1 + K2_WS[:-2] + ["K2 producer: wait (free slot, barrier)", "K2 producer: issue loads (+ stage rows, fused)"],
    "11": K1 + K2_WS[:-2] + ["K2 producer: wait (free slot, barrier)", "K2 producer: issue loads (+ stage rows, fused)"],
    "12": K1 + K2_WS[:-2] + ["K2 producer: wait (free slot, barrier)", "K2 producer: issue loads (+ stage rows, fused)"],
}


def test_every_stage_has_expected_regions_written_here():
    assert set(EXPECTED) == set(stage_ids())


def _profile(sid, device):
    stage = load_stage(sid)
    kw = checks.stage_inputs(stage.SPEC, 1, 256, 2, 64, 64, device=device)
    return stage.profile(**kw, backward=stage.SPEC.backward)


@pytest.mark.parametrize("sid", [s for s in stage_ids() if "cpu" in load_stage(s).SPEC.devices])
def test_cpu_profile_regions(sid):
    prof = _profile(sid, "cpu")
    assert checks.check_profile(prof, EXPECTED[sid]) == []


@pytest.mark.gpu
@pytest.mark.parametrize("sid", [s for s in stage_ids() if load_stage(s).SPEC.devices == ("cuda",)])
def test_gpu_profile_regions(sid):
    prof = _profile(sid, "cuda")
    assert checks.check_profile(prof, EXPECTED[sid]) == []


def test_check_profile_catches_a_silent_region():
    good = {r: 1.0 for r in EXPECTED["01"]}
    assert checks.check_profile(good, EXPECTED["01"]) == []
    dropped = dict(good)
    del dropped["fwd: Aqk"]  # a region whose timer stopped recording
    assert checks.check_profile(dropped, EXPECTED["01"]) == ["missing region 'fwd: Aqk'"]
    assert checks.check_profile(dict(good, **{"fwd: Aqk": float("nan")}), EXPECTED["01"])
    assert checks.check_profile(dict(good, **{"bwd: extra": 1.0}), EXPECTED["01"])


def test_a_region_that_stops_recording_is_caught(monkeypatch):
    """Stage 01's profile with one region's clock broken (always 0): the
    summary drops it, and the check reports it missing."""
    from common import extrun

    real = extrun.summarize

    def broken(buf, regions):
        out = real(buf, regions)
        out["fwd: WY transform"] = 0.0
        return out

    monkeypatch.setattr(extrun, "summarize", broken)
    prof = _profile("01", "cpu")
    assert "missing region 'fwd: WY transform'" in checks.check_profile(prof, EXPECTED["01"])
