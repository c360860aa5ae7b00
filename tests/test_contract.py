"""Bad input gets a clear Python error naming the argument, before any kernel runs.

Validation is Python (common.contract.prepare), so every stage's contract is
tested on the CPU: for a GPU stage, its SPEC with "cpu" added to its devices
(the device check itself is tested apart, test_wrong_device_is_refused), and
prepare is shown to be what each stage's forward calls."""

import dataclasses
import math

import pytest
import torch

from common import checks
from common.contract import prepare
from common.inputs import make_inputs
from common.stages import load_stage, stage_ids


def _device(spec):
    return "cpu" if "cpu" in spec.devices else "cuda"


def _on_cpu(spec):
    """The stage's spec, also accepting CPU tensors (validation only)."""
    return spec if "cpu" in spec.devices else dataclasses.replace(spec, devices=spec.devices + ("cpu",))


def _kw(spec=None, device=None, **over):
    """Valid inputs for a stage (on its device), then ``over`` applied."""
    K, V = (spec.head_dims[0], spec.head_dims[0]) if (spec and spec.head_dims) else (16, 8)
    gate = "softplus" if (spec is None or "softplus" in spec.gates) else "bounded"
    chunk = spec.default_chunk if spec else None
    kw = make_inputs(1, 20, 2, K, V, seed=0, gate=gate, chunk_size=chunk,
                     device=device or (_device(spec) if spec else "cpu"))
    kw.update(over)
    return kw


def _big(kw, last):
    """Inputs whose feature size is ``last`` (K = last): q, k, g, dt_bias."""
    q = kw["q"]
    return dict(q=q.new_zeros(1, 20, 2, last) + 1, k=q.new_zeros(1, 20, 2, last) + 1,
                g=q.new_zeros(1, 20, 2, last), dt_bias=kw["dt_bias"].new_zeros(2, last), initial_state=None)


# (id, overrides as a function of the good kwargs, exception, words in the message)
BAD = [
    ("q-not-tensor", lambda kw: dict(q=kw["q"].tolist()), TypeError, "q must be a torch.Tensor"),
    ("q-int", lambda kw: dict(q=kw["q"].to(torch.int32)), TypeError, "q must be float32"),
    ("beta-float64", lambda kw: dict(beta=kw["beta"].double()), TypeError, "beta must be float32"),
    ("q-rank3", lambda kw: dict(q=kw["q"][0]), ValueError, "q must be [B, T, H, K]"),
    ("v-rank3", lambda kw: dict(v=kw["v"][0]), ValueError, "v must be [B, T, H, V]"),
    ("k-shape", lambda kw: dict(k=kw["k"][:, :10]), ValueError, "k must be [B, T, H, K]"),
    ("v-T-mismatch", lambda kw: dict(v=kw["v"][:, :10]), ValueError, "v must be [B, T, H, V]"),
    ("g-H-mismatch", lambda kw: dict(g=kw["g"][:, :, :1]), ValueError, "g must be [B, T, H, K]"),
    ("beta-shape", lambda kw: dict(beta=kw["beta"][..., None]), ValueError, "beta must be [B, T, H]"),
    ("A_log-shape", lambda kw: dict(A_log=kw["A_log"][:1]), ValueError, "A_log must be [H]"),
    ("dt_bias-shape", lambda kw: dict(dt_bias=kw["dt_bias"][:, :3]), ValueError, "dt_bias must be [H, K]"),
    ("h0-shape", lambda kw: dict(initial_state=kw["initial_state"][:, :, :4]), ValueError,
     "initial_state must be [B, H, K, V]"),
    ("K-too-big", lambda kw: _big(kw, 300), ValueError, "K (q.shape[3]) must be"),
    ("V-too-big", lambda kw: dict(v=kw["v"].new_zeros(1, 20, 2, 300), initial_state=None), ValueError,
     "V (v.shape[3]) must be"),
    ("gate-unknown", lambda kw: dict(gate="sigmoid"), ValueError, "gate must be 'softplus' or 'bounded'"),
    ("lb-with-softplus", lambda kw: dict(gate="softplus", lower_bound=-5.0), ValueError,
     "lower_bound is only used with gate='bounded'"),
    ("lb-nan", lambda kw: dict(gate="bounded", lower_bound=math.nan), ValueError, "lower_bound must be finite"),
    ("lb-inf", lambda kw: dict(gate="bounded", lower_bound=-math.inf), ValueError, "lower_bound must be finite"),
    ("lb-zero", lambda kw: dict(gate="bounded", lower_bound=0.0), ValueError, "lower_bound must be in [-5, 0)"),
    ("lb-too-low", lambda kw: dict(gate="bounded", lower_bound=-6.0), ValueError, "lower_bound must be in [-5, 0)"),
    ("lb-str", lambda kw: dict(gate="bounded", lower_bound="-5"), TypeError, "lower_bound must be a float"),
    ("T-zero", lambda kw: {n: kw[n][:, :0] for n in ("q", "k", "v", "g", "beta")}, ValueError,
     "q must have B, T, H >= 1"),
    ("B-zero", lambda kw: {**{n: kw[n][:0] for n in ("q", "k", "v", "g", "beta")}, "initial_state": None},
     ValueError, "q must have B, T, H >= 1"),
    ("chunk-not-pow2", lambda kw: dict(chunk_size=24), ValueError, "chunk_size must be"),
    ("chunk-float", lambda kw: dict(chunk_size=16.0), TypeError, "chunk_size must be an int"),
    ("scale-nan", lambda kw: dict(scale=math.nan), ValueError, "scale must be finite"),
    ("final-state-flag", lambda kw: dict(output_final_state=1), TypeError, "output_final_state must be a bool"),
]


@pytest.mark.parametrize("sid", stage_ids())
@pytest.mark.parametrize("case_id,over,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused(sid, case_id, over, exc, words):
    """Every stage's contract, on the CPU."""
    spec = _on_cpu(load_stage(sid).SPEC)
    kw = _kw(spec, device="cpu")
    over = over(kw)
    if over.get("gate") == "softplus" and "softplus" not in spec.gates:
        pytest.skip(f"{spec.name} has no softplus gate: a softplus-only case does not apply")
    kw.update(over)
    with pytest.raises(exc) as e:
        prepare(spec, **kw)
    assert words in str(e.value)


@pytest.mark.parametrize("sid", stage_ids())
def test_bad_input_is_refused_by_the_stage_on_its_device(sid):
    """The same refusal through the stage's own forward, where it can run."""
    spec = load_stage(sid).SPEC
    if _device(spec) == "cuda" and not torch.cuda.is_available():
        pytest.skip("a GPU stage: its inputs must live on a GPU (the contract itself is tested on the CPU above)")
    kw = _kw(spec)
    kw["chunk_size"] = 24
    with pytest.raises(ValueError, match="chunk_size must be"):
        load_stage(sid).forward(**kw)


@pytest.mark.parametrize("sid", stage_ids())
def test_forward_validates_with_its_spec_before_any_kernel(sid, monkeypatch):
    """Each stage's forward calls prepare with its own SPEC first: a refusal
    there stops the call before anything is built or launched."""
    stage = load_stage(sid)

    class Refused(Exception):
        pass

    def spy(spec, *a, **kw):
        assert spec is stage.SPEC
        raise Refused

    monkeypatch.setattr(stage, "prepare", spy)
    monkeypatch.setattr(stage, "build", lambda *a, **kw: pytest.fail("built before validating"), raising=False)
    with pytest.raises(Refused):
        stage.forward(**_kw(stage.SPEC, device="cpu"))


@pytest.mark.parametrize("sid", [s for s in stage_ids() if load_stage(s).SPEC.equal_kv])
def test_k_must_equal_v(sid):
    spec = _on_cpu(load_stage(sid).SPEC)
    K = spec.head_dims[0]
    other = [d for d in spec.head_dims if d != K][0]
    kw = _kw(spec, device="cpu")
    kw.update(v=kw["v"].new_zeros(1, 20, 2, other), initial_state=None)
    with pytest.raises(ValueError, match=rf"needs K == V, got K={K}, V={other}"):
        prepare(spec, **kw)


@pytest.mark.parametrize("sid", [s for s in stage_ids() if load_stage(s).SPEC.head_dims])
def test_unsupported_head_dim_is_refused(sid):
    """K = 96 is within 1..256 but not one of a tensor-core stage's head dims."""
    spec = _on_cpu(load_stage(sid).SPEC)
    kw = _kw(spec, device="cpu")
    kw.update(_big(kw, 96))
    with pytest.raises(ValueError, match=r"K \(q.shape\[3\]\) must be one of"):
        prepare(spec, **kw)


def test_unsupported_gate_is_refused():
    kw = _kw()
    from common.contract import StageSpec

    spec = StageSpec(name="99_test", title="", gates=("bounded",))
    with pytest.raises(ValueError, match="gate='softplus' is not supported by stage 99_test"):
        prepare(spec, **{k: v for k, v in kw.items()})


@pytest.mark.parametrize("sid", stage_ids())
def test_wrong_device_is_refused(sid):
    """Inputs on a device a stage does not run on are refused by its forward, on
    any machine: a GPU stage gets CPU tensors, a CPU stage (00 runs on both)
    meta tensors, so no GPU is needed to build them."""
    stage = load_stage(sid)
    spec = stage.SPEC
    other = "cpu" if "cpu" not in spec.devices else "meta"
    assert other not in spec.devices
    kw = {n: (x.to(other) if torch.is_tensor(x) else x) for n, x in _kw(spec, device="cpu").items()}
    want = f"q must be on {' or '.join(spec.devices)} for stage {spec.name}, got {other}"
    with pytest.raises(ValueError, match=want):
        stage.forward(**kw)


@pytest.mark.parametrize("name", ["k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"])
def test_mixed_devices_are_refused(name):
    """Inputs on two devices: with a spec that accepts both CPU and the meta
    device, so no GPU is needed to build the second device's tensor."""
    spec = dataclasses.replace(load_stage("00").SPEC, devices=("cpu", "meta"))
    kw = make_inputs(1, 20, 2, 16, 16)
    kw[name] = kw[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} is on meta but q is on cpu"):
        prepare(spec, **kw)


@pytest.mark.parametrize("sid", stage_ids())
def test_prepare_carries_the_requested_chunk_size(sid):
    """Every chunk size a stage allows reaches its Call as asked, not the
    stage's default (a contract that ran every stage at its default chunk
    would hide a stage's bug at the other sizes)."""
    spec = _on_cpu(load_stage(sid).SPEC)
    for chunk in spec.chunk_sizes or (16, 32, 128):
        assert prepare(spec, **_kw(spec, device="cpu", chunk_size=chunk)).chunk_size == chunk, chunk
    assert prepare(spec, **_kw(spec, device="cpu", chunk_size=None)).chunk_size == spec.default_chunk


@pytest.mark.parametrize("regime", ["cpu_cases", "gpu_cases", "tc_cases"])
def test_every_check_case_is_accepted_by_the_stages_of_its_regime(regime):
    """The check cases are valid calls for every stage held to them
    (checks.cases_for), so a case set cannot fail on the GPU for its shapes."""
    cases = getattr(checks, regime)()
    device = "cpu" if regime == "cpu_cases" else "cuda"
    held = [sid for sid in stage_ids() if device in load_stage(sid).SPEC.devices
            and checks.cases_for(load_stage(sid).SPEC, device) == cases]
    assert held
    for sid in held:
        spec = load_stage(sid).SPEC
        for case in cases:
            c = prepare(_on_cpu(spec), **checks.case_inputs(case, dtype=spec.compute_dtype))
            assert (c.B, c.T, c.H, c.K, c.V, c.chunk_size) == (case.B, case.T, case.H, case.K, case.V, case.chunk)


def test_chunk_sizes_of_the_cpp_stage():
    kw = _kw(chunk_size=128)
    with pytest.raises(ValueError, match=r"chunk_size must be one of \[16, 32, 64\]"):
        load_stage("01").forward(**kw)


def test_forward_only_stage_refuses_grad():
    from common.contract import StageSpec

    spec = StageSpec(name="99_test", title="", backward=False)
    kw = make_inputs(1, 20, 2, 16, 16, requires_grad=True)
    with pytest.raises(ValueError, match="has no backward"):
        prepare(spec, **{k: v for k, v in kw.items()})


def _strided(x):
    """The same values with other strides (not contiguous)."""
    y = x.transpose(1, 2).contiguous().transpose(1, 2) if x.dim() >= 3 else x.t().contiguous().t()
    assert torch.equal(x, y) and not y.is_contiguous()
    return y


def test_noncontiguous_inputs_give_the_same_answer():
    """Stage 01 reads raw pointers: non-contiguous inputs must be made
    contiguous before its kernels see them."""
    kw = _kw(chunk_size=16)
    o1, S1 = load_stage("01").forward(**kw)
    for n in ("q", "k", "v", "g", "dt_bias", "initial_state"):
        kw[n] = _strided(kw[n])
    o2, S2 = load_stage("01").forward(**kw)
    assert torch.equal(o1, o2) and torch.equal(S1, S2)


@pytest.mark.parametrize("sid", stage_ids())
def test_prepare_returns_contiguous_tensors_in_the_stage_dtypes(sid):
    spec = _on_cpu(load_stage(sid).SPEC)
    kw = _kw(spec, device="cpu")
    for n in ("q", "k", "v", "g", "dt_bias", "initial_state"):
        kw[n] = _strided(kw[n])
    c = prepare(spec, **kw)
    for n in ("q", "k", "v", "g", "beta"):
        t = getattr(c, n)
        assert t.is_contiguous() and t.dtype == spec.compute_dtype, n
    for n in ("A_log", "dt_bias", "initial_state"):
        t = getattr(c, n)
        assert t.is_contiguous() and t.dtype == torch.float32, n
