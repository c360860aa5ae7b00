"""Bad input gets a clear Python error naming the argument, before any kernel runs."""

import math

import pytest
import torch

from common.contract import prepare
from common.inputs import make_inputs
from common.stages import load_stage, stage_ids


def _device(spec):
    return "cpu" if "cpu" in spec.devices else "cuda"


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
    ("chunk-not-pow2", lambda kw: dict(chunk_size=24), ValueError, "chunk_size must be"),
    ("chunk-float", lambda kw: dict(chunk_size=16.0), TypeError, "chunk_size must be an int"),
    ("scale-nan", lambda kw: dict(scale=math.nan), ValueError, "scale must be finite"),
    ("final-state-flag", lambda kw: dict(output_final_state=1), TypeError, "output_final_state must be a bool"),
]


@pytest.mark.parametrize("sid", stage_ids())
@pytest.mark.parametrize("case_id,over,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused(sid, case_id, over, exc, words):
    """Every stage on its own device (GPU stages run this on a GPU)."""
    spec = load_stage(sid).SPEC
    if _device(spec) == "cuda" and not torch.cuda.is_available():
        pytest.skip("a GPU stage: its inputs must live on a GPU")
    kw = _kw(spec)
    over = over(kw)
    if over.get("gate") == "softplus" and "softplus" not in spec.gates:
        pytest.skip(f"{spec.name} has no softplus gate")
    kw.update(over)
    with pytest.raises(exc) as e:
        load_stage(sid).forward(**kw)
    assert words in str(e.value)


def test_unsupported_gate_is_refused():
    kw = _kw()
    from common.contract import StageSpec

    spec = StageSpec(name="99_test", title="", gates=("bounded",))
    with pytest.raises(ValueError, match="gate='softplus' is not supported by stage 99_test"):
        prepare(spec, **{k: v for k, v in kw.items()})


@pytest.mark.parametrize("sid", stage_ids())
def test_wrong_device_is_refused(sid):
    """CPU stages refuse other devices; GPU stages refuse CPU tensors (no GPU needed)."""
    stage = load_stage(sid)
    spec = stage.SPEC
    if "cpu" in spec.devices:
        if not torch.cuda.is_available():
            pytest.skip("needs a GPU to build a tensor on another device")
        if "cuda" in spec.devices:
            pytest.skip("this stage runs on both devices")
        kw = make_inputs(1, 20, 2, 16, 16, device="cuda")
        with pytest.raises(ValueError, match="must be on cpu"):
            stage.forward(**kw)
    else:
        kw = _kw(spec, device="cpu")
        with pytest.raises(ValueError, match="q must be on cuda"):
            stage.forward(**kw)


def test_mixed_devices_are_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    kw = make_inputs(1, 20, 2, 16, 16)
    kw["v"] = kw["v"].cuda()
    with pytest.raises(ValueError, match="v is on cuda"):
        load_stage("00").forward(**kw)


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


def test_noncontiguous_inputs_are_accepted():
    kw = _kw()
    kw["q"] = kw["q"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert not kw["q"].is_contiguous()
    o1, _ = load_stage("00").forward(**kw)
    kw["q"] = kw["q"].contiguous()
    o2, _ = load_stage("00").forward(**kw)
    assert torch.equal(o1, o2)
