"""kdalab.chunk_kda, the custom op and the FLA backend, on the CPU: no kernel
runs here. A fake extension stands in for stage 11's (it records each call);
CPU tensors reach it only where a test widens the op's device rule, and
FakeTensorMode's CUDA tensors go through the real rule to the op's fake
implementation. The kernel itself is checked on the GPU (tests/test_op_gpu.py)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kdalab
from common.kernel_model import ReferenceExtension
from common.metrics import rel_err
from kdalab import op
from kdalab.layer import KDALayer

try:
    import fla.ops.kda as fla_kda
except Exception:  # noqa: BLE001 - fla-core is a dev dependency; without it its tests skip
    fla_kda = None
needs_fla = pytest.mark.skipif(fla_kda is None, reason="fla-core is not installed (pip install -e '.[dev]')")

# fla-core 0.6.0's chunk_kda: (name, default), in order, then **kwargs
FLA_SIGNATURE = [
    ("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("scale", None),
    ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
    ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
    ("safe_gate", False), ("lower_bound", None), ("disable_recompute", False),
    ("return_intermediate_states", False), ("state_v_first", False), ("cu_seqlens", None),
    ("cu_seqlens_cpu", None), ("cp_context", None), ("use_graph", False), ("max_num_seqs", None),
]


def _params(fn):
    out = []
    for p in inspect.signature(fn).parameters.values():
        out.append((p.name, p.kind, None if p.default is inspect.Parameter.empty else p.default))
    return out


@pytest.fixture
def ext(monkeypatch):
    """CPU tensors allowed, each stage's extension replaced by its fp64 model (common.kernel_model: every
    argument with its meaning). Returns the model of stage 11; ``.calls`` holds every stage's calls."""
    calls = []
    models = {}
    monkeypatch.setattr(op, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(op, "_extension", lambda stage=op.STAGE: models.setdefault(
        stage, ReferenceExtension(stage, calls)))
    monkeypatch.setattr(op, "_backward_extension", lambda: models.setdefault(
        op.BACKWARD, ReferenceExtension(op.BACKWARD, calls)))
    return op._extension(op.STAGE)


@pytest.fixture
def no_kernel(monkeypatch):
    """CPU tensors allowed, and any use of the extension fails the test."""
    monkeypatch.setattr(op, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(op, "_extension", lambda *a: pytest.fail("the extension was reached"))
    monkeypatch.setattr(op, "_backward_extension", lambda *a: pytest.fail("the backward's extension was reached"))


def layer_call(B=1, T=37, H=2, D=64, dtype=torch.bfloat16, device="cpu", N=None):
    """The arguments FLA's KimiDeltaAttention passes to chunk_kda (safe_gate,
    everything in the kernel, V-first state); packed into N sequences if N."""
    gen = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    kw = dict(q=r(B, T, H, D), k=r(B, T, H, D), v=r(B, T, H, D), g=r(B, T, H, D), beta=r(B, T, H),
              A_log=torch.zeros(H, device=device), dt_bias=torch.zeros(H * D, device=device),
              initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, safe_gate=True, lower_bound=-5.0,
              state_v_first=True, cu_seqlens=None)
    if N:
        cu = torch.linspace(0, T, N + 1).long()
        kw.update(cu_seqlens=cu.to(device), initial_state=torch.zeros(N, H, D, D, device=device))
    return kw


# --------------------------------------------------------------------------
# the signature
# --------------------------------------------------------------------------

def test_signature_is_fla_0_6_0():
    got = _params(kdalab.chunk_kda)
    P = inspect.Parameter
    assert got == [(n, P.POSITIONAL_OR_KEYWORD, d) for n, d in FLA_SIGNATURE] + [("kwargs", P.VAR_KEYWORD, None)]


@needs_fla
def test_signature_matches_installed_fla():
    assert _params(kdalab.chunk_kda) == _params(fla_kda.chunk_kda)


# --------------------------------------------------------------------------
# refusals: one clear error naming the flag, before the extension
# --------------------------------------------------------------------------

def _gva(kw):
    H, D = kw["q"].shape[2], kw["q"].shape[3]
    B, T = kw["q"].shape[:2]
    kw.update(v=torch.zeros(B, T, 2 * H, D, dtype=kw["v"].dtype), g=torch.zeros(B, T, 2 * H, D, dtype=kw["g"].dtype),
              beta=torch.zeros(B, T, 2 * H, dtype=kw["beta"].dtype))


def _grad(kw):
    kw["q"] = kw["q"].float().requires_grad_()


def _train(**change):
    """The layer's call in training (q requires grad), changed."""
    def f(kw):
        kw.update(change)
        kw["q"] = kw["q"].detach().requires_grad_()
    return f


def _cu(values, **extra):
    def f(kw):
        kw.update({"cu_seqlens": torch.tensor(values), "initial_state": None, **extra})
    return f


REFUSALS = {  # id: (change to the layer's call, exception, text the message must hold)
    "softplus_no_A_log": (lambda kw: kw.update(safe_gate=False, lower_bound=None, A_log=None), ValueError,
                          "`A_log` must be provided"),  # FLA's words
    "lower_bound_none": (lambda kw: kw.update(lower_bound=None), ValueError, "lower_bound=None"),
    "lower_bound_low": (lambda kw: kw.update(lower_bound=-6.0), ValueError, "lower_bound must be in [-5, 0), got -6.0"),
    "lower_bound_zero": (lambda kw: kw.update(lower_bound=0.0), ValueError, "lower_bound must be in [-5, 0), got 0.0"),
    "lower_bound_type": (lambda kw: kw.update(lower_bound="-5"), TypeError, "lower_bound"),
    "gva": (_gva, NotImplementedError, "HV"),
    "k_ne_v": (lambda kw: kw.update(v=torch.zeros(*kw["q"].shape[:3], 128)), NotImplementedError, "head dims"),
    "head_dim_32": (lambda kw: [kw.update({n: kw[n][..., :32].contiguous()}) for n in "qkvg"],
                    NotImplementedError, "head dims"),
    "chunk_size_64": (lambda kw: kw.update(chunk_size=64), ValueError, "chunk_size=64"),
    "intermediate_states": (lambda kw: kw.update(return_intermediate_states=True), NotImplementedError,
                            "return_intermediate_states"),
    "cp_context": (lambda kw: kw.update(cp_context=object()), NotImplementedError, "cp_context"),
    "use_graph": (lambda kw: kw.update(use_graph=True), NotImplementedError, "use_graph"),
    "train_fp32": (_grad, NotImplementedError, "q.dtype=torch.float32"),
    "train_log_decay": (_train(use_gate_in_kernel=False), NotImplementedError, "use_gate_in_kernel=False"),
    "train_no_l2norm": (_train(use_qk_l2norm_in_kernel=False), NotImplementedError, "use_qk_l2norm_in_kernel=False"),
    "train_beta_as_given": (_train(use_beta_sigmoid_in_kernel=False), NotImplementedError,
                            "use_beta_sigmoid_in_kernel=False"),
    "train_neg_eigval": (_train(allow_neg_eigval=True), NotImplementedError, "allow_neg_eigval=True"),
    "unknown_kwarg": (lambda kw: kw.update(window=4), TypeError, "window"),
    "neg_eigval_no_sigmoid": (lambda kw: kw.update(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False),
                              ValueError, "allow_neg_eigval"),
    "float64": (lambda kw: kw.update(q=kw["q"].double()), TypeError, "q must be"),
    "q_3d": (lambda kw: kw.update(q=kw["q"][0]), ValueError, "q must be"),
    "beta_shape": (lambda kw: kw.update(beta=kw["beta"][..., :1]), ValueError, "beta"),
    "A_log_shape": (lambda kw: kw.update(A_log=torch.zeros(3)), ValueError, "A_log"),
    "dt_bias_shape": (lambda kw: kw.update(dt_bias=torch.zeros(5)), ValueError, "dt_bias"),
    "scale_nan": (lambda kw: kw.update(scale=float("nan")), ValueError, "scale must be finite"),
    "state_bf16": (lambda kw: kw.update(initial_state=torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)),
                   TypeError, "initial_state"),
    "state_shape": (lambda kw: kw.update(initial_state=torch.zeros(2, 2, 64, 64)), ValueError, "initial_state"),
    "both_layouts": (lambda kw: kw.update(transpose_state_layout=True), ValueError, "transpose_state_layout"),
    "cu_decreasing": (_cu([0, 20, 10, 37]), ValueError, "cu_seqlens"),
    "cu_wrong_end": (_cu([0, 20, 36]), ValueError, "cu_seqlens"),
    "cu_wrong_start": (_cu([1, 20, 37]), ValueError, "cu_seqlens"),
    "cu_float": (_cu([0.0, 37.0]), TypeError, "cu_seqlens"),
    "cu_2d": (_cu([[0, 20], [20, 37]]), ValueError, "cu_seqlens must be 1-D"),
    "cu_batch_2": (lambda kw: kw.update({n: torch.cat([kw[n]] * 2) for n in ("q", "k", "v", "g", "beta")},
                                        cu_seqlens=torch.tensor([0, 37])), ValueError, "batch size"),
    "cu_state_count": (_cu([0, 20, 37], initial_state=torch.zeros(3, 2, 64, 64)), ValueError,
                       "number of initial states"),
    "cu_cpu_alone": (lambda kw: kw.update(cu_seqlens_cpu=torch.tensor([0, 37])), ValueError, "cu_seqlens_cpu"),
    "cu_cpu_mismatch": (_cu([0, 37], cu_seqlens_cpu=torch.tensor([0, 20, 37])), ValueError, "cu_seqlens_cpu"),
    "cu_cpu_contents": (_cu([0, 20, 37], cu_seqlens_cpu=torch.tensor([0, 40, 37])), ValueError, "cu_seqlens"),
    "not_a_tensor": (lambda kw: kw.update(k=[1.0]), TypeError, "k must be a torch.Tensor"),
}


CONTENTS = ("cu_decreasing", "cu_wrong_end", "cu_wrong_start")  # found only in the values of cu_seqlens


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_raises_before_the_kernel(case, no_kernel):
    change, exc, text = REFUSALS[case]
    kw = layer_call()
    change(kw)
    with pytest.raises(exc, match=None) as info:
        kdalab.chunk_kda(**kw)
    assert text in str(info.value), str(info.value)
    if case in CONTENTS:  # supported() reads the contents of cu_seqlens only from cu_seqlens_cpu
        assert kdalab.supported(**kw) == (True, None)
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].clone()
    ok, why = kdalab.supported(**kw)
    assert not ok and why == str(info.value)


def test_supported_needs_no_copy_of_cu_seqlens(no_kernel):
    """supported() never copies cu_seqlens to the host (its contents are the call's to check)."""
    kw = layer_call()
    _cu([0, 20, 10, 37])(kw)
    assert kdalab.supported(**kw) == (True, None)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kdalab.chunk_kda(**kw)


def test_cpu_tensors_refused_by_the_real_rule(monkeypatch):
    monkeypatch.setattr(op, "_extension", lambda *a: pytest.fail("the extension was reached"))
    with pytest.raises(ValueError, match=r"q.device=cpu .*CUDA.*fla.ops.kda.chunk_kda"):
        kdalab.chunk_kda(**layer_call())


def test_grad_disabled_lets_requires_grad_through(ext):
    kw = layer_call()
    kw["q"].requires_grad_()
    with torch.no_grad():
        kdalab.chunk_kda(**kw)
    assert len(ext.calls) == 1


def test_messages_say_what_to_use_instead(no_kernel):
    for case in ("use_graph", "gva", "k_ne_v", "intermediate_states", "cp_context", "train_fp32", "train_log_decay"):
        change, exc, _ = REFUSALS[case]
        kw = layer_call()
        change(kw)
        ok, why = kdalab.supported(**kw)
        assert "fla.ops.kda.chunk_kda" in why and "supported" in why, why


# --------------------------------------------------------------------------
# supported calls reach the extension with the right arguments
# --------------------------------------------------------------------------

@pytest.mark.parametrize("change, gate_id, lower_bound", [
    (dict(safe_gate=False, lower_bound=None), 0, 0.0),    # Kimi Linear's softplus gate: no bound
    (dict(safe_gate=False), 1, -5.0),                     # FLA: a lower_bound picks the bounded gate
    (dict(safe_gate=True), 1, -5.0),                      # the layer's own call
    (dict(use_gate_in_kernel=False, safe_gate=False, lower_bound=None), 3, 0.0),  # any log decay <= 0
    (dict(use_gate_in_kernel=False, safe_gate=False, lower_bound=-2.0), 3, 0.0),  # lower_bound unused, as FLA
    (dict(use_gate_in_kernel=False, safe_gate=True, lower_bound=-2.0), 3, -2.0),
])
def test_every_gate_reaches_the_kernel_as_its_gate_id(ext, change, gate_id, lower_bound):
    """FLA's gate flags -> the kernel's gate: 0 softplus and 3 without a bound (lower_bound 0:
    stage 12's pairwise products), 1 bounded and 3 bounded (the factored products); the raw
    gate goes as bf16, the log decay as fp32."""
    kw = layer_call()
    kw.update(change)
    if not kw["use_gate_in_kernel"]:
        kw["g"] = -torch.rand(kw["q"].shape)
    kdalab.chunk_kda(**kw)
    c = ext.last
    assert (c["gate_id"], c["lower_bound"]) == (gate_id, lower_bound)
    assert c["g"].dtype == (torch.float32 if gate_id == 3 else torch.bfloat16)
    # one kernel behind the op: the last stage, for every gate
    assert c["stage"] == op.STAGE == "12"  # the last stage, for every gate


def test_fla_defaults_take_g_as_the_log_decay(ext):
    """FLA's defaults: use_gate_in_kernel=False (g is the log decay, fp32 to the
    kernel, gate_id 3), no l2norm, beta taken as activated, no final state."""
    kw = layer_call()
    q, k, v, beta = kw["q"], kw["k"], kw["v"], kw["beta"]
    g = -torch.rand(q.shape)  # fp32 log decay in [-1, 0]
    o, ht = kdalab.chunk_kda(q, k, v, g, beta, safe_gate=True)
    c = ext.last
    assert ht is None and o.shape == v.shape and o.dtype == v.dtype
    assert c["gate_id"] == 3 and c["g"].dtype == torch.float32 and torch.equal(c["g"], g)
    assert c["lower_bound"] == -5.0  # FLA's safe range when the caller bounds g itself
    assert c["l2norm"] is False and c["beta_mode"] == 0 and c["state_v_first"] is False
    assert c["chunk_size"] == 16 and c["prof"] is None and (c["fused"], c["ncw"], c["segment_chunks"]) == (-1, 0, 0)
    assert c["scale"] == pytest.approx(64 ** -0.5) and c["h0"] is None and c["cu_seqlens"] is None
    assert c["max_seqlen"] == 0
    assert torch.equal(c["A_log"], torch.zeros(2)) and torch.equal(c["dt_bias"], torch.zeros(2, 64))
    assert tuple(c["ht"].shape) == (1, 2, 64, 64)  # written by the kernel, not returned


def test_layer_call_runs_the_bounded_gate_in_the_kernel(ext):
    kw = layer_call()
    kw["A_log"] = torch.arange(2.0)
    kw["dt_bias"] = torch.arange(2.0 * 64)
    o, ht = kdalab.chunk_kda(**kw)
    c = ext.last
    assert c["gate_id"] == 1 and c["g"].dtype == torch.bfloat16 and c["g"] is kw["g"]  # no copy
    assert c["q"] is kw["q"] and c["v"] is kw["v"] and c["beta"] is kw["beta"]
    assert torch.equal(c["A_log"], kw["A_log"]) and torch.equal(c["dt_bias"], kw["dt_bias"].view(2, 64))
    assert c["l2norm"] is True and c["beta_mode"] == 1 and c["state_v_first"] is True
    assert c["lower_bound"] == -5.0 and ht is not None and tuple(ht.shape) == (1, 2, 64, 64)
    assert ht.dtype == torch.float32 and torch.isfinite(ht).all()


@pytest.mark.parametrize("sigmoid,neg,mode", [(False, False, 0), (True, False, 1), (True, True, 2)])
def test_beta_modes(ext, sigmoid, neg, mode):
    kdalab.chunk_kda(**{**layer_call(), "use_beta_sigmoid_in_kernel": sigmoid, "allow_neg_eigval": neg})
    assert ext.last["beta_mode"] == mode


def test_a_log_optional_with_lower_bound_and_dt_bias_2d(ext):
    kw = layer_call()
    kw.update(A_log=None, dt_bias=torch.ones(2, 64), use_qk_l2norm_in_kernel=False, lower_bound=-2.5)
    kdalab.chunk_kda(**kw)
    c = ext.last
    assert torch.equal(c["A_log"], torch.zeros(2))  # exp(A_log) = 1, as FLA without A_log
    assert torch.equal(c["dt_bias"], torch.ones(2, 64)) and c["l2norm"] is False and c["lower_bound"] == -2.5


def test_other_dtypes_converted_and_returned_in_v_dtype(ext):
    kw = layer_call(dtype=torch.float32)
    kw["initial_state"] = torch.randn(1, 2, 64, 64)
    o, ht = kdalab.chunk_kda(**kw)
    c = ext.last
    assert all(c[n].dtype == torch.bfloat16 for n in ("q", "k", "v", "g", "beta"))
    assert o.dtype == torch.float32 and torch.equal(c["h0"], kw["initial_state"])
    kw16 = {**layer_call(dtype=torch.float16), "use_gate_in_kernel": False, "A_log": None}
    o, _ = kdalab.chunk_kda(**kw16)
    assert ext.last["g"].dtype == torch.float32 and ext.last["q"].dtype == torch.bfloat16 and o.dtype == torch.float16


def test_positional_arguments_in_fla_order(ext):
    kw = layer_call()
    h0 = torch.randn(1, 2, 64, 64)
    o, ht = kdalab.chunk_kda(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], 0.25, h0, True, True, True, True,
                             True, True, -4.0, True, False, True, A_log=kw["A_log"], dt_bias=kw["dt_bias"])
    c = ext.last
    assert (c["scale"], c["gate_id"], c["l2norm"], c["beta_mode"], c["lower_bound"], c["state_v_first"]) == \
        (0.25, 1, True, 2, -4.0, True)
    assert c["h0"] is h0 and ht is not None  # disable_recompute=True accepted (forward only: nothing to keep)


def test_deprecated_transpose_state_layout(ext):
    kdalab.chunk_kda(**{**layer_call(), "state_v_first": False, "transpose_state_layout": True})
    assert ext.last["state_v_first"] is True


def test_non_contiguous_inputs_made_contiguous(ext):
    kw = layer_call()
    kw["q"] = kw["q"].transpose(1, 2).contiguous().transpose(1, 2)
    kdalab.chunk_kda(**kw)
    assert ext.last["q"].is_contiguous() and torch.equal(ext.last["q"], kw["q"])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("with_cpu", [False, True])
def test_packed_sequences(ext, dtype, with_cpu):
    kw = layer_call(T=50)
    cu = torch.tensor([0, 7, 7, 40, 50], dtype=dtype)
    kw.update(cu_seqlens=cu, initial_state=torch.randn(4, 2, 64, 64),
              cu_seqlens_cpu=cu.clone() if with_cpu else None)
    o, ht = kdalab.chunk_kda(**kw)
    c = ext.last
    assert c["cu_seqlens"].dtype == torch.int32 and c["cu_seqlens"].tolist() == [0, 7, 7, 40, 50]
    assert c["max_seqlen"] == 33 and tuple(ht.shape) == (4, 2, 64, 64) and c["h0"] is kw["initial_state"]


def test_packed_sequences_cpu_copy_is_trusted_over_a_device_copy(ext, monkeypatch):
    """With cu_seqlens_cpu, cu_seqlens itself is never copied to the host."""
    kw = layer_call(T=50)
    cu = torch.tensor([0, 20, 50])

    class NoCopy(torch.Tensor):
        def cpu(self, *a, **k):
            raise AssertionError("cu_seqlens was copied to the host")

    kw.update(cu_seqlens=cu.as_subclass(NoCopy), cu_seqlens_cpu=cu, initial_state=None)
    kdalab.chunk_kda(**kw)
    assert ext.last["max_seqlen"] == 30
    with pytest.raises(AssertionError, match="copied to the host"):
        kdalab.chunk_kda(**{**kw, "cu_seqlens_cpu": None})


# --------------------------------------------------------------------------
# the custom op: fake implementation, opcheck with the fake extension, torch.compile
# --------------------------------------------------------------------------

@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("final", [False, True])
def test_fake_tensors_trace_the_op(monkeypatch, v_first, final):
    """CUDA tensors of FakeTensorMode go through the real device rule to the op's
    fake implementation: shapes and dtypes without a kernel. (Packed sequences:
    their contents are read on the host, which fake tensors have not; opcheck
    below runs the fake implementation with cu_seqlens.)"""
    monkeypatch.setattr(op, "_extension", lambda *a: pytest.fail("the extension was reached"))
    with FakeTensorMode(), torch.inference_mode():
        kw = layer_call(B=2, T=40, H=3, D=128, device="cuda", dtype=torch.float16)
        h0 = torch.zeros(2, 3, 128, 128, device="cuda")
        kw.update(state_v_first=v_first, output_final_state=final, initial_state=h0)
        o, ht = kdalab.chunk_kda(**kw)
        assert o.device.type == "cuda" and o.shape == (2, 40, 3, 128) and o.dtype == torch.float16
        assert (ht is not None) == final
        if final:
            assert ht.shape == (2, 3, 128, 128) and ht.dtype == torch.float32 and ht.device.type == "cuda"


def _op_args(T=24, H=2, D=64, N=None, final=True, v_first=False):
    kw = layer_call(T=T, H=H, D=D, N=N)
    return (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"].view(H, D),
            kw["initial_state"], None if N is None else kw["cu_seqlens"].int(), D ** -0.5, 1, -5.0, True, 1,
            v_first, final, 0 if N is None else T,
            [] if N is None else (kw["cu_seqlens"][1:] - kw["cu_seqlens"][:-1]).tolist())


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("N", [None, 3])
def test_opcheck_with_the_fake_extension(ext, final, N):
    """torch.library.opcheck's schema, fake-tensor and AOT checks: the fake
    implementation agrees with what the op returns (the real kernel: GPU test)."""
    torch.library.opcheck(torch.ops.kdalab.chunk_kda_fwd.default, _op_args(N=N, final=final, v_first=True),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_compile_fullgraph_no_graph_break(ext, lower_bound):
    """A small FLA-style KDA layer compiles with fullgraph=True (no graph break)
    and gives what eager gives, with either gate (the softplus gate dispatches to
    the unbounded stage inside the op)."""
    torch.manual_seed(0)
    layer = KDALayer(hidden_size=96, num_heads=2, head_dim=64, lower_bound=lower_bound)
    x = torch.randn(2, 21, 96)
    with torch.no_grad():
        ref, ref_state = layer(x)
        explanation = torch._dynamo.explain(layer)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        torch._dynamo.reset()
        y, state = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(state, ref_state)
    assert len(ext.calls) >= 2
    want = (op.STAGE, 1) if lower_bound is not None else (op.STAGE, 0)
    assert {(c["stage"], c["gate_id"]) for c in ext.calls} == {want}


def test_compile_fullgraph_with_packed_sequences(ext):
    """Packed sequences compile without a graph break too: while tracing, the
    contents of cu_seqlens are not read on the host and T bounds the longest
    sequence (max_seqlen 0)."""
    torch.manual_seed(0)
    layer = KDALayer(hidden_size=96, num_heads=2, head_dim=64)
    x = torch.randn(1, 30, 96)
    cu = torch.tensor([0, 9, 30])
    h0 = torch.randn(2, 2, 64, 64)
    with torch.no_grad():
        ref, ref_state = layer(x, h0, cu_seqlens=cu)
        assert ext.last["max_seqlen"] == 21 and ext.last["seq_lens"] == [9, 21]
        explanation = torch._dynamo.explain(layer)(x, h0, cu_seqlens=cu)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        torch._dynamo.reset()
        y, state = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, h0, cu_seqlens=cu)
    assert ext.last["max_seqlen"] == 0 and ext.last["cu_seqlens"].tolist() == [0, 9, 30]
    assert ext.last["seq_lens"] == []  # not read while tracing: no hybrid
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(state, ref_state)


# --------------------------------------------------------------------------
# the FLA backend
# --------------------------------------------------------------------------

@pytest.fixture
def fla_backend():
    if fla_kda is None:
        pytest.skip("fla-core is not installed (pip install -e '.[dev]')")
    import kdalab.fla

    return kdalab.fla


@needs_fla
def test_backend_registered_once(fla_backend):
    from inspect import unwrap

    from fla.backends import _function_registries

    registry = _function_registries[unwrap(fla_kda.chunk_kda)]
    before = dict(registry._backends)
    b = fla_backend.register()
    assert fla_backend.register() is not b  # replaced, not added
    assert dict(registry._backends).keys() == before.keys()
    b = registry._backends["kdalab"]
    assert isinstance(b, fla_backend.KdalabBackend) and fla_backend.registered() is b
    assert (b.priority, b.env_var, b.default_enable) == (2, "FLA_KDALAB", True)
    order = [x.backend_type for x in registry._get_sorted_backends()]
    assert "flash_kda" not in order or order.index("kdalab") < order.index("flash_kda")
    assert b.is_available() and b.is_enabled()


@needs_fla
def test_backend_env_var_turns_it_off(fla_backend, monkeypatch):
    monkeypatch.setenv("FLA_KDALAB", "0")
    assert not fla_backend.registered().is_enabled()


@needs_fla
@pytest.mark.parametrize("N", [None, 3])
def test_verifier_accepts_the_fla_layer_call(fla_backend, N):
    b = fla_backend.registered()
    with FakeTensorMode(), torch.inference_mode():
        kw = layer_call(T=80, H=2, D=128, device="cuda", N=N)
        assert b.verify("chunk_kda", **kw) == (True, None)
    with FakeTensorMode():
        kw = layer_call(T=80, H=2, D=128, device="cuda", N=N)
        assert b.verify("chunk_kda", **kw) == (True, None)  # grad enabled, nothing requires it: no training
        kw["v"].requires_grad_()
        ok, why = b.verify("chunk_kda", **kw)  # training: FLA's kernels unless FLA_KDALAB_TRAIN=1
        assert not ok and "FLA_KDALAB_TRAIN" in why
        with pytest.MonkeyPatch.context() as m:
            m.setenv("FLA_KDALAB_TRAIN", "1")
            assert b.verify("chunk_kda", **kw) == (True, None)


@needs_fla
@pytest.mark.parametrize("case", ["softplus_no_A_log", "lower_bound_none", "gva", "k_ne_v", "chunk_size_64",
                                  "intermediate_states", "cp_context", "use_graph", "float64", "state_bf16",
                                  "unknown_kwarg", "cu_batch_2"])
def test_verifier_refuses_with_the_reason(fla_backend, case, monkeypatch):
    monkeypatch.setattr(op, "_DEVICE_TYPES", ("cuda", "cpu"))
    change, exc, text = REFUSALS[case]
    kw = layer_call()
    change(kw)
    with torch.inference_mode():
        ok, why = fla_backend.registered().verify("chunk_kda", **kw)
    assert not ok and text in why


@needs_fla
def test_fla_chunk_kda_dispatches_to_kdalab(fla_backend, ext):
    """FLA's own chunk_kda, called as its KDA layer calls it (packed sequences)
    under inference mode, runs kdalab's kernel (the fake extension records the
    call; FLA's Triton kernels could not run here)."""
    kw = layer_call(T=80, H=2, D=128, N=2)
    with torch.inference_mode():
        o, ht = fla_kda.chunk_kda(**kw)
    c = ext.last
    assert (c["gate_id"], c["l2norm"], c["beta_mode"], c["state_v_first"], c["max_seqlen"]) == (1, True, 1, True, 40)
    assert o.shape == (1, 80, 2, 128) and ht.shape == (2, 2, 128, 128) and len(ext.calls) == 1
    kw["k"].requires_grad_()
    with pytest.raises(Exception):  # training: FLA's own kernels (which cannot run on this CPU)
        fla_kda.chunk_kda(**kw)
    assert len(ext.calls) == 1


@needs_fla
def test_fla_chunk_kda_trains_on_kdalab_when_asked(fla_backend, ext, monkeypatch):
    """With FLA_KDALAB_TRAIN=1, FLA's chunk_kda in training runs kdalab's forward and, on backward(), its
    backward (the models record both), and the gradients are those of kdalab.chunk_kda itself."""
    monkeypatch.setenv("FLA_KDALAB_TRAIN", "1")
    kw = _meaning_call(N=2, T=40, cu_seqlens=torch.tensor([0, 15, 40]))
    kw["initial_state"] = kw["initial_state"][:2]
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    grads = []
    for fn in (fla_kda.chunk_kda, kdalab.chunk_kda):
        leaves = {n: kw[n].detach().clone().requires_grad_() for n in names}
        o, ht = fn(**dict(kw, **leaves))
        (o.float().sum() + ht.sum()).backward()
        grads.append([leaves[n].grad for n in names])
    assert [c.get("kind", "fwd") for c in ext.calls] == ["fwd", "bwd", "fwd", "bwd"]
    for n, a, b in zip(names, *grads):
        assert torch.equal(a, b), n


# --------------------------------------------------------------------------
# what each flag means: the op on the CPU, its kernel an fp64 model, against FLA's own reference
# --------------------------------------------------------------------------
#
# The ``ext`` fixture puts common.kernel_model.ReferenceExtension in place of the stages' extensions: it
# computes what the kernel's arguments mean (gate id and bound, l2norm, beta mode, layout, packed
# sequences, max_seqlen, seq_lens) in fp64. FLA's side is built from FLA's own naive functions
# (fla.ops.kda.naive.naive_recurrent_kda, fla.ops.kda.gate.naive_kda_gate / naive_kda_lowerbound_gate)
# with its flags applied as its chunk_kda applies them, on the same bf16 values in fp32: the two agree to
# o's bf16 rounding when the op maps every flag to its meaning, and are far apart when one is lost.

def fla_meaning(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                allow_neg_eigval=False, safe_gate=False, lower_bound=None, state_v_first=False, cu_seqlens=None,
                A_log=None, dt_bias=None, **_):
    """fla.ops.kda.chunk_kda's result for these flags, from FLA's naive functions, in fp32."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:  # fla.modules.l2norm: x / sqrt(sum x^2 + 1e-6)
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    if use_gate_in_kernel:
        g = (naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound) if lower_bound is not None
             else naive_kda_gate(g, A_log, dt_bias))
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = initial_state
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2)
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, s, e) for s, e in zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:])]
    o = torch.zeros(B, T, H, v.shape[-1])
    S = torch.zeros(N, H, K, v.shape[-1])
    for n, (b, s, e) in enumerate(bounds):
        S[n] = 0 if h0 is None else h0[n]
        if e > s:
            part = [x[b:b + 1, s:e] for x in (q, k, v, g, beta)]
            on, Sn = naive_recurrent_kda(*part, scale=scale, initial_state=None if h0 is None else h0[n:n + 1],
                                         output_final_state=True)
            o[b:b + 1, s:e], S[n] = on, Sn[0]
    if state_v_first:
        S = S.transpose(-1, -2)
    return o, (S if output_final_state else None)


def _meaning_call(N=None, T=37, H=2, D=64, **change):
    """The KDA layer's call (layer_call), bf16, with h0, changed by ``change``; g a log decay in [-1, 0]
    where the gate is not in the kernel."""
    kw = layer_call(T=T, H=H, D=D, N=N)
    gen = torch.Generator().manual_seed(3)
    kw["A_log"] = torch.rand(H, generator=gen) * 2 - 1
    kw["dt_bias"] = torch.randn(H * D, generator=gen) * 0.5 - 1
    N_ = N or kw["q"].shape[0]
    kw["initial_state"] = torch.randn(N_, H, D, D, generator=gen) / D ** 0.5
    kw.update(change)
    if not kw["use_gate_in_kernel"]:
        kw["g"] = -torch.rand(kw["q"].shape, generator=gen)
    return kw


MEANINGS = {  # id: the change to the layer's call (bounded gate in the kernel, l2norm, beta sigmoid, V-first)
    "layer": {},
    "scale_0.3": dict(scale=0.3),
    "scale_0": dict(scale=0.0),
    "no_l2norm": dict(use_qk_l2norm_in_kernel=False),
    "beta_as_given": dict(use_beta_sigmoid_in_kernel=False),
    "neg_eigval": dict(allow_neg_eigval=True),
    "lower_bound_-2": dict(lower_bound=-2.0),
    "softplus": dict(safe_gate=False, lower_bound=None),
    "log_decay_safe": dict(use_gate_in_kernel=False, lower_bound=-3.0),
    "log_decay_unbounded": dict(use_gate_in_kernel=False, safe_gate=False, lower_bound=None),
    "k_first": dict(state_v_first=False),
    "fla_defaults": dict(use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                         safe_gate=False, lower_bound=None, state_v_first=False),
}


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("name", list(MEANINGS))
def test_each_flag_means_what_it_means_in_fla(ext, name, packed):
    """o and the final state of kdalab.chunk_kda on the CPU (the kernel an fp64 model of its arguments)
    against FLA's own reference with the same flags: within o's bf16 rounding. Packed: four sequences, one
    empty and one shorter than a chunk, lengths read from cu_seqlens on the host."""
    if fla_kda is None:
        pytest.skip("fla-core is not installed (pip install -e '.[dev]')")
    kw = _meaning_call(N=4 if packed else None, T=50 if packed else 37, **MEANINGS[name])
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 9, 9, 30, 50])
        kw["initial_state"] = kw["initial_state"][:4] if kw["initial_state"].shape[0] >= 4 else \
            torch.randn(4, *kw["initial_state"].shape[1:])
    else:  # B = 2: each batch row its own sequence and state
        kw = {n: (torch.cat([t, t.flip(1)]) if n in ("q", "k", "v", "g", "beta") else t) for n, t in kw.items()}
        kw["initial_state"] = torch.cat([kw["initial_state"], -kw["initial_state"]])
    o, ht = kdalab.chunk_kda(**kw)
    fo, fht = fla_meaning(**kw)
    if kw.get("scale") == 0.0:  # FLA: o = 0 exactly
        assert torch.equal(o.float(), torch.zeros_like(fo)), "scale=0.0 did not give o = 0"
    else:
        assert rel_err(o, fo) < 5e-3, rel_err(o, fo)
    assert rel_err(ht, fht) < 2e-4, rel_err(ht, fht)  # fp32 against fp64 over up to 50 tokens


def test_the_meaning_test_catches_a_lost_flag(ext):
    """Planted: each flag dropped from the op's plan in turn; the op then differs from FLA by far more than
    the tolerance above."""
    kw = _meaning_call()
    want = fla_meaning(**kw)
    for flag, wrong in (("use_qk_l2norm_in_kernel", dict(l2norm=False)), ("use_beta_sigmoid_in_kernel",
                                                                          dict(beta_mode=0)),
                        ("state_v_first", dict(state_v_first=False)), ("scale", dict(scale=1.0)),
                        ("lower_bound", dict(lower_bound=-5.0 if kw["lower_bound"] != -5.0 else -1.0))):
        plan = op._plan

        def lost(*a, _wrong=wrong, **k):
            return dict(plan(*a, **k), **_wrong)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(op, "_plan", lost)
            o, ht = kdalab.chunk_kda(**kw)
        assert max(rel_err(o, want[0]), rel_err(ht, want[1])) > 1e-2, flag


def test_a_wrong_max_seqlen_or_seq_lens_is_caught(ext):
    """max_seqlen bounds the tokens the kernel runs per sequence and seq_lens plans the hybrid: too small
    a bound, or lengths that are not cu_seqlens', leave outputs unwritten (NaN in the model)."""
    kw = _meaning_call(N=3, T=50, cu_seqlens=torch.tensor([0, 20, 21, 50]))
    kw["initial_state"] = kw["initial_state"][:3]
    o, ht = kdalab.chunk_kda(**kw)
    assert (ext.last["max_seqlen"], ext.last["seq_lens"]) == (29, [20, 1, 29])
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    for wrong in (dict(max_seqlen=20), dict(seq_lens=[20, 29, 1])):
        plan = op._plan
        with pytest.MonkeyPatch.context() as m:
            m.setattr(op, "_plan", lambda *a, _w=wrong, **k: dict(plan(*a, **k), **_w))
            o, ht = kdalab.chunk_kda(**kw)
        assert not torch.isfinite(o).all(), wrong


def test_the_help_documents_every_argument_and_says_what_it_needs():
    """help(kdalab.chunk_kda) reads like FLA's docstring: every argument of the signature under Args,
    Returns, an example, that it needs a CUDA GPU, and what it trains."""
    import inspect

    doc = inspect.getdoc(kdalab.chunk_kda)
    args = doc[doc.index("Args:"):doc.index("Returns:")]
    for name in inspect.signature(kdalab.chunk_kda).parameters:
        if name != "kwargs":
            assert re.search(rf"^\s+{name}\b", args, re.M) or f"{name}," in args or f", {name}" in args, name
    assert "CUDA GPU" in doc and "requires grad" in doc and "use_qk_l2norm_in_kernel" in doc and "Examples::" in doc
    assert "STAGE" not in doc  # no placeholder names


# --------------------------------------------------------------------------
# training: the op's autograd, its kernels fp64 models, against autograd through FLA's own reference
# --------------------------------------------------------------------------

GRAD_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
TRAINED = {  # id: the change to the layer's call; every one keeps the gate, l2norm and sigmoid(beta) in the kernel
    "layer": {},
    "softplus": dict(safe_gate=False, lower_bound=None),
    "lower_bound_-2": dict(lower_bound=-2.0),
    "k_first": dict(state_v_first=False),
    "scale_0.3": dict(scale=0.3),
    "no_final_state": dict(output_final_state=False),
    "no_h0": dict(initial_state=None),
}


def _trained_call(name, packed):
    kw = _meaning_call(N=4 if packed else None, T=50 if packed else 37, **TRAINED[name])
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 9, 9, 30, 50])
        if kw["initial_state"] is not None:
            kw["initial_state"] = torch.randn(4, *kw["initial_state"].shape[1:], generator=torch.Generator()
                                              .manual_seed(8)) / 8
    else:  # B = 2
        kw = {n: (torch.cat([t, t.flip(1)]) if n in ("q", "k", "v", "g", "beta") else t) for n, t in kw.items()}
        if kw["initial_state"] is not None:
            kw["initial_state"] = torch.cat([kw["initial_state"], -kw["initial_state"]])
    return kw


def _grads(fn, kw, seed=9):
    """The gradients of sum(o * do) + sum(ht * dht) through fn(**kw) (fixed random cotangents)."""
    leaves = {n: kw[n].detach().clone().requires_grad_() for n in GRAD_NAMES if kw[n] is not None}
    o, ht = fn(**dict(kw, **leaves))
    gen = torch.Generator().manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen)).sum()
    if ht is not None:
        loss = loss + (ht.float() * torch.randn(ht.shape, generator=gen)).sum()
    loss.backward()
    return {n: t.grad for n, t in leaves.items()}


def _fla_grads(kw, seed=9):
    """The same through FLA's naive reference (fla_meaning), its leaves fp32 copies of the same values and o
    returned in bf16 as the op returns it (so that o's cotangent is rounded to bf16 on both sides)."""
    wide = {n: (t.float() if isinstance(t, torch.Tensor) and n in GRAD_NAMES else t) for n, t in kw.items()}

    def fla_bf16_o(**k):
        o, ht = fla_meaning(**k)
        return o.to(torch.bfloat16), ht

    return _grads(fla_bf16_o, wide, seed)


# Each gradient against FLA's reference rounded to the gradient's dtype (its input's): the bf16 ones (q, k, v, g,
# beta) off by the odd element that fp32 and fp64 round to neighbouring bf16 values (3.6e-5 at most measured), the
# fp32 ones (A_log, dt_bias, h0) by FLA's fp32 arithmetic (7.4e-7 at most)
GRAD_TOL = dict(q=2e-4, k=2e-4, v=2e-4, g=2e-4, beta=2e-4, A_log=1e-5, dt_bias=1e-5, initial_state=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("name", list(TRAINED))
def test_training_gradients_are_fla_reference_gradients(ext, name, packed):
    """kdalab.chunk_kda in training (its kernels fp64 models of their arguments: common.kernel_model): every
    gradient, in its input's dtype, against autograd through FLA's naive reference with the same flags."""
    if fla_kda is None:
        pytest.skip("fla-core is not installed (pip install -e '.[dev]')")
    kw = _trained_call(name, packed)
    got, want = _grads(kdalab.chunk_kda, kw), _fla_grads(kw)
    assert [c.get("kind", "fwd") for c in ext.calls] == ["fwd", "bwd"]
    assert got.keys() == want.keys()
    for n in got:
        assert got[n].dtype == kw[n].dtype and got[n].shape == kw[n].shape, n
        err = rel_err(got[n], want[n].to(got[n].dtype))
        assert err < GRAD_TOL[n], f"d{n}: {err:.2e}"


def test_the_gradient_test_catches_a_lost_argument(ext):
    """Planted: the backward's extension called with one argument wrong in turn (what a slip in the op's
    autograd would do); some gradient then differs from FLA's reference by far more than its tolerance."""
    if fla_kda is None:
        pytest.skip("fla-core is not installed (pip install -e '.[dev]')")
    kw = _trained_call("softplus", packed=True)
    want = _fla_grads(kw)
    model = op._backward_extension()
    for wrong in (dict(state_v_first=False), dict(scale=1.0), dict(gate_id=1, lower_bound=-5.0), dict(dht=None),
                  dict(cu_seqlens=torch.tensor([0, 9, 20, 30, 50], dtype=torch.int32))):
        def bwd(*a, _w=wrong, _bwd=model.bwd, **k):
            named = inspect.signature(_bwd).bind(*a, **k).arguments
            return _bwd(**dict(named, **_w))

        with pytest.MonkeyPatch.context() as m:
            m.setattr(model, "bwd", bwd)
            got = _grads(kdalab.chunk_kda, kw)
        assert max(rel_err(got[n], want[n].to(got[n].dtype)) / GRAD_TOL[n] for n in got) > 10, wrong


@pytest.mark.parametrize("N", [None, 3])
def test_opcheck_of_the_training_op(ext, N):
    """opcheck with inputs that require grad: the autograd registration and AOT's forward and backward graphs
    (the backward op's fake implementation) agree with what the ops return."""
    args = list(_op_args(N=N, final=True, v_first=True))
    for i in range(5):
        args[i] = args[i].detach().requires_grad_()
    args[5], args[6] = args[5].requires_grad_(), args[6].requires_grad_()
    if args[7] is not None:
        args[7] = args[7].requires_grad_()
    torch.library.opcheck(torch.ops.kdalab.chunk_kda_fwd.default, tuple(args),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_compiled_training_step_matches_eager(ext, lower_bound):
    """A training step of the small KDA layer, compiled with fullgraph=True (no graph break), gives eager's
    loss and parameter gradients; its forward and backward run the op's two kernels."""
    torch.manual_seed(0)
    layer = KDALayer(hidden_size=96, num_heads=2, head_dim=64, lower_bound=lower_bound).to(torch.bfloat16)
    x = torch.randn(2, 21, 96, dtype=torch.bfloat16)

    def step(m, x):
        y, state = m(x)
        return y.float().pow(2).mean() + state.pow(2).mean()

    loss = step(layer, x)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    torch._dynamo.reset()
    ext.calls.clear()
    got_loss = torch.compile(step, fullgraph=True, backend="aot_eager")(layer, x)
    got_loss.backward()
    assert [c.get("kind", "fwd") for c in ext.calls] == ["fwd", "bwd"]
    torch.testing.assert_close(got_loss, loss)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)
