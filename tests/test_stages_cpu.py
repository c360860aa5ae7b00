"""Stages that run on the CPU (00, 01): checked against the fp64 reference and
the previous stage, forward and all eight gradients, outputs poisoned."""

import pytest
import torch

from common import checks
from common.metrics import rel_err
from common.stages import load_stage, stage_ids

CPU_STAGES = [s for s in stage_ids() if "cpu" in load_stage(s).SPEC.devices]


@pytest.mark.parametrize("sid", CPU_STAGES)
@pytest.mark.parametrize("case", checks.cpu_cases(), ids=lambda c: c.id)
def test_stage_matches_reference_and_previous(sid, case, cpu_check_rows):
    rows = cpu_check_rows(sid, case)
    names = {r["output"] for r in rows}
    assert {"o", "S"} <= names
    if load_stage(sid).SPEC.backward:
        assert {"dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"} <= names
        assert ("dinitial_state" in names) == case.h0
    bad = [r for r in rows if not r["ok"]]
    assert not bad, checks.format_rows(bad)


@pytest.mark.parametrize("sid", CPU_STAGES)
def test_output_final_state_false(sid):
    """Without the final state the output is the same, bit for bit."""
    kw = checks.case_inputs(checks.cpu_cases()[0])
    o1, S1 = load_stage(sid).forward(**kw)
    o0, S0 = load_stage(sid).forward(**dict(kw, output_final_state=False))
    assert S0 is None and S1 is not None and torch.equal(o0, o1)


@pytest.mark.parametrize("sid", CPU_STAGES)
def test_the_chunk_size_is_used(sid):
    """Chunks of 16 and 32 both match the token loop, and not bitwise (another
    summation order): a stage, or a contract, that ignores chunk_size fails."""
    r = checks.check_chunk_sizes(sid, checks.cpu_cases()[4], chunks=(16, 32), device="cpu")
    assert all(e <= r["tol"][n] for errs in r["err"].values() for n, e in errs.items()), r
    assert not r["equal"], "the outputs at chunks 16 and 32 are bitwise equal: chunk_size was ignored"


@pytest.mark.parametrize("sid", CPU_STAGES)
def test_the_lower_bound_is_used(sid):
    """The bounded gate's lower bound reaches the kernel: at -1, -2.5 and -5 the
    stage matches the token loop (forward and gradients), and the output moves
    with the bound (a stage that ignores or clamps lower_bound fails)."""
    outs = []
    for lb in (-1.0, -2.5, -5.0):
        case = checks.Case(2, 40, 1, 8, 12, chunk=16, gate="bounded", lower_bound=lb, seed=8)
        rows = checks.check_case(sid, case, device="cpu", prev=None)
        bad = [r for r in rows if not r["ok"]]
        assert not bad, checks.format_rows(bad)
        outs.append(load_stage(sid).forward(**checks.case_inputs(case))[0])
    for a, b in zip(outs, outs[1:]):
        assert rel_err(a, b) > 1e-2


@pytest.mark.parametrize("sid", CPU_STAGES)
def test_bf16_inputs_give_bf16_output(sid):
    kw = checks.make_inputs(1, 40, 1, 16, 16, seed=3, dtype=torch.bfloat16, chunk_size=16)
    o, S = load_stage(sid).forward(**kw)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32


@pytest.mark.parametrize("sid", CPU_STAGES)
def test_deterministic(sid):
    assert checks.check_deterministic(sid, checks.cpu_cases()[2])


def test_poison_catches_an_unwritten_output():
    """The check machinery itself: an output left unwritten must fail."""
    from common.contract import alloc, poisoned

    with poisoned():
        x = alloc((3, 4))
    assert torch.isnan(x).all()
    assert rel_err(x, torch.ones(3, 4)) == float("inf")


def test_stage_00_compiles_as_one_graph():
    """No timer or Python side effect on the forward path: torch.compile
    captures the whole forward (fullgraph) and computes the same thing."""
    torch._dynamo.reset()
    kw = checks.make_inputs(1, 40, 1, 8, 8, seed=1, chunk_size=16)
    stage = load_stage("00")
    o, S = torch.compile(stage.forward, fullgraph=True, backend="eager")(**kw)
    o0, S0 = stage.forward(**kw)
    assert torch.equal(o, o0) and torch.equal(S, S0)


def _nan_rows(o):
    return torch.isnan(o[0, :, 0]).any(-1).nonzero().flatten().tolist()


@pytest.mark.parametrize("where", ["g", "beta", "v"])
def test_a_nan_input_spreads_forward_in_time_only(where):
    """A NaN in token 20's input (chunk 16) reaches the outputs of tokens >= 20
    only, in stage 00, stage 01 and the token loop alike."""
    from common.reference import kda_reference

    kw = checks.make_inputs(1, 40, 1, 8, 8, seed=1, chunk_size=16)
    kw[where][0, 20, 0] = float("nan")
    want = _nan_rows(kda_reference(**kw)[0])
    assert want == list(range(20, 40))
    for sid in ("00", "01"):
        o, S = load_stage(sid).forward(**kw)
        assert _nan_rows(o) == want, sid
        assert torch.isnan(S).any()


@pytest.mark.parametrize("g_bad", [float("inf"), 1e38])
def test_an_infinite_gate_is_a_documented_limit(g_bad):
    """With softplus, g = +inf (or so large that the decay overflows) resets the
    state in the token loop, but makes the chunked form's decay differences
    -inf - (-inf) = NaN: tokens before it keep the reference's answer, the rest
    of the run is NaN, in stages 00 and 01 alike (stages/00_naive/README.md)."""
    from common.reference import kda_reference

    kw = checks.make_inputs(1, 40, 1, 8, 8, seed=1, chunk_size=16)
    kw["g"][0, 20, 0, 3] = g_bad
    ro, rS = kda_reference(**kw)
    assert torch.isfinite(ro).all() and torch.isfinite(rS).all()  # the token loop is fine
    for sid in ("00", "01"):
        o, S = load_stage(sid).forward(**kw)
        assert rel_err(o[:, :16], ro[:, :16]) < 1e-5, sid  # whole chunks before it: the reference's answer
        assert torch.isnan(o[:, 32:]).all() and torch.isnan(S).all(), sid
