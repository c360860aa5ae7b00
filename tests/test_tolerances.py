"""Each stage's tolerance sits at the level its check cases reach.

A stage declares, per output and per gradient, the relative error a check may
reach (StageSpec.tolerance in its stage.py). It must be met by the stage's own
check cases, and be at most 10x their worst, so that a change which makes an
output ten times less accurate fails its check. The CPU stages are measured
here, live; the GPU stages against the worst their check cases reached on the
H200 (results/h200/checks.json, the rows `kdalab check` and the GPU run record).

The reference's own constants are pinned too: its L2 epsilon against a value
worked out by hand, and stage 00's gate sum in float64 by the accuracy that
buys on a case where float32 loses it.
"""

import math
from collections import defaultdict

import pytest
import torch

from common import checks, results
from common.contract import GRADIENTS, OUTPUTS
from common.reference import L2_EPS, activate, kda_reference
from common.stages import ladder, load_stage

MAX_FACTOR = 10.0  # a tolerance is at most this many times the worst error of the stage's check cases
CPU_STAGES = [s.id for s in ladder() if "cpu" in s.SPEC.devices]
GPU_STAGES = [s.id for s in ladder() if "cpu" not in s.SPEC.devices]


def worst_by_output(rows) -> dict:
    """{output: the largest error of a row, against fp64 or the previous stage}."""
    out = defaultdict(float)
    for r in rows:
        for key in ("err_ref", "err_prev"):
            if r.get(key) is not None:
                out[r["output"]] = max(out[r["output"]], r[key])
    return dict(out)


def _at_the_measured_level(sid, worst: dict) -> list[str]:
    spec = load_stage(sid).SPEC
    bad = []
    for name in spec.outputs:
        tol, w = spec.tol(name), worst.get(name)
        if w is None:
            bad.append(f"{name}: no check case measured it")
        elif not w <= tol <= MAX_FACTOR * w:
            bad.append(f"{name}: tolerance {tol:g} against a worst error of {w:.2e} (must lie in [worst, "
                       f"{MAX_FACTOR:g} x worst] = [{w:.2e}, {MAX_FACTOR * w:.2e}])")
    return bad


@pytest.mark.parametrize("sid", [s.id for s in ladder()])
def test_every_stage_declares_a_tolerance_per_output(sid):
    spec = load_stage(sid).SPEC
    want = set(OUTPUTS + (GRADIENTS if spec.backward else ()))
    assert set(spec.tolerance) == want, f"stage {sid} declares {sorted(spec.tolerance)}, its outputs are {sorted(want)}"
    assert all(0 < v < 1e-2 for v in spec.tolerance.values()), spec.tolerance


@pytest.mark.parametrize("sid", CPU_STAGES)
def test_cpu_stage_tolerance_is_at_the_measured_level(sid, cpu_check_rows):
    """Measured here on the CPU check cases, every output and gradient."""
    rows = cpu_check_rows(sid)
    bad = _at_the_measured_level(sid, worst_by_output(rows))
    assert not bad, f"stage {sid}:\n" + "\n".join(bad)


@pytest.mark.parametrize("sid", GPU_STAGES)
def test_gpu_stage_tolerance_is_at_the_measured_level(sid):
    """Against the worst error the stage's check cases reached on the H200."""
    data = results.recorded("checks")
    name = load_stage(sid).SPEC.name
    rows = [r for r in data["rows"] if r.get("stage") == name and "err_ref" in r]
    assert rows, f"no recorded checks of {name} in results/h200/checks.json"
    bad = _at_the_measured_level(sid, worst_by_output(rows))
    assert not bad, f"stage {sid} ({results.label(data['meta'])}):\n" + "\n".join(bad)


def test_the_level_check_catches_a_loose_and_a_tight_tolerance():
    """Planted: the same worst errors against a tolerance 11x above them and one below them."""
    spec = load_stage("00").SPEC
    loose = {n: spec.tol(n) / 11 for n in spec.outputs}
    assert len(_at_the_measured_level("00", loose)) == len(spec.outputs)
    tight = {n: spec.tol(n) * 1.01 for n in spec.outputs}
    assert len(_at_the_measured_level("00", tight)) == len(spec.outputs)
    assert "no check case" in _at_the_measured_level("00", {})[0]


def test_a_reduced_gradient_also_meets_the_plain_fp32_bound():
    """dA_log and ddt_bias are judged against the size of their terms and, besides, by their plain
    relative error against fp64 (checks.PLAIN_BOUND = 1e-5, the bound of every fp32 gradient).
    Planted: a row within the term-scale tolerance whose plain error is 1.2e-5 (stage 04's dA_log
    with a float32 gate cumsum) fails; the same row at 1e-6 passes."""
    tol = load_stage("04").SPEC.tol("dA_log")
    row = dict(stage="04_warp", case="planted", output="dA_log", err_ref=tol / 10, err_prev=None, prev=None)
    assert checks.judge("04", dict(row, err_plain=1e-6))["ok"]
    assert not checks.judge("04", dict(row, err_plain=1.2e-5))["ok"]
    assert checks.PLAIN_BOUND == 1e-5


@pytest.mark.parametrize("sid", [s for s in GPU_STAGES if load_stage(s).SPEC.backward])
def test_recorded_reduced_gradients_meet_the_plain_bound(sid):
    """On the H200 (results/h200/checks.json): the worst plain relative error of dA_log and ddt_bias
    over the stage's GPU check cases is within 1e-5."""
    data = results.recorded("checks")
    name = load_stage(sid).SPEC.name
    rows = {r["output"]: r for r in data["rows"] if r.get("stage") == name and r["output"] in ("dA_log", "ddt_bias")}
    assert set(rows) == {"dA_log", "ddt_bias"}, f"{name}: no recorded dA_log / ddt_bias check"
    for out, r in rows.items():
        assert r.get("err_plain") is not None, f"{name} {out}: recorded without its plain error"
        assert r["err_plain"] <= checks.PLAIN_BOUND, f"{name} {out}: plain error {r['err_plain']:.2e}"


# --------------------------------------------------------------------------
# the reference's constants
# --------------------------------------------------------------------------

def test_the_reference_l2_epsilon_is_pinned():
    """q / sqrt(|q|^2 + 1e-6), worked out by hand for a query whose squared norm is the epsilon itself
    (FLA's l2norm takes the same 1e-6): each entry of the normalised vector is 1e-3 / sqrt(2e-6) / 2."""
    assert L2_EPS == 1e-6
    q = torch.full((1, 1, 1, 4), 0.5e-3, dtype=torch.float64)  # |q|^2 = 1e-6
    z = torch.zeros(1, 1, 1, dtype=torch.float64)
    qn, kn, _, _ = activate(q, q, q, z, torch.zeros(1, dtype=torch.float64), torch.zeros(1, 4, dtype=torch.float64))
    want = 0.5e-3 / math.sqrt(2e-6)
    assert torch.allclose(qn, torch.full_like(qn, want), rtol=1e-14, atol=0)
    assert torch.allclose(kn, torch.full_like(kn, want), rtol=1e-14, atol=0)


def test_a_token_by_hand_pins_the_normalisation_end_to_end():
    """One token, no initial state: o = scale * beta * (k_n . q_n) v. With |q|^2 = |k|^2 = 1e-6 the
    normalised dot product is 1/2, which a different epsilon moves far past any tolerance."""
    K = 4
    q = torch.full((1, 1, 1, K), 0.5e-3, dtype=torch.float64)
    v = torch.arange(1.0, K + 1, dtype=torch.float64).reshape(1, 1, 1, K)
    zero = torch.zeros(1, 1, 1, K, dtype=torch.float64)
    o, _ = kda_reference(q, q, v, zero, torch.zeros(1, 1, 1, dtype=torch.float64), A_log=torch.zeros(1),
                         dt_bias=torch.zeros(1, K), gate="bounded", lower_bound=-5.0)
    want = K ** -0.5 * 0.5 * 0.5 * v  # scale * sigmoid(0) * (q_n . k_n) * v
    assert torch.allclose(o, want, rtol=1e-12, atol=0)


def _strong_gate_case():
    """64-token chunks with a strong softplus gate: the gate sum reaches a few hundred inside a chunk,
    where float32 keeps only ~5 decimal digits of the differences gc_c - gc_i."""
    return checks.Case(2, 128, 2, 16, 16, chunk=64, gate="softplus", seed=61)


def test_stage_00_keeps_the_gate_sum_in_float64():
    """Stage 00 sums the gate in float64 (stages/00_naive/stage.py). On a case where a float32 sum loses
    digits, every output and gradient stays within the stage's tolerance; summed in float32, dg, dA_log
    and ddt_bias come out 3-7x above it (scripts/plant_bugs.py plants it)."""
    rows = checks.check_case("00", _strong_gate_case(), device="cpu", prev=None)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, checks.format_rows(bad)
