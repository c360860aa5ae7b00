"""What a notebook or the tour does live on a GPU, tested without one: the
time budget of a latency sweep and the opt-in, announced live FLA timing."""

import pytest

from common import bench, notebook


def _row(stage, T, fwd_ms, bwd_ms=None):
    return dict(stage=stage, B=2, T=T, H=4, K=64, V=64, fwd_ms=fwd_ms, bwd_ms=bwd_ms)


def test_predicted_seconds_follow_the_timing_rules():
    assert bench.predicted_s(_row("s", 128, 0.01)) == 1.0  # short: a budget of repetitions and a graph
    assert bench.predicted_s(_row("s", 128, 100.0)) == pytest.approx(0.5)  # long: 5 calls
    assert bench.predicted_s(_row("s", 128, 3000.0, 8000.0)) == pytest.approx(33.0)  # very long: 3 calls each
    assert bench.predicted_s(dict(stage="s", error="oom")) is None


def test_fit_budget_times_what_fits_and_shows_the_rest_recorded():
    """Stage 02's recorded sweep: within 30 s only T=128 and T=512 are timed live."""
    rec = [_row("02", 128, 225, 486), _row("02", 512, 998, 2070), _row("02", 2048, 3234, 8603),
           _row("02", 8192, 14740, 33430)]
    shapes = [dict(B=2, T=t, H=4, K=64, V=64) for t in (128, 512, 2048, 8192)]
    live, skipped, need, rest = bench.fit_budget("02", shapes, rec, 30.0)
    assert [s["T"] for s in live] == [128, 512]
    assert [r["T"] for r in skipped] == [2048, 8192]
    assert need == pytest.approx(5 * (0.225 + 0.486) + 3 * (0.998 + 2.07)) and rest > 100
    live, skipped, _, _ = bench.fit_budget("03", shapes, rec, 30.0)  # no recorded time: every shape is timed
    assert len(live) == 4 and not skipped


def test_live_fla_is_opt_in(monkeypatch):
    monkeypatch.setattr(notebook, "fla_available", lambda: (True, ""))
    monkeypatch.delenv(notebook.LIVE_FLA_ENV, raising=False)
    ok, why = notebook.fla_live()
    assert not ok and "opt-in" in why and notebook.LIVE_FLA_ENV in why
    monkeypatch.setenv(notebook.LIVE_FLA_ENV, "1")
    assert notebook.fla_live() == (True, "")
    monkeypatch.setattr(notebook, "fla_available", lambda: (False, "fla-core is not installed"))
    assert notebook.fla_live() == (False, "fla-core is not installed")


def test_live_fla_is_announced_before_it_starts_once_per_family(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(notebook, "_FLA_ANNOUNCED", set())
    monkeypatch.setattr(notebook, "_LIVE", {})
    monkeypatch.setattr(bench, "sweep", lambda ids, shapes, **kw: calls.append(capsys.readouterr().out) or [])
    shapes = bench.TC_GPU_SHAPES
    notebook._live_sweep("fla", shapes, tc=True)
    (before,) = calls
    assert "autotunes its Triton kernels" in before and "4 new here" in before  # said before the sweep ran
    notebook._LIVE.clear()
    notebook._live_sweep("fla", shapes, tc=True)
    assert "autotunes" not in calls[1]  # the same families: said once
