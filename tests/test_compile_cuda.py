"""Every CUDA stage must compile (normal and profile builds), also in CI where
there is no GPU: a student's compile error fails here."""

import pytest

from common.build import find_cuda_home
from common.stages import load_stage, stage_ids

CUDA_STAGES = [s for s in stage_ids() if "cuda" in load_stage(s).SPEC.devices and getattr(load_stage(s), "SOURCES", None)]


def test_cuda_toolkit_found():
    home = find_cuda_home()
    assert home is not None, "no CUDA toolkit: set CUDA_HOME to the directory with bin/nvcc"


@pytest.mark.parametrize("sid", CUDA_STAGES)
def test_cuda_stage_compiles(sid):
    """Each translation unit once per run: the normal build here (the notebooks load it); the profile build
    where a profile is taken, on a GPU (below, and the GPU tests that profile)."""
    ext = load_stage(sid).build()
    assert hasattr(ext, "fwd")
    if load_stage(sid).SPEC.backward:
        assert hasattr(ext, "bwd")


@pytest.mark.gpu
@pytest.mark.parametrize("sid", CUDA_STAGES)
def test_cuda_stage_profile_build_compiles(sid):
    ext = load_stage(sid).build(profile=True)
    assert hasattr(ext, "fwd")


def test_a_notebook_builds_the_profile_variant_only_where_it_profiles(monkeypatch):
    """On a machine where the stage cannot run, nb.build compiles the normal build alone: the chapter shows
    the recorded profile, and a profile build would compile every translation unit a second time."""
    from common import notebook

    built = []

    class Stage:
        SPEC = type("Spec", (), {"runnable_here": lambda self: (runs, "")})()

        def build(self, profile=False):
            built.append(profile)
            return object()

    monkeypatch.setattr(notebook, "load_stage", lambda sid: Stage())
    runs = False
    notebook.build("12")
    assert True not in built
    runs, built[:] = True, []
    notebook.build("12")
    assert True in built


@pytest.mark.parametrize("target,want", [("9.0", "9.0a"), ("8.0", "8.0")])
def test_an_sm90a_build_changes_the_target_for_that_build_only(monkeypatch, tmp_path, target, want):
    """load_extension(sm90a=True) (stage 08: setmaxnreg) builds for sm_90a where
    the target is sm_90 and leaves every other target alone; the process's
    TORCH_CUDA_ARCH_LIST is the same after the build, so the next stage builds
    for the GPU's own architecture again."""
    import os

    from torch.utils import cpp_extension

    from common import build

    if find_cuda_home() is None:
        pytest.skip("no CUDA toolkit here")
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(os.environ["TORCH_CUDA_ARCH_LIST"]) or object())
    monkeypatch.setattr(build, "BUILD_DIR", tmp_path)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", target)
    build.load_extension(tmp_path, f"arch_probe_{target.replace('.', '')}", ["kda.cu"], cuda=True, sm90a=True,
                         quiet=True)
    assert seen == [want] and os.environ["TORCH_CUDA_ARCH_LIST"] == target
    build._LOADED.pop(build.extension_name(f"arch_probe_{target.replace('.', '')}"), None)
