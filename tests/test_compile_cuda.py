"""Every CUDA stage must compile (normal and profile builds), also in CI where
there is no GPU: a student's compile error fails here."""

import pytest

from common.build import find_cuda_home
from common.stages import load_stage, stage_ids

CUDA_STAGES = [s for s in stage_ids() if "cuda" in load_stage(s).SPEC.devices and getattr(load_stage(s), "SOURCES", None)]


def test_cuda_toolkit_found():
    home = find_cuda_home()
    assert home is not None, "no CUDA toolkit: set CUDA_HOME to the directory with bin/nvcc"


@pytest.mark.parametrize("profile", [False, True], ids=["normal", "profile"])
@pytest.mark.parametrize("sid", CUDA_STAGES)
def test_cuda_stage_compiles(sid, profile):
    ext = load_stage(sid).build(profile=profile)
    assert hasattr(ext, "fwd")
    if load_stage(sid).SPEC.backward:
        assert hasattr(ext, "bwd")
