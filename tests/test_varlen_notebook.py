"""The notebook helpers of packed sequences (stage 11): the fp64 demonstration
that a packed call is each sequence alone (common.notebook.varlen_demo, on the
CPU), the recorded packed-sequence table and its figure (varlen_table,
varlen_plot, from results/h200/stage11/varlen_hybrid_dacff50.json), and the live branch
with a stand-in for scripts/bench_varlen.py."""

import copy

import pytest

from common import notebook, stages
from common.contract import StageSpec

REC = stages.varlen_record("11")


def test_the_record_is_registered():
    assert stages.declared_records("varlen") == {"11": "stage11/varlen_hybrid_dacff50"}  # stage 11's stage.py
    assert REC["meta"]["device"] == "NVIDIA H200" and len(REC["rows"]) == 37  # stages 11 and 12
    assert stages.varlen_record("10") is None


def test_packed_is_each_sequence_alone_on_the_reference(capsys):
    df = notebook.varlen_demo(lengths=(5, 0, 17, 9), H=2, K=64, V=64).data
    out = capsys.readouterr().out
    assert list(df["length"]) == [5, 0, 17, 9] and df.loc[1, "tokens"] == "(empty)"
    assert (df["packed vs alone: max |o diff|"].fillna(0) == 0).all()  # exactly: the same sums
    assert (df["packed vs alone: max |S diff|"] == 0).all()  # the empty sequence keeps its h0
    one = df["one long sequence vs alone: o rel. error"]
    assert one[0] == 0 and one[2] > 1e-2 and one[3] > 1e-2  # the state runs on across a boundary
    assert "cu_seqlens = [0, 5, 5, 22, 31]" in out and "V-first final states" in out


@pytest.fixture
def recorded(monkeypatch):
    """The notebook reads a copy of the recorded file, which a test may change."""
    data = copy.deepcopy(REC)
    monkeypatch.setattr(notebook, "varlen_record", lambda sid="11": data if sid == "11" else None)
    monkeypatch.setattr(notebook, "_VARLEN", {})
    return data


def test_the_recorded_table_is_the_file(recorded, capsys):
    df = notebook.varlen_table("11").data
    out = capsys.readouterr().out
    assert "Recorded on NVIDIA H200" in out and "commit dacff50" in out
    # stage 11's rows only (not stage 12's): per mix FlashKDA, both layouts, two pins; the loop at the first
    assert len(df) == 21 and set(df["where"]) == {"recorded"}
    assert list(df.index.get_level_values("mix").unique()) == ["flashkda", "serving64", "long+short", "few-long"]
    assert not any("12_softplus" in i for i in df.index.get_level_values("impl"))
    fk = ("flashkda", 6, 8192, 96)
    assert df.loc[fk + ("11_varlen (V-first state)",), "x FlashKDA"] == pytest.approx(0.677, abs=0.0005)
    assert df.loc[fk + ("11_varlen (K-first state)",), "GPU ms"] == pytest.approx(0.9566, abs=5e-05)
    assert df.loc[fk + ("10_smem_diet once per sequence (6 calls)",), "GPU ms"] == pytest.approx(1.2682, abs=5e-05)
    assert df.loc[fk + ("FlashKDA",), "o err vs fp64"] == pytest.approx(0.00598, abs=5e-06)
    sv = ("serving64", 64, 61362, 32, "11_varlen (V-first state)")
    assert df.loc[sv, "x FlashKDA"] == pytest.approx(0.734, abs=0.0005)
    ls = ("long+short", 49, 20239, 32)
    assert df.loc[ls + ("11_varlen (V-first state)",), "S err vs fp64"] == pytest.approx(0.00287, abs=5e-06)
    assert df.loc[ls + ("11_varlen (V-first state)",), "x FlashKDA"] == pytest.approx(0.618, abs=0.0005)  # the hybrid
    no_hybrid = ls + ("11_varlen (V-first state) long_from=0",)
    assert df.loc[no_hybrid, "x FlashKDA"] == pytest.approx(0.827, abs=0.0005)  # without it


def test_the_plot_has_every_bar_and_says_n_a(recorded):
    ax = notebook.varlen_plot("11")
    texts = [t.get_text() for t in ax.texts]
    assert {"1.408", "0.953", "1.268", "3.009", "2.207", "1.925", "1.19", "1.592", "2.815", "1.999"} <= set(texts)
    assert texts.count("n/a") == 3  # the per-sequence loop was timed at the first mix only
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "FlashKDA", "11_varlen (V-first state)", "without the hybrid (long_from=0)", "10_smem_diet once per sequence"]
    assert "recorded on NVIDIA H200, 2026-12-02, commit dacff50" in ax.get_title()


def test_live_on_a_gpu_measures_one_mix_and_shows_the_rest_recorded(recorded, monkeypatch, capsys):
    """On a GPU (stood in for here): scripts/bench_varlen.py at the first mix, the other mixes recorded,
    measured once per session."""
    monkeypatch.setattr(StageSpec, "runnable_here", lambda self: (True, ""))
    calls = []

    def fake(sid):
        calls.append(sid)
        return [dict(r, gpu_ms=r["gpu_ms"] / 2) for r in recorded["rows"] if r["mix"] == "flashkda"], ""

    monkeypatch.setattr(notebook, "_varlen_live", fake)
    df = notebook.varlen_table("11").data
    out = capsys.readouterr().out
    assert calls == ["11"] and "mix flashkda: measured live" in out
    where = df.reset_index().groupby("mix")["where"].agg(set)
    assert where["flashkda"] == {"live"} and where["serving64"] == where["long+short"] == {"recorded"}
    assert df.loc[("flashkda", 6, 8192, 96, "FlashKDA"), "GPU ms"] == pytest.approx(1.40757 / 2, rel=1e-4)
    ax = notebook.varlen_plot("11")  # the same measurement, not a second one
    assert calls == ["11"] and "live and recorded rows" in ax.get_title()


def test_a_failed_live_run_falls_back_to_the_record(recorded, monkeypatch, capsys):
    monkeypatch.setattr(StageSpec, "runnable_here", lambda self: (True, ""))
    monkeypatch.setattr(notebook, "_varlen_live", lambda sid: ([], "the live run failed (exit 2: x): every mix "
                                                                   "recorded"))
    df = notebook.varlen_table("11").data
    out = capsys.readouterr().out
    assert "the live run failed" in out and set(df["where"]) == {"recorded"} and len(df) == 21
