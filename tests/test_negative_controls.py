"""A check is only as good as the bug it catches: planted wrong stages must be
flagged, by common.checks and by `kdalab check` (CPU only).

Each planted stage wraps a correct one (stage 00, or a copy of a stage
directory for the command line) and breaks one thing a real kernel could get
wrong."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from common import checks, extrun
from common.contract import StageSpec, alloc, poisoned, poisoning, prepare
from common.metrics import tolerance
from common.paths import REPO_ROOT
from common.stages import load_stage, previous, stage_ids

RAGGED = checks.Case(1, 37, 2, 16, 24, chunk=16, gate="softplus", seed=1)  # T not a multiple of the chunk
ALIGNED = checks.Case(1, 64, 2, 16, 24, chunk=16, gate="softplus", seed=1)
BOUNDED = checks.Case(2, 40, 1, 32, 32, chunk=16, gate="bounded", lower_bound=-5.0, h0=False, seed=2)


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
@pytest.mark.parametrize("regime", ["cpu_cases", "gpu_cases", "tc_cases"])
def test_case_sets_cover_the_combinations(regime, quick):
    """A bug shows only on a case that combines what it gets wrong: every set,
    and its quick subset (`kdalab check --quick`), has B > 1 with h0 and a tail
    (each sequence its own initial state and dh0); every full set h0 absent
    too, a seed per case and three lower bounds; the fp32 sets K != V, both
    gates and every chunk size; the tensor-core set only shapes those stages
    take (K = V in {64, 128}, bounded gate, chunk 16), B > 1 with h0 and a tail
    at both head sizes, and modest shapes (T <= 1000, B*H <= 512)."""
    cases = getattr(checks, regime)(quick)

    def batched(c):
        return c.B > 1 and c.h0 and c.T % c.chunk != 0

    assert any(batched(c) for c in cases)
    assert set(cases) <= set(getattr(checks, regime)())
    if quick:
        return
    if regime != "cpu_cases":  # the determinism check runs on more (batch, head) pairs than the H200 has SMs
        assert checks.determinism_case(cases).B * checks.determinism_case(cases).H > 132
    assert any(not c.h0 for c in cases) and len({c.seed for c in cases}) == len(cases)
    assert len({c.lower_bound for c in cases if c.gate == "bounded"}) >= 3
    if regime == "tc_cases":
        assert all(c.gate == "bounded" and c.chunk == 16 and c.K == c.V and c.K in (64, 128) for c in cases)
        assert all(c.T <= 1000 and c.B * c.H <= 512 for c in cases)
        assert {c.K for c in cases if batched(c)} == {64, 128}
    else:
        assert {c.gate for c in cases if batched(c) and c.K != c.V} == {"softplus", "bounded"}
        assert {c.chunk for c in cases} == {16, 32, 64} and any(c.K != c.V and not c.h0 for c in cases)


class _FlipGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class Planted:
    """Stage 00 with one thing broken by ``mutate(forward, kw) -> (o, S)``;
    ``spec`` changes its SPEC (compute_dtype=torch.bfloat16: checked as a bf16
    stage)."""

    def __init__(self, name, mutate, **spec):
        self.base = load_stage("00")
        self.SPEC = dataclasses.replace(self.base.SPEC, name=name, **spec)
        self._mutate = mutate

    def forward(self, q, k, v, g, beta, **kw):
        return self._mutate(self.base.forward, dict(q=q, k=k, v=v, g=g, beta=beta, **kw))


def _off_by_1e4(fwd, kw):
    o, S = fwd(**kw)
    return o * (1 + 1e-4), S


def _flip_dbeta(fwd, kw):
    return fwd(**dict(kw, beta=_FlipGrad.apply(kw["beta"])))


def _unwritten_tail(fwd, kw):
    """Writes only the whole chunks of o: the tail is whatever alloc left there."""
    o, S = fwd(**kw)
    T, BT = o.shape[1], kw["chunk_size"]
    full = T // BT * BT
    tail = alloc((o.shape[0], T - full) + tuple(o.shape[2:]), o.dtype, o.device)
    return torch.cat([o[:, :full], tail], dim=1), S


def _wrong_state(fwd, kw):
    o, S = fwd(**kw)
    return o, S.roll(1, dims=-1)  # an index off by one in the state's columns


def _noisy(fwd, kw):
    o, S = fwd(**kw)
    return o + 1e-8 * torch.randn_like(o), S  # far inside the tolerance, but not deterministic


def _raw_padding(fwd, kw):
    """Pads the raw inputs to whole chunks with zeros and crops o: right when T
    is a multiple of the chunk, wrong otherwise (a raw g = 0 still decays S)."""
    T, BT = kw["q"].shape[1], kw["chunk_size"]
    pad = -T % BT

    def padded(x):
        return torch.cat([x, x.new_zeros((x.shape[0], pad) + tuple(x.shape[2:]))], dim=1) if pad else x

    o, S = fwd(**dict(kw, **{n: padded(kw[n]) for n in ("q", "k", "v", "g", "beta")}))
    return o[:, :T], S


def _scaled_o(eps):
    """o scaled by 1 + eps before its rounding to the output dtype (a bf16
    output carries its own rounding on top)."""
    def mutate(fwd, kw):
        o, S = fwd(**dict(kw, v=kw["v"].float()))
        return (o * (1 + eps)).to(kw["v"].dtype), S
    return mutate


def _lower_bound_ignored(fwd, kw):
    return fwd(**dict(kw, lower_bound=None))  # always the default, -5


PLANTED = {
    "off-by-1e-4": (_off_by_1e4, RAGGED),
    "off-by-2x-the-tolerance": (_scaled_o(2e-5), RAGGED),
    "lower-bound-ignored": (_lower_bound_ignored, dataclasses.replace(BOUNDED, lower_bound=-1.0)),
    "flipped-dbeta": (_flip_dbeta, RAGGED),
    "unwritten-tail": (_unwritten_tail, RAGGED),
    "wrong-state": (_wrong_state, BOUNDED),
    "right-only-for-whole-chunks": (_raw_padding, RAGGED),
}


@pytest.mark.parametrize("name", PLANTED)
def test_planted_bug_is_flagged(name):
    mutate, case = PLANTED[name]
    rows = checks.check_case(Planted(f"00_{name}", mutate), case, prev=None)
    bad = [r for r in rows if not r["ok"]]
    assert bad, f"planted bug {name} passed the checks:\n" + checks.format_rows(rows)
    assert all(r["err_ref"] > r["tol"] for r in bad)


def test_each_planted_bug_hits_what_it_breaks():
    def failing(mutate, case):
        return {r["output"] for r in checks.check_case(Planted("00_x", mutate), case, prev=None) if not r["ok"]}

    assert failing(_flip_dbeta, RAGGED) == {"dbeta"}
    assert "S" in failing(_wrong_state, BOUNDED) and "o" not in failing(_wrong_state, BOUNDED)
    assert "o" in failing(_unwritten_tail, RAGGED)
    assert failing(_raw_padding, ALIGNED) == set()  # the bug hides when T is a multiple of the chunk
    assert "S" in failing(_raw_padding, RAGGED)


def test_unwritten_tail_shows_as_nan_not_as_a_small_error():
    rows = checks.check_case(Planted("00_tail", _unwritten_tail), RAGGED, prev=None, backward=False)
    (o,) = [r for r in rows if r["output"] == "o"]
    assert o["err_ref"] == float("inf")


def test_outputs_are_poisoned_during_a_check():
    """checks.run allocates a stage's outputs as NaN, so an element a kernel
    never writes cannot pass by happening to hold a plausible value."""
    seen = {}

    def fn(**kw):
        seen["poisoning"] = poisoning()
        B, T, H, _ = kw["q"].shape
        return alloc((B, T, H, kw["v"].shape[-1])), alloc((B, H, kw["k"].shape[-1], kw["v"].shape[-1]))

    res = checks.run(fn, checks.case_inputs(RAGGED), "cpu", backward=False)
    assert seen["poisoning"] and torch.isnan(res["o"]).all() and torch.isnan(res["S"]).all()


def test_nondeterminism_is_flagged():
    noisy = Planted("00_noisy", _noisy)
    assert all(r["ok"] for r in checks.check_case(noisy, RAGGED, prev=None, backward=False))  # within tolerance
    assert not checks.check_deterministic(noisy, RAGGED)
    assert checks.check_deterministic("00", RAGGED)


def test_a_wrong_previous_stage_is_flagged():
    """The comparison with the previous stage is made and counts: a correct
    stage checked against a wrong 'previous' stage fails on err_prev alone."""
    rows = checks.check_case("00", RAGGED, prev=Planted("00_prev", _off_by_1e4))
    bad = [r for r in rows if not r["ok"]]
    assert bad and all(r["err_ref"] <= r["tol"] < r["err_prev"] for r in bad)


def test_a_previous_stage_wrong_in_one_gradient_is_flagged():
    """Every gradient is compared with the previous stage's, not only o and S:
    a previous stage whose dbeta alone is wrong fails the dbeta row alone, on
    its err_prev."""
    rows = checks.check_case("00", RAGGED, prev=Planted("00_prev", _flip_dbeta))
    bad = [r for r in rows if not r["ok"]]
    assert [r["output"] for r in bad] == ["dbeta"], checks.format_rows(rows)
    assert bad[0]["err_ref"] <= bad[0]["tol"] < bad[0]["err_prev"]


def test_stage_01_is_compared_with_stage_00():
    """For real: every row of stage 01, gradients included, carries its error
    against stage 00, which is not its error against the reference."""
    rows = checks.check_case("01", RAGGED)
    assert len(rows) == 10
    assert all(r["prev"] == "00_naive" and r["err_prev"] is not None and r["err_prev"] != r["err_ref"] for r in rows)


DELTA = 1e-2


def _ladder_stand_in(sid, delta):
    """Stage ``sid`` as check_case sees it, runnable on this CPU: its SPEC (on
    the CPU), stage 00's forward with o and S scaled by 1 + ``delta``, so that
    every output and gradient of it is 1 + delta times stage 00's. Its calls
    are counted in ``calls``."""
    real = load_stage(sid).SPEC
    spec = dataclasses.replace(real, devices=("cpu",))
    stand_in = SimpleNamespace(SPEC=spec, calls=0)

    def forward(q, k, v, g, beta, **kw):
        stand_in.calls += 1
        o, S = load_stage("00").forward(q, k, v, g, beta, **kw)
        return o.float() * (1 + delta), S * (1 + delta)

    stand_in.forward = forward
    return stand_in


@pytest.mark.parametrize("sid", stage_ids()[1:])
def test_every_stage_is_compared_with_its_previous_stage(sid, monkeypatch):
    """check_case(sid) runs the previous stage of the ladder on the same inputs
    and reports, in every row (each gradient too, where the stage has a
    backward), the error against that stage's own output: the stages stand in
    for themselves on the CPU, the previous one off by exactly DELTA."""
    stand_ins = {sid: _ladder_stand_in(sid, 0.0), previous(sid): _ladder_stand_in(previous(sid), DELTA)}
    stand_ins[sid].previous = stand_ins[previous(sid)]  # the ladder as check_case walks it (common.stages.stage)
    monkeypatch.setattr(checks, "ladder_stage", lambda s: stand_ins[s if isinstance(s, str) else s.SPEC.id])
    spec = stand_ins[sid].SPEC
    case = (checks.Case(1, 37, 1, 64, 64, chunk=16, gate="bounded", lower_bound=-5.0, seed=1)
            if spec.head_dims else RAGGED)
    rows = checks.check_case(sid, case)
    assert stand_ins[sid].calls == 1 and stand_ins[previous(sid)].calls == 1
    outputs = {"o", "S"} | ({"dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state"}
                            if spec.backward else set())
    assert {r["output"] for r in rows} == outputs
    for r in rows:
        assert r["prev"] == load_stage(previous(sid)).SPEC.name
        if r["output"] in ("dA_log", "ddt_bias"):  # measured against the size of their terms (checks._err)
            assert 0 < r["err_prev"] <= DELTA and r["err_prev"] > 100 * r["err_ref"], r
        else:
            assert r["err_prev"] == pytest.approx(DELTA / (1 + DELTA), rel=1e-3), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_tolerance_is_pinned_from_both_sides(dtype):
    """An output off by 2x its precision's tolerance fails, one off by half of it
    passes: the verdict is taken at the tolerance, not at 5x or 0.4x of it. A
    bf16 stage is checked on bf16 inputs against 5e-3 (its o then carries its
    own rounding, about 1.7e-3, on top of the planted error)."""
    tol = tolerance("bf16" if dtype == torch.bfloat16 else "fp32")
    seen = set()

    def planted(eps):
        def mutate(fwd, kw):
            seen.add(kw["q"].dtype)
            return _scaled_o(eps)(fwd, kw)
        return Planted(f"00_{eps:g}", mutate, compute_dtype=dtype, tolerance={})  # held to its precision's bound

    for factor, ok in ((2.0, False), (0.5, True)):
        rows = checks.check_case(planted(factor * tol), RAGGED, prev=None, backward=False)
        (o,) = [r for r in rows if r["output"] == "o"]
        assert o["tol"] == tol and o["ok"] == ok, checks.format_rows(rows)
        assert 0.9 * factor * tol <= o["err_ref"] <= (factor + 0.2) * tol, o  # the error is the planted one
    assert seen == {dtype}


def test_a_stage_is_held_to_its_own_tolerance():
    """Stage 00's o off by 3x its declared tolerance (8e-7, far below the fp32 regime's 1e-5) fails; the
    other outputs, untouched, pass at theirs."""
    tol = load_stage("00").SPEC.tol("o")
    assert tol < tolerance("fp32") / 10
    rows = checks.check_case(Planted("00_3tol", _scaled_o(3 * tol)), RAGGED, prev=None, backward=False)
    by = {r["output"]: r for r in rows}
    assert by["o"]["tol"] == tol and not by["o"]["ok"] and by["S"]["ok"], checks.format_rows(rows)


class _SilentExtension:
    """A compiled stage's binding (common.extrun's fwd/bwd) that writes nothing."""

    def fwd(self, *args):
        pass

    def bwd(self, *args):
        pass


def test_a_compiled_stage_gets_poisoned_outputs():
    """extrun allocates every output of a compiled stage through contract.alloc:
    under poisoned(), o, the final state and every gradient (dh0 too) that the
    extension leaves unwritten are NaN, so no check can pass on leftover memory.
    (Odd sizes, so no freed block of NaN of the same size is at hand.)"""
    spec = StageSpec(name="99_silent", title="writes nothing")
    kw = checks.make_inputs(2, 7, 3, 5, 6, seed=7, requires_grad=True)
    c = prepare(spec, **kw)
    ext = _SilentExtension()
    with poisoned():
        o, S = extrun.run(ext, spec, c)
        torch.autograd.backward((o, S), (torch.ones_like(o), torch.ones_like(S)))
        direct = extrun.backward(ext, c, torch.ones_like(o), torch.ones_like(S))
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    assert torch.isnan(o).all() and torch.isnan(S).all()
    for n in names:
        assert kw[n].grad is not None and torch.isnan(kw[n].grad).all(), n
        assert torch.isnan(direct[n]).all(), n


def test_a_missing_gradient_is_flagged():
    """A stage whose backward leaves a gradient out (None where the reference
    has one) is not skipped."""
    rows = checks.check_case("01", RAGGED, prev=None)
    assert {"dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state"} <= {r["output"] for r in rows}


def test_a_failing_case_fails_the_summary():
    rows = checks.check_case(Planted("00_x", _off_by_1e4), RAGGED, prev=None)
    assert not all(w["ok"] for w in checks.summarize(rows))


# ---- the student loop: `kdalab check` on a planted copy of the stages -------

PLANT_00 = {
    "off-by-1e-4": "return o * (1 + 1e-4), S",
    "flipped-o": "return -o, S",
    "unwritten-tail": "return torch.cat([o[:, :o.shape[1] // 16 * 16], torch.full_like(o[:, o.shape[1] // 16 * 16:], "
                      "float('nan'))], 1), S",
}


def _copy_stages(tmp_path, ids):
    from common.stages import STAGE_DIRS

    dst = tmp_path / "stages"
    for sid in ids:
        shutil.copytree(REPO_ROOT / "stages" / STAGE_DIRS[sid], dst / STAGE_DIRS[sid])
    return dst


def _kdalab(args, stages_dir, build_dir, timeout=900):
    env = dict(os.environ, KDALAB_STAGES_DIR=str(stages_dir), KDALAB_BUILD=str(build_dir))
    return subprocess.run([sys.executable, "-m", "common.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=timeout)


@pytest.mark.parametrize("name", PLANT_00)
def test_kdalab_check_fails_a_planted_stage_00(tmp_path, name):
    stages = _copy_stages(tmp_path, ["00"])
    path = stages / "00_naive" / "stage.py"
    path.write_text(path.read_text() + "\n\n_correct = forward\n\n\ndef forward(*args, **kw):\n"
                    f"    o, S = _correct(*args, **kw)\n    {PLANT_00[name]}\n")
    out = _kdalab(["check", "00", "--quick"], stages, tmp_path / "build")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAILED" in out.stdout and "Traceback" not in out.stderr


def test_kdalab_check_fails_a_planted_cpp_backward(tmp_path):
    """A sign flipped in stage 01's hand-written backward (the L term of dbeta)."""
    stages = _copy_stages(tmp_path, ["00", "01"])
    src = stages / "01_cpp" / "kda.cpp"
    text = src.read_text()
    assert text.count("bw.dbeta[tc] += dL * inner;") == 1
    src.write_text(text.replace("bw.dbeta[tc] += dL * inner;", "bw.dbeta[tc] -= dL * inner;"))
    out = _kdalab(["check", "01", "--quick"], stages, tmp_path / "build")
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"FAIL.*dbeta", out.stdout)


# name -> (file of stages/01_cpp, text, replacement, the outputs that must fail): bugs of a batch
PLANT_01 = {
    "every-sequence-from-batch-0-h0": (
        "binding.cpp", "in.h0 = h0 ? h0->data_ptr<float>() + bh * K * V : nullptr;",
        "in.h0 = h0 ? h0->data_ptr<float>() + h * K * V : nullptr;",
        {"o", "S", "dq", "dk", "dg", "dbeta", "dA_log", "ddt_bias"}),  # dv and dh0 do not depend on h0
    "dh0-only-for-the-first-sequence": (
        "binding.cpp", "gr.dh0 = dh0 ? dh0->data_ptr<float>() + bh * K * V : nullptr;",
        "gr.dh0 = dh0 && b == 0 ? dh0->data_ptr<float>() + bh * K * V : nullptr;", {"dinitial_state"}),
    "final-state-unwritten": (
        "binding.cpp", "float* S = ht.data_ptr<float>() + bh * p.K * p.V;",
        "std::vector<float> S_own(p.K * p.V);\n    float* S = S_own.data();", {"S"}),
}


@pytest.mark.parametrize("name", PLANT_01)
def test_kdalab_check_fails_a_planted_cpp_batch_bug(tmp_path, name):
    """Stage 01's C++ wrong for the second sequence of a batch (its h0 or dh0),
    or its final state left unwritten: `kdalab check 01 --quick` fails, on the
    outputs that the bug breaks, and those only."""
    rel, old, new, want = PLANT_01[name]
    stages = _copy_stages(tmp_path, ["00", "01"])
    src = stages / "01_cpp" / rel
    text = src.read_text()
    assert text.count(old) == 1
    src.write_text(text.replace(old, new))
    out = _kdalab(["check", "01", "--quick"], stages, tmp_path / "build")
    assert out.returncode == 1, out.stdout + out.stderr
    failing = {o for line in re.findall(r": FAIL (.*)$", out.stdout, re.M) for o in line.split(", ")}
    assert failing == want, out.stdout
    if name == "every-sequence-from-batch-0-h0":  # the chapter's notebook goes red too, in its check cell
        env = dict(os.environ, KDALAB_STAGES_DIR=str(stages), KDALAB_BUILD=str(tmp_path / "build"))
        nb = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                             "notebooks/01_cpp.ipynb", "--deselect", "notebooks/01_cpp.ipynb::Cell 1"],  # no profile build
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=900)
        assert nb.returncode == 1 and "CheckFailed" in nb.stdout and "01_cpp (live on cpu)" in nb.stdout, \
            nb.stdout[-3000:]


def test_kdalab_check_says_not_checked_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the stage is checked")
    out = subprocess.run([sys.executable, "-m", "common.cli", "check", "03"], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=1800)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "compiled, NOT checked" in out.stdout and "needs a GPU" in out.stdout
    assert "Traceback" not in out.stderr


def test_a_compile_error_prints_the_line_not_a_traceback(tmp_path):
    stages = _copy_stages(tmp_path, ["02"])
    src = stages / "02_cuda_baseline" / "kda.cu"
    lines = src.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("namespace {")) + 1
    lines.insert(at, "int planted_error = undefined_name_the_student_typed;")
    src.write_text("\n".join(lines) + "\n")
    out = _kdalab(["check", "02"], stages, tmp_path / "build")
    assert out.returncode == 4, out.stdout + out.stderr
    assert re.search(rf"kda\.cu:{at + 1}: error: .*undefined_name_the_student_typed", out.stdout), out.stdout
    assert "Traceback" not in out.stdout + out.stderr
