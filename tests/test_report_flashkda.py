"""Where the tour's FlashKDA row says its error comes from: the commit its
checks rows were recorded at, not the first date of a file that holds several
runs (results/h200/checks.json dates 02-07 on 2026-11-29 and FlashKDA later)."""

from common import report, results


def _checks(rows, date="2026-11-29 13:37 UTC / 2026-12-01 16:45 UTC (08, 09)"):
    return {"meta": {"date": date}, "rows": rows}


def test_flashkda_error_names_the_commit_of_its_rows(monkeypatch):
    rows = [dict(stage=results.FLASHKDA, output="o", err_ref=6.1e-3, commit="d91b051"),
            dict(stage=results.FLASHKDA, output="S", err_ref=5.3e-3, commit="d91b051"),
            dict(stage="07_movm_register", output="o", err_ref=4.0e-3, commit="e6f356d")]
    monkeypatch.setattr(results, "recorded", lambda name, *a, **k: _checks(rows) if name == "checks" else None)
    err, where = report._flashkda_errors()
    assert err == 6.1e-3 and where == "checks.json, commit d91b051"


def test_flashkda_error_without_commits_falls_back_to_the_date(monkeypatch):
    rows = [dict(stage=results.FLASHKDA, output="o", err_ref=6.0e-3)]
    monkeypatch.setattr(results, "recorded", lambda name, *a, **k: _checks(rows, "2026-12-01 10:00 UTC") if name == "checks" else None)
    assert report._flashkda_errors() == (6.0e-3, "checks.json, 2026-12-01")
