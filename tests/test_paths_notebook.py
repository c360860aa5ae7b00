"""The notebook helpers of a stage with several paths (stages 08-11): the
table and figure of every path (common.notebook.paths_table / paths_plot, with
the checks of path_problems) and the fused kernel's timeline per chunk
(chunk_profile / fused_profile). Tested on each stage's recorded file and on
wrong answers planted into copies of it; the live branch with a stand-in for
the GPU measurement."""

import copy

import pytest

from common import bench, notebook
from common.contract import StageSpec

from common.stages import load_stage, path_stages, previous

B8 = "B8 T1024 H64 K128 V128"
K64 = "B2 T2048 H4 K64 V64"  # the record's K = V = 64 shape (where fused8 and FlashKDA do not run)
# What each stage's record holds (results/h200/stageNN/paths_04c36d6.json and, for the fused kernel's regions,
# profile_2bcc81f.json; stage 11: stage11/paths_e242ae3.json, no profile of its own), read off the files: the rule
# at B=8 and its reference and FlashKDA in the same call, the figure's texts, how many of the record's shapes
# fit the live budget, the fused kernel per chunk.
EXPECT = {
    "08": dict(rule=1.2001, prev=1.1972, over_fk=1.49, rule_bitwise=True, fused8_peak=None, live=6, shapes=7,
               plot={"0.169", "1.2", "0.806", "2.05"}, mem={"872", "662", "179", "591"}),
    "09": dict(rule=0.7259, prev=1.2049, over_fk=0.889, rule_bitwise=False, fused8_peak=167.8, live=3, shapes=7,
               plot={"0.726", "0.817", "2"}, mem={"872", "168", "662", "2.2"},
               prepare=4.86e3, chain=3.56e3, wait=1.32e3, chain_label="the chain: 3.6e3"),
    "10": dict(rule=0.5736, prev=0.7218, over_fk=0.713, rule_bitwise=False, fused8_peak=167.8, live=3, shapes=7,
               plot={"0.574", "0.805", "1.88"}, mem={"168", "662", "2.2"},
               prepare=4.39e3, chain=4.08e3, wait=407, chain_label="the chain: 4.1e3"),
    # stage 10's kernels over sequences: bitwise stage 10 on every path (the fused ones too), five shapes
    "11": dict(rule=0.5974, prev=0.5817, over_fk=0.743, rule_bitwise=True, fused8_peak=167.8, live=3, shapes=5,
               k64="B1 T1024 H64 K64 V64", plot={"0.597", "0.804", "1.71", "1.63"}, mem={"168", "662", "591", "9.4"}),
}
# Stages with PATHS that have no recorded paths file yet (scripts/bench_paths.py not run on an H200 since they
# were added): they need one, and their figures here, before they leave this set (the test below holds that).
PENDING: set = {"12"}  # 12_softplus: no paths record yet
FUSED = [sid for sid in EXPECT if "prepare" in EXPECT[sid]]  # the stages with a recorded fused-kernel profile
REC = {sid: notebook._recorded(notebook.paths_recorded()[sid]["table"]) for sid in EXPECT}
PROF = {sid: notebook._recorded(notebook.paths_recorded()[sid]["profile"]) for sid in EXPECT
        if "profile" in notebook.paths_recorded()[sid]}


@pytest.fixture(params=list(EXPECT))
def sid(request):
    return request.param


def test_every_stage_with_paths_has_its_record_and_figures_here():
    """A new stage with PATHS needs its recorded file (RECORDS["paths"] in its stage.py) and its figures in EXPECT, or is PENDING."""
    assert set(path_stages()) - PENDING == set(EXPECT) == set(notebook.paths_recorded())


def test_pending_path_stages_are_not_yet_measured():
    """A PENDING stage is one with paths and no record: once its stage.py declares its record (or its paths
    file in results/h200/), it must leave PENDING and get its figures in EXPECT."""
    from common.paths import REPO_ROOT

    assert PENDING <= set(path_stages()), "a PENDING stage without paths: drop it from PENDING"
    for sid in PENDING:
        assert sid not in notebook.paths_recorded() and sid not in EXPECT, sid
        assert not list((REPO_ROOT / "results" / "h200" / f"stage{sid}").glob("paths_*.json")), \
            f"stage {sid} has a recorded paths file: move it out of PENDING"


def _row(rows, stage, path, shape=B8):
    (r,) = [r for r in rows if r["stage"] == stage and r["path"] == path and bench.shape_label(r) == shape]
    return r


@pytest.fixture
def recorded(monkeypatch, sid):
    """The notebook reads a copy of the stage's recorded paths file, which a test may spoil."""
    meta, rows = copy.deepcopy(REC[sid])
    names = notebook.paths_recorded()[sid]
    prof = copy.deepcopy(PROF[sid])[1] if sid in PROF else None
    if names.get("profile") == names["table"]:  # one file: the spoiled copy is both
        prof = rows
    files = {names["table"]: (meta, rows)}
    if "profile" in names:
        files[names["profile"]] = (meta, prof)
    real = notebook._recorded
    monkeypatch.setattr(notebook, "_recorded", lambda name: files[name] if name in files else real(name))
    monkeypatch.setattr(notebook, "_PATHS", {})
    return rows, prof


def test_the_recorded_paths_pass_their_checks(recorded, capsys, sid):
    rows, _ = recorded
    pid, e = previous(sid), EXPECT[sid]
    assert all(notebook.path_problems(r, pid) == [] for r in rows)
    df = notebook.paths_table(sid)
    out = capsys.readouterr().out
    assert f"path checks: {len(rows)} of {len(rows)} rows as expected" in out and "Recorded on NVIDIA H200" in out
    assert (df["check"] == "ok").all() and (df["where"] == "recorded").all()
    # the table is the file: the rule at B=8 (the fused kernel) against the previous stage and FlashKDA, same call
    rule = df.loc[(B8, "rule")]
    assert rule["GPU ms"] == pytest.approx(e["rule"], abs=5e-4) and rule[f"{pid} ms"] == pytest.approx(e["prev"], abs=5e-4)
    assert rule["time / FlashKDA"] == pytest.approx(e["over_fk"], abs=5e-3)
    # fused: the prepare's approximations (09), its sums' order (10); the split path (08) is bitwise stage 07's
    assert bool(rule[f"bitwise = {pid}"]) is e["rule_bitwise"]
    assert bool(df.loc[(B8, "split2"), f"bitwise = {pid}"]) is True
    assert rule["FlashKDA peak MB"] == 662.4
    if e["fused8_peak"] is not None:
        assert df.loc[(B8, "fused8"), "peak MB"] == e["fused8_peak"]
    assert "fused8" not in df.loc[e.get("k64", K64)].index  # 8 compute warps need V = 128


@pytest.mark.parametrize("who,path,spoil,why", [
    ("stage", "split2", dict(equal_to_prev=False), "not bitwise equal to stage {pid}"),
    ("stage", "fused4", dict(kernels=["kda_prepare_kernel", "kda_recurrence_kernel"]), "path fused4 launched"),
    ("stage", "rule", dict(kernels=["kda_fused_kernel"], err_vs_prev=5e-3), "5.0e-03 from stage {pid}"),
    ("stage", "split1", dict(kernels=["kda_recurrence_kernel"]), "path split1 launched"),
    ("stage", "fused1", dict(peak_mb=None), "no peak memory"),
    ("stage", "fused2", dict(error="out of memory"), "failed: out of memory"),
    ("prev", "rule", dict(fwd_graph_ms=float("nan")), "no valid time"),
], ids=["split-not-bitwise", "fused-path-ran-split", "rule-fused-too-far", "split-half-launched", "no-peak", "error",
        "nan-time-of-prev"])
def test_a_wrong_path_row_fails_its_check(recorded, capsys, sid, who, path, spoil, why):
    rows, _ = recorded
    pid = previous(sid)
    stage = sid if who == "stage" else pid
    if who == "stage" and path != "rule" and path not in load_stage(sid).PATHS:
        pytest.skip(f"stage {sid} has no path {path}")
    _row(rows, stage, path).update({k.replace("_prev", f"_{pid}"): v for k, v in spoil.items()})
    with pytest.raises(notebook.CheckFailed) as failed:  # the cell that shows the table fails
        notebook.paths_table(sid)
    msg = str(failed.value)
    why = why.format(pid=pid)
    assert f"path checks of stage {sid} (1 of {len(rows)} rows)" in msg and f"{B8} {stage} {path}: " in msg
    assert why in msg


def test_a_fused_launch_within_the_tolerance_passes():
    row = dict(stage="08", path="rule", B=1, T=64, H=1, K=64, V=64, fwd_graph_ms=0.1, peak_mb=1.0,
               kernels=["kda_fused_kernel"], equal_to_07=False, err_vs_07=2e-4)
    assert notebook.path_problems(row) == []
    assert notebook.path_problems(dict(row, kernels=["kda_prepare_kernel", "kda_recurrence_kernel"])) == [
        "a split launch not bitwise equal to stage 07"]


def test_paths_plot_draws_every_cell(recorded, sid):
    ax = notebook.paths_plot(sid)
    texts = {t.get_text() for t in ax.texts}
    assert EXPECT[sid]["plot"] <= texts  # rule, fused8 and FlashKDA at B=8; the previous stage at T=32768
    mem = {t.get_text() for t in ax.figure.axes[1].texts}
    assert EXPECT[sid]["mem"] <= mem  # (stage 07's split,) fused, FlashKDA at B=8; fused at K=64 (no fused8 there)
    assert "-" in texts  # fused8 and FlashKDA do not exist at K = V = 64
    assert "recorded on NVIDIA H200" in ax.get_title()


def test_live_paths_fit_the_budget_and_show_the_rest_recorded(recorded, monkeypatch, capsys, sid):
    """On a GPU (stood in for here): the shapes whose recorded rows predict at most
    30 s are measured by common.bench.path_rows, the rest shown as recorded."""
    rows, _ = recorded
    monkeypatch.setattr(StageSpec, "runnable_here", lambda self: (True, ""))
    measured = []

    def fake(sid, shape, budget_s):
        measured.append(bench.shape_label(shape))
        return [dict(r, fwd_graph_ms=r["fwd_graph_ms"] / 2) for r in rows if bench.shape_label(r) == measured[-1]]

    monkeypatch.setattr(bench, "path_rows", fake)
    df = notebook.paths_table(sid)
    out = capsys.readouterr().out
    n, m = EXPECT[sid]["live"], EXPECT[sid]["shapes"]  # the shapes whose recorded rows predict at most 30 s in all
    shapes = list(dict.fromkeys(bench.shape_label(r) for r in rows))
    assert len(shapes) == m and measured == shapes[:n]  # in the file's order
    assert f"live at {n} of {m} shapes" in out and f"{m - n} shape(s) recorded, not timed live" in out
    assert set(df.loc[B8, "where"]) == {"live"} and set(df.loc[shapes[-1], "where"]) == {"recorded"}
    assert df.loc[(B8, "rule"), "GPU ms"] == pytest.approx(EXPECT[sid]["rule"] / 2, abs=5e-4)
    ax = notebook.paths_plot(sid)  # the same measurement, not a second one
    assert len(measured) == n and "live and recorded rows" in ax.get_title()
    assert f"{B8} (live)" in [t.get_text() for t in ax.get_yticklabels()]


def _fused8_b8(prof_rows, sid):
    return _row(prof_rows, sid, "fused8")


@pytest.mark.parametrize("sid", FUSED)
def test_chunk_profile_of_the_recorded_fused_kernel(sid):
    groups = notebook.chunk_profile(_fused8_b8(PROF[sid][1], sid)["profile"], 1024)
    tot, e = notebook.chunk_totals(groups), EXPECT[sid]
    assert tot["prepare"] == pytest.approx(e["prepare"], rel=0.01) and tot["chain"] == pytest.approx(e["chain"], rel=0.01)
    assert tot["wait"] == pytest.approx(e["wait"], rel=0.01)
    assert list(groups["prepare warps"]) == list(notebook.FUSED_PREPARE)  # in the order a chunk goes through them
    assert list(groups["compute warps"])[0] == notebook.FUSED_COMPUTE_WAIT


@pytest.mark.parametrize("sid", FUSED)
def test_chunk_profile_refuses_what_is_not_one_fused_block(sid):
    prof = dict(_fused8_b8(PROF[sid][1], sid)["profile"])
    with pytest.raises(ValueError, match="T must be positive"):
        notebook.chunk_profile(prof, 0)
    with pytest.raises(ValueError, match="no K1: inverse"):
        notebook.chunk_profile({k: v for k, v in prof.items() if k != "K1: inverse"}, 1024)
    with pytest.raises(ValueError, match="must span the same time"):  # read as one prepare team: twice the block's time
        notebook.chunk_profile(prof, 1024, teams=1)
    with pytest.raises(ValueError, match="must span the same time"):  # a region lost its time
        notebook.chunk_profile(dict(prof, **{"K2 producer: issue loads (+ stage rows, fused)": 0.0}), 1024)
    split = _row(PROF[sid][1], sid, "split2")["profile"]  # K1's regions per K1 block: not one block's timeline
    with pytest.raises(ValueError, match="must span the same time"):
        notebook.chunk_profile(split, 1024)


@pytest.mark.parametrize("sid", FUSED)
def test_fused_profile_draws_the_recorded_timeline(recorded, capsys, sid):
    ax = notebook.fused_profile(sid)
    out = capsys.readouterr().out
    e = EXPECT[sid]
    assert f"prepare warps {e['prepare']:.3g}" in out and f"the chain {e['chain']:.3g}" in out
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["2 x 4 prepare warps", "8 compute warps"]
    assert e["chain_label"] in [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("sid", FUSED)
def test_fused_profile_refuses_a_profile_of_the_split_kernels(recorded, sid):
    _, prof = recorded
    _fused8_b8(prof, sid)["kernels"] = ["kda_prepare_kernel", "kda_recurrence_kernel"]
    with pytest.raises(ValueError, match="not the fused kernel alone"):
        notebook.fused_profile(sid)


def test_fused_profile_of_a_stage_without_its_own_says_so(capsys):
    """Stage 11 runs stage 10's kernels: no fused-kernel profile of its own is recorded (its RECORDS["paths"] has no
    "profile"), and fused_profile says so instead of drawing, on any machine."""
    own = [sid for sid in EXPECT if "profile" not in notebook.paths_recorded()[sid]]
    assert own == ["11"]
    for sid in own:
        assert notebook.fused_profile(sid) is None
        assert "no fused-kernel profile of" in capsys.readouterr().out


def test_split_chunk_profile_divides_k2_by_its_chunks():
    prof = {"K1: inverse": 1000.0, "K2: vcorr": 2560.0, "K2 load warp: issue cp.async": 1280.0}
    assert notebook.split_chunk_profile(prof, 2048) == {"K1: inverse": 1000.0, "K2: vcorr": 20.0,
                                                       "K2 load warp: issue cp.async": 10.0}
    assert notebook.split_chunk_profile(prof, 2047)["K2: vcorr"] == 20.0  # a tail chunk is a chunk
    with pytest.raises(ValueError, match="neither K1 nor K2"):
        notebook.split_chunk_profile({"fwd: recurrence": 1.0}, 2048)
    with pytest.raises(ValueError, match="T must be positive"):
        notebook.split_chunk_profile(prof, 0)


@pytest.mark.parametrize("sid", ["06", "07", "08", "11"])
def test_profile_moves_of_the_recorded_profiles(capsys, sid):
    """The table the chapters quote: both stages' regions per chunk, each kernel's total, their ratio; the
    printed line names what moved each way. Stage 07's register path must show vcorr and S to bf16 shorter."""
    table = notebook.profile_moves(sid).data
    out = capsys.readouterr().out
    prev = previous(sid)
    assert list(table.columns) == [prev, sid, "ratio"]
    k2 = [r for r in table.index if r.startswith("K2:")]
    assert table.loc["K2 compute warps: total", sid] == pytest.approx(table.loc[k2, sid].sum())
    assert (table["ratio"].dropna() == (table[sid] / table[prev]).dropna()).all()
    assert "per block / 128 chunks" in out and "fewer:" in out and "more:" in out
    if sid == "07":
        assert table.loc["K2: vcorr", "ratio"] < 0.7 and table.loc["K2: S to bf16", "ratio"] < 0.7
        assert "K2: wait for operands 1.49x" in out.split("more:")[1]


def test_profile_moves_of_the_first_tensor_core_stage_shows_it_alone(capsys):
    """Stage 04's fp32 kernels have regions of their own: stage 05's table is its own column, no ratio."""
    table = notebook.profile_moves("05").data
    assert list(table.columns) == ["05"] and "stage 05 alone" in capsys.readouterr().out
    assert table.loc["K2: loads / barriers", "05"] == pytest.approx(388668 / 128, rel=1e-3)
    with pytest.raises(ValueError, match="split path"):
        notebook.profile_moves("04")


def test_ideas_at_is_its_record_and_names_real_switches():
    """Stage 10's switches timed at B = 8 and at the seed's shape (RECORDS["ideas_at"]): each variant's time over
    the stage's in the same case, and every variant named for one of the stage's ABLATIONS (or all three)."""
    from common.stages import declared_records

    decl = declared_records("ideas_at")["10"]
    data = notebook.results.recorded(decl["file"])
    switches = {a.name for a in load_stage("10").ABLATIONS}
    assert set(decl["ideas"].values()) - {"all three"} <= switches
    t = notebook.ideas_at("10").data
    base = {r["path"]: r["fwd_graph_ms"] for r in data["rows"] if r["variant"] == "stage"}
    for r in data["rows"]:
        if r["variant"] != "stage":
            case = f"{r['path']} {bench.shape_label(r)}"
            got = t.loc[(case, decl["ideas"][r["variant"]]), "x slower without"]
            assert got == pytest.approx(r["fwd_graph_ms"] / base[r["path"]], rel=1e-12)
    assert t.loc[("fused8 B8 T1024 H64 K128 V128", "all three"), "x slower without"] > 1.1


def test_times_across_calls_lists_every_record_of_the_stage_alone(capsys):
    """Stage 07 at the seed's shape in every H200 record: its own call only (the paths tables' reference rows, the
    ladder's sweep, a tour), not another stage's rows nor another path; each file named in the printed lines."""
    t = notebook.times_across_calls("07").data
    out = capsys.readouterr().out
    assert len(t) >= 15 and t["GPU ms"].is_monotonic_increasing
    assert "results/h200/tc_stages.json" in set(t["record"])
    assert 0.20 < t["GPU ms"].min() and t["GPU ms"].max() < 0.23  # one kernel: no other stage's or path's time
    for rec in set(t["record"]):
        folder, name = rec.rsplit("/", 1)
        assert f"{folder}/ (" in out and name in out
    with pytest.raises(ValueError, match="no recorded GPU time"):
        notebook.times_across_calls("07", shape="B3 T5 H7 K128 V128")
