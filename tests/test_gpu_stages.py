"""GPU checks of the CUDA stages (marked gpu: skipped with a reason where no GPU
is visible; on the H200 run `pytest -m gpu`). Each stage against the fp64
reference and the previous stage, forward and all gradients, on shapes with
K != V, T not a multiple of the chunk, B*H above the SM count, h0 absent;
outputs poisoned; two forward runs bitwise identical."""

import pytest
import torch

from common import checks
from common.metrics import rel_err
from common.stages import load_stage, previous, selected_ids

# KDALAB_STAGES=05,06 limits the run to some stages (a student re-checking one stage).
GPU_STAGES = [s for s in selected_ids() if load_stage(s).SPEC.devices == ("cuda",)]
FP32 = [s for s in GPU_STAGES if load_stage(s).SPEC.compute_dtype == torch.float32]
TC = [s for s in GPU_STAGES if load_stage(s).SPEC.compute_dtype == torch.bfloat16]

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("sid", FP32)
@pytest.mark.parametrize("case", checks.gpu_cases(), ids=lambda c: c.id)
def test_fp32_stage(sid, case):
    rows = checks.check_case(sid, case, device="cuda")
    bad = [r for r in rows if not r["ok"]]
    assert len(rows) >= 9 + case.h0
    assert not bad, checks.format_rows(bad)


@pytest.mark.parametrize("sid", TC)
@pytest.mark.parametrize("case", checks.tc_cases(), ids=lambda c: c.id)
def test_tensor_core_stage(sid, case):
    rows = checks.check_case(sid, case, device="cuda")
    bad = [r for r in rows if not r["ok"]]
    assert not bad, checks.format_rows(bad)


SOFTPLUS_TC = [s for s in TC if "softplus" in load_stage(s).SPEC.gates]


@pytest.mark.parametrize("sid", SOFTPLUS_TC)
@pytest.mark.parametrize("case", checks.tc_softplus_cases(), ids=lambda c: c.id)
def test_tensor_core_stage_softplus(sid, case):
    """The softplus gate on the tensor cores (no lower bound; the extremes: A_log up to 3,
    g + dt_bias in [-20, 20], a chunk at a = -400 per token): against fp64 and against the
    nearest earlier stage that takes the gate (stage 04, fp32; none at the extremes, where
    every earlier stage overflows), every output finite (rel_err is inf otherwise)."""
    rows = checks.check_case(sid, case, device="cuda")
    bad = [r for r in rows if not r["ok"]]
    assert rows and all(r["prev"] == (None if case.extreme else "04_warp") for r in rows)
    assert not bad, checks.format_rows(bad)


@pytest.mark.parametrize("sid", SOFTPLUS_TC)
@pytest.mark.parametrize("case", checks.tc_softplus_cases(), ids=lambda c: c.id)
def test_softplus_at_most_flas_error(sid, case):
    """Issue 21: o and the final state no further from the fp64 loop than FLA's chunk_kda
    (softplus gate, safe_gate=False) on the same bf16 inputs, and o within 5e-3, on every
    softplus check case (FLA run on groups of the head counts it was tuned at: by_heads)."""
    from common.fla_ref import FLA_TUNED_HEADS, by_heads, fla_available, fla_forward
    from common.reference import kda_reference

    ok, why = fla_available()
    if not ok:
        pytest.skip(why)
    inp = checks.case_inputs(case, "cpu", torch.bfloat16)
    got = checks.run(load_stage(sid).forward, inp, "cuda", backward=False)
    fla = checks.run(by_heads(fla_forward, FLA_TUNED_HEADS[case.K]), inp, "cuda", backward=False)
    ref = checks.run(kda_reference, inp, "cuda", backward=False, dtype=torch.float64)
    errs = {n: (rel_err(got[n], ref[n]), rel_err(fla[n], ref[n])) for n in ("o", "S")}
    assert errs["o"][0] <= 5e-3, errs
    assert all(mine <= theirs for mine, theirs in errs.values()), errs


@pytest.mark.parametrize("sid", [s for s in SOFTPLUS_TC if hasattr(load_stage(s), "u_halves")])
@pytest.mark.parametrize("case", checks.tc_cases(quick=True) + checks.tc_softplus_cases(quick=True),
                         ids=lambda c: c.id)
def test_u_in_two_halves_is_closer_to_fp64(sid, case):
    """u = Af @ v with Af in two bf16 halves (u_halves(True): the default of a gate without a
    bound) against Af rounded once (u_halves(False), stage 11's u: the bounded gate's default),
    either gate: both within tolerance of fp64, not bitwise equal (the pin picked another
    instantiation), and the halves nearer fp64 in both o and the state; each gate's default
    is the instantiation it names."""
    from common.metrics import tolerance
    from common.reference import kda_reference

    stage = load_stage(sid)
    inp = checks.case_inputs(case, "cpu", torch.bfloat16)
    ref = checks.run(kda_reference, inp, "cuda", backward=False, dtype=torch.float64)
    default = checks.run(stage.forward, inp, "cuda", backward=False)
    with stage.u_halves(True):
        got = checks.run(stage.forward, inp, "cuda", backward=False)
    with stage.u_halves(False):
        once = checks.run(stage.forward, inp, "cuda", backward=False)
    want = once if case.gate == "bounded" else got
    assert torch.equal(default["o"], want["o"]) and torch.equal(default["S"], want["S"])
    errs = {n: (rel_err(got[n], ref[n]), rel_err(once[n], ref[n])) for n in ("o", "S")}
    assert max(max(e) for e in errs.values()) <= tolerance("bf16"), errs
    assert not torch.equal(got["S"], once["S"])
    assert all(halves < one for halves, one in errs.values()), errs


# The first stage to take the softplus gate on the tensor cores (its predecessor takes the bounded gate only).
FIRST_SOFTPLUS_TC = [s for s in SOFTPLUS_TC if previous(s) in TC and previous(s) not in SOFTPLUS_TC]


@pytest.mark.parametrize("sid", FIRST_SOFTPLUS_TC)
@pytest.mark.parametrize("case", checks.tc_cases(), ids=lambda c: c.id)
def test_bounded_gate_is_stage_11_bitwise(sid, case):
    """On the bounded gate the softplus stage runs its predecessor's instantiation (factored products,
    u rounded once): o and the final state bit for bit the previous stage's, on every bounded check
    case (B > 1 with h0, tails, K != V). When a GPU record shows it, the stage declares
    SAME_BITS_AS_PREVIOUS and every check holds it."""
    inp = checks.case_inputs(case, "cpu", torch.bfloat16)
    got = checks.run(load_stage(sid).forward, inp, "cuda", backward=False)
    want = checks.run(load_stage(previous(sid)).forward, inp, "cuda", backward=False)
    diff = {n: rel_err(got[n], want[n]) for n in ("o", "S")}
    assert torch.equal(got["o"], want["o"]) and torch.equal(got["S"], want["S"]), diff


@pytest.mark.parametrize("sid", [s for s in SOFTPLUS_TC if hasattr(load_stage(s), "pairwise")])
@pytest.mark.parametrize("case", checks.tc_cases(quick=True), ids=lambda c: c.id)
def test_pairwise_products_on_the_bounded_gate(sid, case):
    """The pairwise products pinned on a bounded-gate case: within tolerance of fp64 and
    of the factored products (the stage's default there), and not bitwise equal to them
    (the pin reached the kernel)."""
    stage = load_stage(sid)
    inp = checks.case_inputs(case, "cpu", torch.bfloat16)
    fac = checks.run(stage.forward, inp, "cuda", backward=False)
    with stage.pairwise(True):
        rows = checks.check_case(sid, case, device="cuda", prev=None)
        pw = checks.run(stage.forward, inp, "cuda", backward=False)
    assert not [r for r in rows if not r["ok"]], checks.format_rows(rows)
    assert not torch.equal(pw["o"], fac["o"])
    assert rel_err(pw["o"], fac["o"]) <= 5e-3


@pytest.mark.parametrize("sid", [s for s in SOFTPLUS_TC if hasattr(load_stage(s), "wide_chunks")])
def test_pairwise_only_where_a_chunk_needs_it(sid):
    """The softplus gate with one wide chunk among narrow ones (checks.one_wide_chunk_inputs):
    the default (pairwise in that chunk, factored in the rest) and the pairwise products
    pinned in every chunk are both finite and within the
    bf16 tolerance of fp64 (the factored products in the wide chunk would overflow), and
    not bitwise equal (the narrow chunks took the factored products)."""
    from common.metrics import tolerance
    from common.reference import kda_reference, log_decay

    stage = load_stage(sid)
    inp = checks.one_wide_chunk_inputs()  # its setup is held on the CPU (test_pairwise_scheme.py)
    wide, total = stage.wide_chunks(log_decay(*(inp[n].double() for n in ("g", "A_log", "dt_bias"))))
    assert wide == 1 and total > 1, (wide, total)
    ref = checks.run(kda_reference, inp, "cuda", backward=False, dtype=torch.float64)
    got = checks.run(stage.forward, inp, "cuda", backward=False)
    with stage.pairwise(True):
        pw = checks.run(stage.forward, inp, "cuda", backward=False)
    tol = tolerance("bf16")
    for out in (got, pw):
        assert all(torch.isfinite(out[n]).all() for n in ("o", "S"))
        errs = {n: rel_err(out[n], ref[n]) for n in ("o", "S")}
        assert max(errs.values()) <= tol, errs
    assert not torch.equal(got["o"], pw["o"])


@pytest.mark.parametrize("sid", [s for s in SOFTPLUS_TC if hasattr(load_stage(s), "pairwise")])
def test_factored_products_refuse_the_softplus_gate(sid):
    """exp(-gc) overflows without a bound: pinning the factored products on the softplus
    gate is refused by name in Python, before the extension."""
    stage = load_stage(sid)
    inp = checks.case_inputs(checks.tc_softplus_cases()[0], "cuda", torch.bfloat16)
    with stage.pairwise(False), pytest.raises(ValueError, match=r"pairwise\(False\)"):
        stage.forward(**inp)


@pytest.mark.parametrize("sid", FP32)
def test_fp32_stage_uses_the_chunk_size(sid):
    """Chunks of 16 and 64 both within tolerance of fp64, and not bitwise equal
    (tests/test_stages_cpu.py::test_the_chunk_size_is_used, on the GPU)."""
    case = checks.Case(2, 300, 3, 64, 48, chunk=64, gate="softplus", seed=18)
    r = checks.check_chunk_sizes(sid, case, chunks=(16, 64), device="cuda")
    assert all(e <= r["tol"][n] for errs in r["err"].values() for n, e in errs.items()), r
    assert not r["equal"], "the outputs at chunks 16 and 64 are bitwise equal: chunk_size was ignored"


@pytest.mark.parametrize("sid", GPU_STAGES)
def test_forward_bitwise_deterministic(sid):
    cases = checks.cases_for(load_stage(sid).SPEC, "cuda")
    assert checks.check_deterministic(sid, checks.determinism_case(cases), device="cuda")


@pytest.mark.parametrize("sid", TC)
@pytest.mark.parametrize("case", checks.fla_cases(), ids=lambda c: c.id)
def test_tensor_core_stage_against_fla(sid, case):
    from common.fla_ref import fla_available

    ok, why = fla_available()
    if not ok:
        pytest.skip(why)
    rows = checks.check_against_fla(sid, case)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, checks.format_rows(bad)


MOVM = [s for s in TC if hasattr(load_stage(s), "frag_check")]


@pytest.mark.parametrize("sid", MOVM)
@pytest.mark.parametrize("kd", [16, 64, 128])
def test_movmatrix_fragment_identity(sid, kd):
    """gemm(A, movm(X held as an accumulator)) == A @ X, not A @ X^T: X is not
    symmetric, so a transposed or misplaced fragment shows up at once."""
    gen = torch.Generator().manual_seed(kd)
    A = torch.randn(16, kd, generator=gen).to("cuda", torch.bfloat16)
    X = torch.randn(kd, 16, generator=gen).to("cuda")
    out = load_stage(sid).frag_check(A, X)
    want = A.double() @ X.to(torch.bfloat16).double()
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < 1e-6, err
    if kd == 16:  # and it is not A @ X^T
        wrong = A.double() @ X.to(torch.bfloat16).double().t()
        assert ((out.double() - wrong).norm() / wrong.norm()).item() > 0.1


@pytest.mark.parametrize("sid", GPU_STAGES)
def test_the_chapters_check_cell_fails_a_planted_bug(sid, monkeypatch):
    """The check cell of each chapter (nb.error_table, live on the GPU, quick cases) passes on the stage as
    it is and raises when its o is off by 3x its tolerance: a student who breaks a stage sees its notebook
    go red on the GPU too."""
    from common import notebook as nb

    stage = load_stage(sid)
    nb.error_table(sid, quick=True)
    real, eps = stage.forward, 3 * stage.SPEC.tol("o")

    def planted(*a, **k):
        o, S = real(*a, **k)
        return (o.float() * (1 + eps)).to(o.dtype), S

    monkeypatch.setattr(stage, "forward", planted)
    with pytest.raises(nb.CheckFailed, match=rf"{stage.SPEC.name} \(live on cuda"):
        nb.error_table(sid, quick=True)
