"""GPU checks of the CUDA stages (marked gpu: skipped with a reason where no GPU
is visible; on the H200 run `pytest -m gpu`). Each stage against the fp64
reference and the previous stage, forward and all gradients, on shapes with
K != V, T not a multiple of the chunk, B*H above the SM count, h0 absent;
outputs poisoned; two forward runs bitwise identical."""

import os

import pytest
import torch

from common import checks
from common.stages import load_stage, stage_ids

# KDALAB_STAGES=05,06 limits the run to some stages (a student re-checking one stage).
_ONLY = [s for s in os.environ.get("KDALAB_STAGES", "").split(",") if s]
GPU_STAGES = [s for s in stage_ids() if load_stage(s).SPEC.devices == ("cuda",) and (not _ONLY or s in _ONLY)]
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


@pytest.mark.parametrize("sid", FP32)
def test_fp32_stage_uses_the_chunk_size(sid):
    """Chunks of 16 and 64 both within tolerance of fp64, and not bitwise equal
    (tests/test_stages_cpu.py::test_the_chunk_size_is_used, on the GPU)."""
    case = checks.Case(2, 300, 3, 64, 48, chunk=64, gate="softplus", seed=18)
    r = checks.check_chunk_sizes(sid, case, chunks=(16, 64), device="cuda")
    assert all(e <= r["tol"] for errs in r["err"].values() for e in errs.values()), r
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
