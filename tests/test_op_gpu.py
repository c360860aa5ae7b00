"""kdalab.chunk_kda on the GPU (marked gpu: skipped where none is visible; on
the H200 `pytest -m gpu tests/test_op_gpu.py`): torch.library.opcheck with the
real kernel, torch.compile(fullgraph=True) against eager, CUDA-graph capture
and replay, the op against the last stage's forward and stage 11's (bitwise), packed sequences
against the same sequences one by one, and FLA's chunk_kda and KDA layer
through the backend against FLA's own kernels."""

from __future__ import annotations

import pytest
import torch

import kdalab
from common.contract import GATE_ID
from common.inputs import make_inputs
from common.kernel_model import reference_outputs
from common.metrics import TOLERANCE, rel_err
from common.reference import kda_reference
from common.stages import load_stage
from kdalab import op
from kdalab.layer import KDALayer

pytestmark = pytest.mark.gpu

FLA_TOL = 0.005  # FLA's own tests: RMS(difference) / RMS(reference) of o under 0.005 against their reference
BOTH_TOL = 2 * FLA_TOL  # kdalab against FLA: each side carries its own bf16 error


def raw(B=1, T=200, H=2, D=128, seed=0, N=None):
    """FLA-layer-style raw inputs on the GPU, bf16 (fp32 A_log [H], dt_bias [H * K], state)."""
    c = make_inputs(B=B, T=T, H=H, K=D, seed=seed, dtype=torch.bfloat16, device="cuda", gate="bounded")
    kw = dict(q=c["q"], k=c["k"], v=c["v"], g=c["g"], beta=c["beta"], A_log=c["A_log"],
              dt_bias=c["dt_bias"].reshape(-1), initial_state=c["initial_state"], output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=-5.0)
    if N is not None:
        lengths = _ragged(T, N, seed)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda")
        kw.update(cu_seqlens=cu, initial_state=torch.randn(N, H, D, D, device="cuda") / D ** 0.5)
    return kw


def _ragged(T, N, seed):
    """N lengths summing to T, one of them 0 and one shorter than a chunk where N allows."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(1, T, (N - 1,), generator=gen).tolist())
    lengths = [b - a for a, b in zip([0] + cuts, cuts + [T])]
    if N >= 4:
        lengths[1], lengths[0] = 0, lengths[0] + lengths[1]
        lengths[2], lengths[3] = 5, lengths[3] + lengths[2] - 5
    return lengths


# --------------------------------------------------------------------------
# the op against the last stage and stage 11, and against itself sequence by sequence
# --------------------------------------------------------------------------

@pytest.mark.parametrize("N", [None, 6])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_op_is_the_last_stage_and_stage_11_bitwise(N, v_first, D):
    """The op runs the last stage; on a bounded gate that is stage 11's arithmetic, bit for bit."""
    kw = raw(T=333, H=3, D=D, N=N)
    with torch.inference_mode():
        o, ht = kdalab.chunk_kda(**kw, state_v_first=v_first)
        for sid in (op.STAGE, "11"):
            so, sht = load_stage(sid).forward(
                kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], A_log=kw["A_log"], dt_bias=kw["dt_bias"].view(3, D),
                initial_state=kw["initial_state"], gate="bounded", lower_bound=-5.0, cu_seqlens=kw.get("cu_seqlens"),
                state_v_first=v_first)
            assert torch.equal(o, so) and torch.equal(ht, sht), sid


@pytest.mark.parametrize("N", [None, 6])
@pytest.mark.parametrize("extreme", [False, True])
def test_softplus_gate_is_stage_12_and_near_fp64(N, extreme):
    """FLA's softplus gate (use_gate_in_kernel, no lower_bound, safe_gate=False) runs stage 12:
    bitwise its forward, within the bf16 tolerance of the fp64 loop, finite at the gate's
    extremes (A_log up to 3, a chunk at a = -400 per token)."""
    c = make_inputs(B=1, T=300, H=3, K=128, seed=5, dtype=torch.bfloat16, device="cuda", gate="softplus",
                    extreme=extreme)
    kw = dict(q=c["q"], k=c["k"], v=c["v"], g=c["g"], beta=c["beta"], A_log=c["A_log"],
              dt_bias=c["dt_bias"].reshape(-1), initial_state=c["initial_state"], output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if N is not None:
        cu = torch.tensor([0] + torch.tensor(_ragged(300, N, 5)).cumsum(0).tolist(), device="cuda")
        kw.update(cu_seqlens=cu, initial_state=torch.randn(N, 3, 128, 128, device="cuda") / 128 ** 0.5)
    with torch.inference_mode():
        o, ht = kdalab.chunk_kda(**kw)
        so, sht = load_stage(op.STAGE).forward(
            kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], A_log=kw["A_log"], dt_bias=kw["dt_bias"].view(3, 128),
            initial_state=kw["initial_state"], gate="softplus", cu_seqlens=kw.get("cu_seqlens"))
    assert torch.equal(o, so) and torch.equal(ht, sht)
    if N is None:
        ro, rht = kda_reference(*(kw[n].cpu() for n in ("q", "k", "v", "g", "beta")), A_log=kw["A_log"].cpu(),
                                dt_bias=kw["dt_bias"].view(3, 128).cpu(), initial_state=kw["initial_state"].cpu(),
                                gate="softplus")
        assert rel_err(o, ro) < TOLERANCE["bf16"] and rel_err(ht, rht) < TOLERANCE["bf16"]


def test_unbounded_log_decay_through_safe_gate_false():
    """safe_gate=False with g the log decay: any a <= 0, here down to -60 per token (a chunk
    decays past fp32's range), against the fp64 loop given that decay."""
    kw = raw(T=200, H=2, D=64)
    a = -60.0 * torch.rand(kw["q"].shape, device="cuda")
    kw.update(g=a, use_gate_in_kernel=False, safe_gate=False, lower_bound=None)
    with torch.inference_mode():
        o, ht = kdalab.chunk_kda(**kw)
    from common.reference import activate, kda_recurrence  # the token loop on the log decay itself

    cpu = {n: kw[n].double().cpu() for n in ("q", "k", "beta", "v", "initial_state")}
    qn, kn, b, _ = activate(cpu["q"], cpu["k"], a.double().cpu(), cpu["beta"], kw["A_log"].double().cpu(),
                            kw["dt_bias"].view(2, 64).double().cpu())  # q, k and beta as the kernel takes them
    ro, rht = kda_recurrence(qn, kn, cpu["v"], b, a.double().cpu(), scale=64 ** -0.5,
                             initial_state=cpu["initial_state"])
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, ro) < TOLERANCE["bf16"] and rel_err(ht, rht) < TOLERANCE["bf16"]


def test_against_the_fp64_reference():
    kw = raw(T=150, H=2, D=64)
    with torch.inference_mode():
        o, ht = kdalab.chunk_kda(**kw)
    ro, rht = kda_reference(kw["q"].cpu(), kw["k"].cpu(), kw["v"].cpu(), kw["g"].cpu(), kw["beta"].cpu(),
                            A_log=kw["A_log"].cpu(), dt_bias=kw["dt_bias"].view(2, 64).cpu(),
                            initial_state=kw["initial_state"].cpu(), gate="bounded", lower_bound=-5.0)
    assert rel_err(o, ro) < TOLERANCE["bf16"] and rel_err(ht, rht) < TOLERANCE["bf16"]


@pytest.mark.parametrize("v_first", [False, True])
def test_packed_equals_one_by_one(v_first):
    """Ragged lengths (one empty, one shorter than a chunk) in one launch against
    the op on each sequence alone."""
    kw = raw(T=700, H=2, D=128, N=6, seed=3)
    cu = kw["cu_seqlens"].tolist()
    h0 = kw["initial_state"].transpose(-1, -2).contiguous() if v_first else kw["initial_state"]
    with torch.inference_mode():
        o, ht = kdalab.chunk_kda(**{**kw, "initial_state": h0}, state_v_first=v_first)
        for i, (a, b) in enumerate(zip(cu, cu[1:])):
            if a == b:
                assert torch.equal(ht[i], h0[i])  # an empty sequence keeps its state
                continue
            one = {n: kw[n][:, a:b] for n in ("q", "k", "v", "g", "beta")}
            oi, hi = kdalab.chunk_kda(**{**kw, **one, "cu_seqlens": None, "initial_state": h0[i:i + 1]},
                                      state_v_first=v_first)
            assert rel_err(o[:, a:b], oi) < 1e-3 and rel_err(ht[i:i + 1], hi) < 1e-3, (i, a, b)


@pytest.mark.parametrize("mode", [dict(use_gate_in_kernel=False), dict(use_beta_sigmoid_in_kernel=False),
                                  dict(allow_neg_eigval=True), dict(use_qk_l2norm_in_kernel=False)],
                         ids=["log_decay", "beta_activated", "neg_eigval", "no_l2norm"])
def test_flag_variants_against_fla(mode):
    """Each flag against FLA's own chunk_kda given the same call."""
    fla = pytest.importorskip("fla.ops.kda")
    kw = raw(T=256, H=2, D=128)
    if mode.get("use_gate_in_kernel") is False:
        kw["g"] = -5.0 * torch.sigmoid(kw["g"].float())  # a log decay in [-5, 0]
    if mode.get("use_beta_sigmoid_in_kernel") is False:
        kw["beta"] = torch.sigmoid(kw["beta"])
    if mode.get("use_qk_l2norm_in_kernel") is False:
        kw["q"], kw["k"] = (torch.nn.functional.normalize(x.float(), dim=-1).bfloat16() for x in (kw["q"], kw["k"]))
    kw.update(mode)
    with torch.inference_mode():
        o, ht = kdalab.chunk_kda(**kw)
        fo, fht = _fla_own(fla.chunk_kda, **kw)
    assert rel_err(o, fo) < BOTH_TOL and rel_err(ht, fht) < BOTH_TOL


def _fla_own(fn, *args, **kw):
    """FLA's chunk_kda (or layer) on FLA's own kernels: the kdalab backend switched off."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLA_KDALAB", "0")
        return fn(*args, **kw)


# --------------------------------------------------------------------------
# the custom op: opcheck, torch.compile, CUDA graphs
# --------------------------------------------------------------------------

@pytest.mark.parametrize("N", [None, 4])
@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("gate", [(1, -5.0), (0, 0.0)], ids=["bounded", "softplus"])
def test_opcheck(N, final, gate):
    kw = raw(T=100, H=2, D=64, N=N)
    cu = kw.get("cu_seqlens")
    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"].view(2, 64),
            kw["initial_state"], None if cu is None else cu.int(), 0.125, *gate, True, 1, True, final,
            0 if cu is None else int((cu[1:] - cu[:-1]).max()),
            [] if cu is None else (cu[1:] - cu[:-1]).tolist())
    torch.library.opcheck(torch.ops.kdalab.chunk_kda_fwd.default, args)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_compile_fullgraph_matches_eager(packed, lower_bound):
    torch.manual_seed(0)
    layer = KDALayer(hidden_size=512, num_heads=4, head_dim=128, lower_bound=lower_bound).cuda().bfloat16()
    x = torch.randn(1, 300, 512, device="cuda", dtype=torch.bfloat16)
    extra = dict(cu_seqlens=torch.tensor([0, 17, 150, 300], device="cuda"),
                 initial_state=torch.zeros(3, 4, 128, 128, device="cuda")) if packed else {}
    with torch.inference_mode():
        y, s = layer(x, **extra)
        torch._dynamo.reset()
        cy, cs = torch.compile(layer, fullgraph=True)(x, **extra)
    assert rel_err(cy, y) < 1e-2 and rel_err(cs, s) < 1e-2  # inductor fuses the projections differently
    with torch.inference_mode():
        ay, as_ = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, **extra)
    if not packed:  # the same op call: bitwise (packed, compiled: T bounds the longest sequence)
        assert torch.equal(ay, y) and torch.equal(as_, s)


@pytest.mark.parametrize("packed", ["no", "cu_seqlens_cpu", "device_only"])
def test_cuda_graph_capture_and_replay(packed):
    """Captured once, replayed on new inputs written in place. "device_only":
    packed without cu_seqlens_cpu, captured with T bounding the longest sequence."""
    kw = raw(T=500, H=4, D=128, N=None if packed == "no" else 5)
    if packed == "cu_seqlens_cpu":
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    with torch.inference_mode():
        ref = kdalab.chunk_kda(**kw)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            kdalab.chunk_kda(**kw)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = kdalab.chunk_kda(**kw)
        graph.replay()
        torch.cuda.synchronize()
        if packed == "device_only":
            assert rel_err(out[0], ref[0]) < 1e-3 and rel_err(out[1], ref[1]) < 1e-3
        else:
            assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        new = raw(T=500, H=4, D=128, seed=7)
        for n in ("q", "k", "v", "g", "beta"):
            kw[n].copy_(new[n])
        graph.replay()
        again = kdalab.chunk_kda(**kw)
        torch.cuda.synchronize()
    assert rel_err(out[0], again[0]) < 1e-3 and rel_err(out[1], again[1]) < 1e-3
    assert rel_err(out[0], ref[0]) > 1e-2  # the replay saw the new inputs


# --------------------------------------------------------------------------
# FLA through the backend
# --------------------------------------------------------------------------

@pytest.mark.parametrize("N", [None, 6])
def test_fla_chunk_kda_through_the_backend(N):
    fla = pytest.importorskip("fla.ops.kda")
    import kdalab.fla  # noqa: F401 - registers

    kw = raw(T=1024, H=4, D=128, N=N)
    kw["state_v_first"] = True
    if N:
        kw["initial_state"] = kw["initial_state"].transpose(-1, -2).contiguous()
    with torch.inference_mode():
        o, ht = fla.chunk_kda(**kw)
        ko, kht = kdalab.chunk_kda(**kw)
        fo, fht = _fla_own(fla.chunk_kda, **kw)
    assert torch.equal(o, ko) and torch.equal(ht, kht)  # FLA dispatched to kdalab
    assert rel_err(o, fo) < BOTH_TOL and rel_err(ht, fht) < BOTH_TOL


def test_fla_kda_layer_through_the_backend(monkeypatch):
    """FLA's KimiDeltaAttention (safe_gate, lower_bound -5) under inference mode
    runs kdalab and matches the layer on FLA's own kernels."""
    kdafla = pytest.importorskip("kdalab.fla")
    try:
        KimiDeltaAttention = kdafla.kda_layer_class()
    except ImportError as e:
        pytest.skip(str(e))
    calls = []
    real = kdafla.KdalabBackend.chunk_kda
    monkeypatch.setattr(kdafla.KdalabBackend, "chunk_kda", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    torch.manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=1024, head_dim=128, num_heads=8, safe_gate=True, lower_bound=-5.0)
    layer = layer.cuda().bfloat16().eval()
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        y = layer(x)[0]
        assert len(calls) == 1
        yf = _fla_own(layer, x)[0]
        assert len(calls) == 1
    assert rel_err(y, yf) < BOTH_TOL


# --------------------------------------------------------------------------
# training: the op's autograd on the backward's kernels (next/13_backward)
# --------------------------------------------------------------------------

GRADS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def _step_grads(fn, kw, seed=1):
    """Gradients of sum(o * do) + sum(ht * dht) through fn(**kw), fixed random cotangents (fp32 leaves stay fp32)."""
    leaves = {n: kw[n].detach().clone().requires_grad_() for n in GRADS if kw.get(n) is not None}
    o, ht = fn(**dict(kw, **leaves))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, device="cuda", generator=gen)).sum()
    if ht is not None:
        loss = loss + (ht.float() * torch.randn(ht.shape, device="cuda", generator=gen)).sum()
    loss.backward()
    return {n: t.grad for n, t in leaves.items()}


def _fp64_grads(kw, seed=1):
    """The same by autograd through the fp64 token loop, sequence by sequence, on the same bf16 values held in fp64
    (o rounded to bf16 as the op returns it, so that both cotangents are the same)."""
    H, K = kw["q"].shape[2:]
    lb = kw.get("lower_bound")

    def ref(q, k, v, g, beta, A_log, dt_bias, initial_state=None, cu_seqlens=None, state_v_first=False,
            output_final_state=True, **_):  # the call as common.kernel_model's fp64 model of the kernel takes it
        o, S = reference_outputs(q, k, v, g, beta, A_log, dt_bias.view(H, K), initial_state,
                                 scale=kw.get("scale") or K ** -0.5, gate_id=GATE_ID["softplus" if lb is None else
                                                                                     "bounded"],
                                 lower_bound=lb or 0.0, cu_seqlens=None if cu_seqlens is None else cu_seqlens.int(),
                                 max_seqlen=0, state_v_first=state_v_first, l2norm=True, beta_mode=1, seq_lens=())
        return o.to(q.device, torch.bfloat16), (S.to(q.device) if output_final_state else None)

    wide = {n: (t.double() if n in GRADS and t is not None else t) for n, t in kw.items()}  # the same values
    return _step_grads(ref, wide, seed)


REDUCED_PLAIN_TOL = 2e-2  # the CPU check of the bf16-state build: up to 7.4e-3 plain on dA_log (3.3e-4 of its terms)


@pytest.mark.parametrize("N", [None, 6])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_training_gradients_near_fp64(N, v_first, lower_bound):
    """kdalab.chunk_kda in training: every gradient, in its input's dtype, against autograd through the fp64
    token loop within stage 13's tolerances (B = 2 with h0 and a tail, or six packed sequences)."""
    tol = op_backward_stage().TOLERANCE
    kw = raw(B=1 if N else 2, T=300 if N else 150, H=2, D=128, N=N)
    kw.update(state_v_first=v_first, lower_bound=lower_bound, safe_gate=lower_bound is not None)
    if lower_bound is None:
        kw["A_log"] = torch.log(torch.rand(2, device="cuda") * 0.5 + 0.5)
    got, want = _step_grads(kdalab.chunk_kda, kw), _fp64_grads(kw)
    for n in got:
        assert got[n].dtype == kw[n].dtype and torch.isfinite(got[n]).all(), n
        err = rel_err(got[n], want[n])
        # dA_log and dt_bias are sums over every token that cancel: their plain relative error is several times
        # that of their terms (scripts/check_backward.py judges them against the terms' size)
        bound = REDUCED_PLAIN_TOL if n in ("A_log", "dt_bias") else tol["dinitial_state" if n == "initial_state"
                                                                          else "d" + n]
        assert err < bound, f"d{n}: {err:.2e}"


def op_backward_stage():
    from common.stages import load_next

    return load_next(op.BACKWARD)


@pytest.mark.parametrize("N", [None, 4])
def test_training_opcheck(N):
    kw = raw(T=100, H=2, D=64, N=N)
    cu = kw.get("cu_seqlens")
    args = [kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"].view(2, 64),
            kw["initial_state"], None if cu is None else cu.int(), 0.125, 1, -5.0, True, 1, True, True,
            0 if cu is None else int((cu[1:] - cu[:-1]).max()), [] if cu is None else (cu[1:] - cu[:-1]).tolist()]
    for i in range(8):
        args[i] = args[i].detach().clone().requires_grad_()
    torch.library.opcheck(torch.ops.kdalab.chunk_kda_fwd.default, tuple(args))


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_compiled_training_step_matches_eager(lower_bound):
    torch.manual_seed(0)
    layer = KDALayer(hidden_size=512, num_heads=4, head_dim=128, lower_bound=lower_bound).cuda().bfloat16()
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)

    def step(m, x):
        y, state = m(x)
        return y.float().pow(2).mean() + state.pow(2).mean()

    step(layer, x).backward()
    ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(layer, x).backward()
    for n, p in layer.named_parameters():  # inductor fuses the projections differently
        assert rel_err(p.grad, ref[n]) < 2e-2, f"{n}: {rel_err(p.grad, ref[n]):.2e}"


def test_fla_chunk_kda_trains_through_the_backend(monkeypatch):
    """With FLA_KDALAB_TRAIN=1, FLA's chunk_kda in training runs kdalab (the same gradients as kdalab.chunk_kda,
    bit for bit), and those are within twice FLA's own tolerance of FLA's own kernels' gradients."""
    fla = pytest.importorskip("fla.ops.kda")
    import kdalab.fla  # noqa: F401 - registers

    kw = raw(T=1024, H=32, D=128, N=6)  # H = 32, K = 128: the family scripts/bench_train.py tunes FLA's kernels for
    kw["state_v_first"] = True
    monkeypatch.setenv("FLA_KDALAB_TRAIN", "1")
    through, own = _step_grads(fla.chunk_kda, kw), _step_grads(kdalab.chunk_kda, kw)
    monkeypatch.setenv("FLA_KDALAB_TRAIN", "0")
    theirs = _fla_own(_step_grads, fla.chunk_kda, kw)
    for n in GRADS:
        assert torch.equal(through[n], own[n]), n
        assert rel_err(own[n], theirs[n]) < BOTH_TOL, f"d{n}: {rel_err(own[n], theirs[n]):.2e}"
