"""The ablations of the multi-idea stages: declared right, built apart, reported
honestly (GPU measurements: scripts/gpu_run.py --phases ablations)."""

import re

import pytest
import torch

from common import ablation, report
from common.contract import Ablation, ablation_build_args
from common.paths import STAGES_DIR
from common.stages import STAGE_DIRS, load_stage, stage_ids

MULTI_IDEA = ("04", "05", "06", "08", "09", "10")  # the stages whose step carries several ideas (issues 12, 23)


def test_multi_idea_stages_have_ablations():
    for sid in MULTI_IDEA:
        assert len(ablation.ablations(sid)) >= 2, f"stage {sid} carries several ideas: list them in ABLATIONS"
    assert ablation.stages_with_ablations() == list(MULTI_IDEA)


@pytest.mark.parametrize("sid", [s for s in stage_ids() if ablation.ablations(s)])
def test_ablations_are_declared_right(sid):
    stage = load_stage(sid)
    abls = stage.ABLATIONS
    assert all(isinstance(a, Ablation) for a in abls)
    assert len({a.name for a in abls}) == len(abls) and len({a.define for a in abls}) == len(abls)
    src = "\n".join(f.read_text() for f in sorted((STAGES_DIR / STAGE_DIRS[sid]).iterdir())
                    if f.suffix in (".cu", ".cuh", ".h", ".cpp"))
    for a in abls:
        assert re.fullmatch(r"KDA_\w+", a.define), a.define
        # the switch guards code in the sources (#ifdef / #ifndef / defined(...))
        assert re.search(rf"#\s*if(n?def\s+{a.define}\b|.*defined\(\s*{a.define}\s*\))", src), \
            f"{a.define} does not guard any code of stage {sid}"
        assert a.region in stage.SPEC.regions, f"{a.name}: region {a.region!r} is not one of SPEC.regions"
        assert a.idea and a.instead


def test_ablation_build_args():
    abls = (Ablation("no_x", "KDA_NO_X", "x", "y", "r"),)
    assert ablation_build_args(abls, None) == {}
    assert ablation_build_args(abls, "no_x") == {"variant": "no_x", "defines": ("KDA_NO_X",)}
    with pytest.raises(ValueError, match="ablation must be one of .*no_x.*got 'no_y'"):
        ablation_build_args(abls, "no_y")


def test_variant_is_a_stage_and_validates_before_building():
    sid = MULTI_IDEA[-1]
    name = ablation.ablations(sid)[0].name
    v = ablation.variant(sid, name)
    assert v.SPEC.name != load_stage(sid).SPEC.name and v.SPEC.name.startswith(load_stage(sid).SPEC.name)
    assert v.BASE.module is load_stage(sid)
    with pytest.raises(ValueError, match="ablation must be one of"):
        ablation.variant(sid, "no_such_idea")
    q = torch.zeros(1, 16, 1, 64, dtype=torch.float64)  # a bad dtype: refused in Python, nothing is built
    with pytest.raises((ValueError, TypeError), match="q"):
        v.forward(q, q, q, q, torch.zeros(1, 16, 1), A_log=torch.zeros(1), dt_bias=torch.zeros(1, 64),
                  gate="bounded", lower_bound=-5.0)


def _rows(ok=True):
    full = dict(stage="06_ws_pipeline", variant="full", idea=None, instead=None, region=None, B=1, T=1024, H=64,
                K=128, V=128, checks_ok=True, err_ref=4e-3, err_full=None, fwd_ms=0.30, fwd_graph_ms=0.22,
                profile={"K2: wait for operands": 1000.0, "K2: w@S": 500.0}, profile_unit="cycles")
    off = dict(full, variant="no_load_warp", idea="load warp", instead="compute warps load", checks_ok=ok,
               region="K2: wait for operands", err_full=1e-4, fwd_ms=0.50, fwd_graph_ms=0.44,
               profile={"K2: wait for operands": 3000.0, "K2: w@S": 500.0})
    return [full, off]


def test_bought_is_the_slowdown_without_the_idea():
    (b,) = ablation.bought(_rows())
    assert b["fwd_ms_with"] == pytest.approx(0.22) and b["fwd_ms_without"] == pytest.approx(0.44)
    assert b["fwd_speedup"] == pytest.approx(2.0)
    assert (b["region_with"], b["region_without"]) == (1000.0, 3000.0)
    assert "bwd_speedup" not in b  # a forward-only stage has no backward column


def test_where_it_shows_is_the_region_the_idea_shrank_most():
    # declared region grew with the idea; another shrank: the panel shows the one that shrank
    full, off = _rows()
    off = dict(off, region="K2: w@S", profile={"K2: wait for operands": 3000.0, "K2: w@S": 400.0})
    (b,) = ablation.bought([full, off])
    assert b["region"] == "K2: wait for operands" and b["region_shrank"]
    assert (b["region_with"], b["region_without"]) == (1000.0, 3000.0)
    # nothing shrank: the declared region, said so
    off = dict(off, profile={"K2: wait for operands": 900.0, "K2: w@S": 400.0})
    (b,) = ablation.bought([full, off])
    assert b["region"] == "K2: w@S" and not b["region_shrank"]
    # 1% is within noise: not a region the idea shrank
    off = dict(off, profile={"K2: wait for operands": 1010.0, "K2: w@S": 400.0})
    (b,) = ablation.bought([full, off])
    assert b["region"] == "K2: w@S" and not b["region_shrank"]


def test_an_idea_whose_gain_is_memory_shows_its_peak():
    import matplotlib
    matplotlib.use("Agg")
    from common.plotting import plot_ablation

    full, off = _rows()
    full, off = dict(full, peak_mb=100.0), dict(off, peak_mb=400.0)
    ax = plot_ablation(ablation.bought([full, off]), {})
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert any("peak memory" in t for t in labels) and len(labels) == 2
    ax = plot_ablation(ablation.bought([dict(full, peak_mb=400.0), off]), {})  # same peak: time only
    assert len(ax.get_yticklabels()) == 1


def test_failed_variant_is_reported_as_failed(monkeypatch):
    """Negative control: a variant that failed its checks shows FAILED in the
    README block and the notebook table, never a plain number."""
    monkeypatch.setattr(ablation, "recorded_rows", lambda sid=None: ({"device": "H200"}, _rows(ok=False)))
    text = "\n".join(report.ablation_markdown("06_ws_pipeline"))
    assert "FAILED" in text and "x2.00" in text
    from common import notebook

    with pytest.raises(notebook.CheckFailed, match="its checks failed"):  # the notebook's cell fails
        notebook.ablation_table("06")
    monkeypatch.setattr(ablation, "recorded_rows", lambda sid=None: ({"device": "H200"}, _rows(ok=True)))
    assert "FAILED" not in "\n".join(report.ablation_markdown("06_ws_pipeline"))


def test_recorded_ablations_passed_their_checks():
    """What the READMEs show was measured on variants that passed the stage's
    checks (fp64 reference and the full stage), deterministically."""
    meta, rows = ablation.recorded_rows()
    if not rows:
        pytest.skip("no recorded ablations yet (results/h200/ablations.json)")
    for sid in MULTI_IDEA:
        mine = [r for r in rows if r["stage"] == load_stage(sid).SPEC.name]
        assert {r["variant"] for r in mine} == {"full"} | {a.name for a in ablation.ablations(sid)}, \
            f"stage {sid}: the recorded variants are not the declared ablations; re-run the ablations phase"
    bad = [(r["stage"], r["variant"]) for r in rows if not r["checks_ok"]]
    assert not bad, f"variants that failed their checks: {bad}"


def test_resources_match_the_launched_instantiation(monkeypatch):
    """The resources table puts a launch's dynamic shared memory on the ptxas
    row of the instantiation launched: exactly by symbol when recorded, and
    marked as ambiguous (never guessed) when two instantiations look alike."""
    import pandas as pd

    from common import notebook

    ptxas = [dict(kernel="void kda_stage::kda_recurrence_kernel<128, 128, 1>", registers=124, smem_bytes=0,
                  stack_bytes=0, spill_stores=0, spill_loads=0),
             dict(kernel="void kda_stage::kda_recurrence_kernel<128, 128, 2>", registers=124, smem_bytes=0,
                  stack_bytes=0, spill_stores=0, spill_loads=0)]
    launch = dict(direction="fwd", kernel="kda_recurrence_kernel", K=128, grid=512, block=64, dynamic_smem=56624,
                  registers=124, static_smem=0)
    monkeypatch.setattr(notebook, "resource_usage", lambda *a, **k: [dict(r) for r in ptxas])
    monkeypatch.setattr(notebook, "sources_hash", lambda d: "not the record's")  # compile, as without a record
    monkeypatch.setattr(notebook, "launches", lambda sid: ([dict(launch)], "test"))
    df = notebook.resources("06")
    assert list(df["launched"]) == ["fwd (one of 2 instantiations)"] * 2
    sym = dict(launch, symbol="_ZN9kda_stage21kda_recurrence_kernelILi128ELi128ELi1EEEv12KdaFwdParams")
    monkeypatch.setattr(notebook, "launches", lambda sid: ([sym], "test"))
    df = notebook.resources("06")
    assert list(df["launched"]) == ["fwd", ""] and df["dynamic_smem_bytes"].iloc[0] == 56624
    assert pd.isna(df["dynamic_smem_bytes"].iloc[1])


def test_kdalab_ablate_refuses_a_one_idea_stage(capsys):
    from common.cli import main

    assert main(["ablate", "07"]) == 2
    assert "one idea" in capsys.readouterr().err
