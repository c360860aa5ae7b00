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

import pytest
import torch

from common import checks
from common.contract import alloc, poisoning
from common.paths import REPO_ROOT
from common.stages import load_stage

RAGGED = checks.Case(1, 37, 2, 16, 24, chunk=16, gate="softplus", seed=1)  # T not a multiple of the chunk
ALIGNED = checks.Case(1, 64, 2, 16, 24, chunk=16, gate="softplus", seed=1)
BOUNDED = checks.Case(2, 40, 1, 32, 32, chunk=16, gate="bounded", lower_bound=-5.0, h0=False, seed=2)


class _FlipGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class Planted:
    """Stage 00 with one thing broken by ``mutate(forward, kw) -> (o, S)``."""

    def __init__(self, name, mutate):
        self.base = load_stage("00")
        self.SPEC = dataclasses.replace(self.base.SPEC, name=name)
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


PLANTED = {
    "off-by-1e-4": (_off_by_1e4, RAGGED),
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


def test_every_stage_is_compared_with_its_previous_stage():
    rows = checks.check_case("01", RAGGED)
    assert rows and all(r["err_prev"] is not None and r["prev"] == "00_naive" for r in rows)


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
