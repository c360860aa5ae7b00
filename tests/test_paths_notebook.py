"""The notebook helpers of a stage with several paths (stage 08): the table and
figure of every path (common.notebook.paths_table / paths_plot, with the
checks of path_problems) and the fused kernel's timeline per chunk
(chunk_profile / fused_profile). Tested on the recorded file and on wrong
answers planted into copies of it; the live branch with a stand-in for the
GPU measurement."""

import copy

import pytest

from common import bench, notebook
from common.contract import StageSpec

REC = notebook._recorded(notebook.PATHS_RECORDED["08"]["table"])
PROF = notebook._recorded(notebook.PATHS_RECORDED["08"]["profile"])
B8 = "B8 T1024 H64 K128 V128"


def _row(rows, stage, path, shape=B8):
    (r,) = [r for r in rows if r["stage"] == stage and r["path"] == path and bench.shape_label(r) == shape]
    return r


@pytest.fixture
def recorded(monkeypatch):
    """The notebook reads a copy of the recorded paths file, which a test may spoil."""
    meta, rows = copy.deepcopy(REC)
    _, prof = copy.deepcopy(PROF)
    names = notebook.PATHS_RECORDED["08"]
    if names["profile"] == names["table"]:  # one file: the spoiled copy is both
        prof = rows
    files = {names["profile"]: (meta, prof), names["table"]: (meta, rows)}
    real = notebook._recorded
    monkeypatch.setattr(notebook, "_recorded", lambda name: files[name] if name in files else real(name))
    monkeypatch.setattr(notebook, "_PATHS", {})
    return rows, prof


def test_the_recorded_paths_pass_their_checks(recorded, capsys):
    rows, _ = recorded
    assert all(notebook.path_problems(r) == [] for r in rows)
    df = notebook.paths_table("08")
    out = capsys.readouterr().out
    assert f"path checks: {len(rows)} of {len(rows)} rows as expected" in out and "recorded on NVIDIA H200" in out
    assert (df["check"] == "ok").all() and (df["where"] == "recorded").all()
    # the table is the file: the rule at B=8 (the fused kernel) against stage 07 and FlashKDA measured in the same call
    rule = df.loc[(B8, "rule")]
    assert rule["GPU ms"] == pytest.approx(0.578, abs=5e-4) and rule["07 ms"] == pytest.approx(1.203, abs=5e-4)
    assert rule["time / FlashKDA"] == pytest.approx(0.713, abs=5e-3) and bool(rule["bitwise = 07"]) is False
    assert bool(df.loc[(B8, "split2"), "bitwise = 07"]) is True
    assert df.loc[(B8, "fused8"), "peak MB"] == 167.8 and rule["FlashKDA peak MB"] == 662.4
    assert "fused8" not in df.loc["B2 T2048 H4 K64 V64"].index  # 8 compute warps need V = 128


@pytest.mark.parametrize("stage,path,spoil,why", [
    ("08", "split2", dict(equal_to_07=False), "not bitwise equal to stage 07"),
    ("08", "fused4", dict(kernels=["kda_prepare_kernel", "kda_recurrence_kernel"]), "path fused4 launched"),
    ("08", "rule", dict(kernels=["kda_fused_kernel"], err_vs_07=5e-3), "5.0e-03 from stage 07"),
    ("08", "split1", dict(kernels=["kda_recurrence_kernel"]), "path split1 launched"),
    ("08", "fused1", dict(peak_mb=None), "no peak memory"),
    ("08", "fused2", dict(error="out of memory"), "failed: out of memory"),
    ("07", "rule", dict(fwd_graph_ms=float("nan")), "no valid time"),
], ids=["split-not-bitwise", "fused-path-ran-split", "rule-fused-too-far", "split-half-launched", "no-peak", "error",
        "nan-time-of-07"])
def test_a_wrong_path_row_fails_its_check(recorded, capsys, stage, path, spoil, why):
    rows, _ = recorded
    _row(rows, stage, path).update(spoil)
    df = notebook.paths_table("08")
    out = capsys.readouterr().out
    assert f"path checks: 1 of {len(rows)} rows FAILED" in out and f"{B8} {stage} {path}: " in out and why in out
    failed = df[df["check"] != "ok"]
    if stage == "08":  # the stage's own row says so in the table too
        assert list(failed.index) == [(B8, path)] and failed["check"].iloc[0].startswith("FAILED: ")
    else:  # the reference's rows are columns of the table, not rows
        assert failed.empty


def test_a_fused_launch_within_the_tolerance_passes():
    row = dict(stage="08", path="rule", B=1, T=64, H=1, K=64, V=64, fwd_graph_ms=0.1, peak_mb=1.0,
               kernels=["kda_fused_kernel"], equal_to_07=False, err_vs_07=2e-4)
    assert notebook.path_problems(row) == []
    assert notebook.path_problems(dict(row, kernels=["kda_prepare_kernel", "kda_recurrence_kernel"])) == [
        "a split launch not bitwise equal to stage 07"]


def test_paths_plot_draws_every_cell(recorded):
    ax = notebook.paths_plot("08")
    texts = {t.get_text() for t in ax.texts}
    assert {"0.578", "0.573", "0.81", "2.05"} <= texts  # rule, fused8 and FlashKDA at B=8; stage 07 at T=32768
    mem = {t.get_text() for t in ax.figure.axes[1].texts}
    assert {"872", "168", "662", "2.2"} <= mem  # split (07), fused, FlashKDA at B=8; fused at K=64 (no fused8 there)
    assert "-" in texts  # fused8 and FlashKDA do not exist at K = V = 64
    assert "recorded on NVIDIA H200" in ax.get_title()


def test_live_paths_fit_the_budget_and_show_the_rest_recorded(recorded, monkeypatch, capsys):
    """On a GPU (stood in for here): the shapes whose recorded rows predict at most
    30 s are measured by common.bench.path_rows, the rest shown as recorded."""
    rows, _ = recorded
    monkeypatch.setattr(StageSpec, "runnable_here", lambda self: (True, ""))
    measured = []

    def fake(sid, shape, budget_s):
        measured.append(bench.shape_label(shape))
        return [dict(r, fwd_graph_ms=r["fwd_graph_ms"] / 2) for r in rows if bench.shape_label(r) == measured[-1]]

    monkeypatch.setattr(bench, "path_rows", fake)
    df = notebook.paths_table("08")
    out = capsys.readouterr().out
    assert measured == ["B1 T1024 H64 K128 V128", "B8 T1024 H64 K128 V128", "B1 T8192 H64 K128 V128"]  # 9 s each
    assert "live at 3 of 7 shapes" in out and "4 shape(s) recorded, not timed live" in out
    assert set(df.loc[B8, "where"]) == {"live"} and set(df.loc["B2 T2048 H4 K64 V64", "where"]) == {"recorded"}
    assert df.loc[(B8, "rule"), "GPU ms"] == pytest.approx(0.578 / 2, abs=5e-4)
    ax = notebook.paths_plot("08")  # the same measurement, not a second one
    assert len(measured) == 3 and "live and recorded rows" in ax.get_title()
    assert f"{B8} (live)" in [t.get_text() for t in ax.get_yticklabels()]


def _fused8_b8(prof_rows):
    return _row(prof_rows, "08", "fused8")


def test_chunk_profile_of_the_recorded_fused_kernel():
    groups = notebook.chunk_profile(_fused8_b8(PROF[1])["profile"], 1024)
    tot = notebook.chunk_totals(groups)
    assert tot["prepare"] == pytest.approx(4.39e3, rel=0.01) and tot["chain"] == pytest.approx(4.07e3, rel=0.01)
    assert tot["wait"] == pytest.approx(407, rel=0.01)
    assert list(groups["prepare warps"]) == list(notebook.FUSED_PREPARE)  # in the order a chunk goes through them
    assert list(groups["compute warps"])[0] == notebook.FUSED_COMPUTE_WAIT


def test_chunk_profile_refuses_what_is_not_one_fused_block():
    prof = dict(_fused8_b8(PROF[1])["profile"])
    with pytest.raises(ValueError, match="T must be positive"):
        notebook.chunk_profile(prof, 0)
    with pytest.raises(ValueError, match="no K1: inverse"):
        notebook.chunk_profile({k: v for k, v in prof.items() if k != "K1: inverse"}, 1024)
    with pytest.raises(ValueError, match="must span the same time"):  # read as one prepare team: twice the block's time
        notebook.chunk_profile(prof, 1024, teams=1)
    with pytest.raises(ValueError, match="must span the same time"):  # a region lost its time
        notebook.chunk_profile(dict(prof, **{"K2 producer: issue loads (+ stage rows, fused)": 0.0}), 1024)
    split = _row(PROF[1], "08", "split2")["profile"]  # K1's regions per K1 block: not one block's timeline
    with pytest.raises(ValueError, match="must span the same time"):
        notebook.chunk_profile(split, 1024)


def test_fused_profile_draws_the_recorded_timeline(recorded, capsys):
    ax = notebook.fused_profile("08")
    out = capsys.readouterr().out
    assert "prepare warps 4.39e+03" in out and "the chain 4.07e+03" in out
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["2 x 4 prepare warps", "8 compute warps"]
    assert "the chain: 4.1e3" in [t.get_text() for t in ax.texts]


def test_fused_profile_refuses_a_profile_of_the_split_kernels(recorded):
    _, prof = recorded
    _fused8_b8(prof)["kernels"] = ["kda_prepare_kernel", "kda_recurrence_kernel"]
    with pytest.raises(ValueError, match="not the fused kernel alone"):
        notebook.fused_profile("08")
