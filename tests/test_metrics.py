"""The error metric never reports a pass it cannot vouch for."""

import math

import pytest
import torch

from common.checks import summarize, vs_previous
from common.metrics import TOLERANCE, rel_err, worst


def test_relative_error_of_a_known_difference():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert rel_err(ref * (1 + 1e-4), ref) == pytest.approx(1e-4, rel=1e-9)
    assert rel_err(ref, ref) == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_output_is_inf(bad):
    assert rel_err(torch.tensor([1.0, bad]), torch.tensor([1.0, 2.0])) == math.inf


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reference_is_inf(bad):
    assert rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, bad])) == math.inf


def test_zero_reference_is_flagged_not_zero():
    """A relative error against a zero reference is undefined: inf, even when
    the output is zero too (such a check case checks nothing)."""
    assert rel_err(torch.zeros(3), torch.zeros(3)) == math.inf
    assert rel_err(torch.full((3,), 1e-30), torch.zeros(3)) == math.inf
    assert rel_err(torch.zeros(0), torch.zeros(0)) == math.inf


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_err(torch.zeros(2), torch.zeros(3))


def test_worst_keeps_nan_and_inf():
    assert worst([1e-7, float("nan"), 2e-7]) == math.inf
    assert worst([float("nan"), 0.0]) == math.inf  # max(0.0, nan) would be 0.0
    assert worst([1e-7, None, 3e-7]) == 3e-7
    assert worst([None]) is None


def test_summary_of_a_nan_row_is_not_zero():
    rows = [dict(stage="s", output="o", err_ref=float("nan"), err_prev=None, prev="p", tol=1e-5, ok=False),
            dict(stage="s", output="o", err_ref=1e-7, err_prev=float("nan"), prev="p", tol=1e-5, ok=False)]
    (w,) = summarize(rows)
    assert w["err_ref"] == math.inf and w["err_prev"] == math.inf and not w["ok"]


def test_tolerances_are_those_of_the_design():
    """fp32 stages near 1e-6 must stay under 1e-5; bf16 stages under 5e-3 (DESIGN.md section 6)."""
    assert TOLERANCE == {"fp32": 1e-5, "bf16": 5e-3}


def test_summary_keeps_a_row_per_stage_compared_with():
    """Stage 12 is compared with stage 11 (bounded gate) and stage 04 (softplus gate): the summary keeps
    a row for each, so that stage 11's bits (0 difference) are not hidden by the larger difference
    from 04; the one-line summary (vs_previous) names the ladder's previous stage where there is one."""
    rows = [dict(stage="12_softplus", output="o", err_ref=1e-3, err_prev=0.0, prev="11_varlen", tol=5e-3, ok=True),
            dict(stage="12_softplus", output="o", err_ref=2e-3, err_prev=4e-3, prev="04_warp", tol=5e-3, ok=True),
            dict(stage="12_softplus", output="o", err_ref=3e-3, err_prev=0.0, prev="11_varlen", tol=5e-3, ok=True)]
    by = {w["prev"]: w for w in summarize(rows)}
    assert set(by) == {"11_varlen", "04_warp"}
    assert (by["11_varlen"]["err_prev"], by["11_varlen"]["err_ref"], by["11_varlen"]["cases"]) == (0.0, 3e-3, 2)
    assert (by["04_warp"]["err_prev"], by["04_warp"]["cases"]) == (4e-3, 1)
    assert vs_previous(summarize(rows)) == (0.0, "11_varlen")
    assert vs_previous(rows[1:2]) == (4e-3, "04_warp")
    assert vs_previous([dict(rows[0], err_prev=None)]) == (None, None)


def test_a_stage_readme_shows_a_row_per_stage_compared_with(monkeypatch):
    from common import report, results

    rows = [dict(stage="12_softplus", output="o", err_ref=4.1e-3, err_prev=0.0, prev="11_varlen", tol=5e-3, ok=True,
                 cases=7),
            dict(stage="12_softplus", output="o", err_ref=3.9e-3, err_prev=4.2e-3, prev="04_warp", tol=5e-3, ok=True,
                 cases=4)]
    data = dict(meta=dict(device="GPU", date="2026-12-06 02:09 UTC", commit="abc1234"), rows=rows)
    monkeypatch.setattr(results, "recorded", lambda name, sub="h200": data if (name, sub) == ("checks", "h200") else None)
    md = report.stage_measured_markdown("12_softplus")
    assert "| compared with | difference | cases |" in md
    assert "| o | 4.10e-03 | 11_varlen | 0.00e+00 | 7 |" in md and "| o | 3.90e-03 | 04_warp | 4.20e-03 | 4 |" in md
