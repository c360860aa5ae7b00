"""The chunked backward's algorithm (common.backward_model), the specification the tensor-core backward's
kernels follow: against torch.autograd through the fp64 token loop (common.reference), at round-off, on
shapes where an indexing error would show (B > 1 with h0, a tail chunk, K != V, one group of checkpoints
shorter than the rest, a decay far past what a factored product could hold), both gates through the
pre-stage's adjoint; and a planted error in each of its three parts must fail."""

import pytest
import torch

from common import backward_model as bm
from common.reference import activate, kda_recurrence

F64 = torch.float64
TOL = 1e-12  # fp64 round-off; the errors measured here are below 1e-14


def _inputs(B, T, H, K, V, *, h0=True, amin=-1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, dtype=F64, generator=gen) for _ in range(2))
    qn, kn = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    v = torch.randn(B, T, H, V, dtype=F64, generator=gen)
    b = torch.rand(B, T, H, dtype=F64, generator=gen)
    a = amin * torch.rand(B, T, H, K, dtype=F64, generator=gen)
    S0 = torch.randn(B, H, K, V, dtype=F64, generator=gen) if h0 else None
    do = torch.randn(B, T, H, V, dtype=F64, generator=gen)
    dht = torch.randn(B, H, K, V, dtype=F64, generator=gen)
    return qn, kn, v, b, a, S0, do, dht


def _autograd(qn, kn, v, b, a, S0, do, dht, scale):
    leaves = [x.clone().requires_grad_() for x in (qn, kn, v, b, a)] + \
        ([S0.clone().requires_grad_()] if S0 is not None else [])
    o, S = kda_recurrence(*leaves[:5], scale=scale, initial_state=leaves[5] if S0 is not None else None)
    ((o * do).sum() + (S * dht).sum()).backward()
    names = ["dqn", "dkn", "dv", "db", "da"] + (["dh0"] if S0 is not None else [])
    return {n: x.grad for n, x in zip(names, leaves)}


def _errors(case, **kw):
    qn, kn, v, b, a, S0, do, dht = _inputs(**case)
    scale = case["K"] ** -0.5
    ref = _autograd(qn, kn, v, b, a, S0, do, dht, scale)
    got = bm.chunked_backward(qn, kn, v, b, a, do, dht, scale=scale, initial_state=S0, **kw)
    return {n: float((got[n] - r).norm() / r.norm()) for n, r in ref.items()}


CASES = [
    (dict(B=2, T=50, H=3, K=8, V=8), dict(chunk=16, every=4)),  # B > 1 with h0, a tail chunk, one group
    (dict(B=1, T=64, H=2, K=16, V=8, h0=False), dict(chunk=16, every=1)),  # K != V, a checkpoint per chunk
    (dict(B=2, T=37, H=2, K=8, V=12), dict(chunk=8, every=3)),  # the last group shorter than the others
    (dict(B=1, T=33, H=1, K=8, V=8, amin=-60.0), dict(chunk=16, every=2)),  # chunks decaying by hundreds
]


@pytest.mark.parametrize("case,kw", CASES)
def test_chunked_backward_is_autograd(case, kw):
    errs = _errors(case, **kw)
    assert max(errs.values()) < TOL, errs


def test_checkpoints_are_the_forward_states_and_the_chain_is_the_state_gradient():
    qn, kn, v, b, a, S0, do, dht = _inputs(B=1, T=48, H=1, K=8, V=8)
    got = bm.chunked_backward(qn, kn, v, b, a, do, dht, scale=0.5, initial_state=S0, every=2, trace=True)
    assert sorted(got["states"]) == [0, 2] and sorted(got["dstates"]) == [1, 2]
    _, S32 = kda_recurrence(qn[:, :32], kn[:, :32], v[:, :32], b[:, :32], a[:, :32], scale=0.5, initial_state=S0)
    assert torch.allclose(got["states"][2], S32, rtol=0, atol=1e-12)
    assert torch.equal(got["dstates"][2], dht)  # the last chunk's exit gradient is the final state's


@pytest.mark.parametrize("gate,lb", [("softplus", None), ("bounded", -5.0)])
def test_activation_backward_is_autograd(gate, lb):
    gen = torch.Generator().manual_seed(1)
    B, T, H, K = 2, 9, 3, 4
    q, k, g = (torch.randn(B, T, H, K, dtype=F64, generator=gen).requires_grad_() for _ in range(3))
    beta = torch.randn(B, T, H, dtype=F64, generator=gen).requires_grad_()
    A_log = torch.randn(H, dtype=F64, generator=gen).requires_grad_()
    dt_bias = torch.randn(H, K, dtype=F64, generator=gen).requires_grad_()
    outs = activate(q, k, g, beta, A_log, dt_bias, gate=gate, lower_bound=lb)
    grads = [torch.randn_like(x) for x in outs]
    sum((x * d).sum() for x, d in zip(outs, grads)).backward()
    got = bm.activation_backward(q.detach(), k.detach(), g.detach(), beta.detach(), A_log.detach(),
                                 dt_bias.detach(), grads[0], grads[1], grads[2], grads[3], gate=gate, lower_bound=lb)
    for name, ref in (("dq", q.grad), ("dk", k.grad), ("dg", g.grad), ("dbeta", beta.grad), ("dA_log", A_log.grad),
                      ("ddt_bias", dt_bias.grad)):
        assert float((got[name] - ref).norm() / ref.norm()) < TOL, name


@pytest.mark.parametrize("part", ["reverse_step", "chunk_adjoint", "checkpoint"])
def test_a_planted_error_in_each_part_fails(monkeypatch, part):
    case, kw = CASES[0]
    if part == "reverse_step":  # the state's gradient without its decay
        real = bm.reverse_step

        def wrong(c, dS_out, do):
            dvcorr, dS = real(c, dS_out, do)
            return dvcorr, dS - torch.exp(c["glast"])[..., None] * dS_out + dS_out
        monkeypatch.setattr(bm, "reverse_step", wrong)
    elif part == "chunk_adjoint":  # the inverse's VJP taken untransposed
        real_adj = bm.chunk_adjoint

        def wrong_adj(c, S, dS_out, do):
            c = dict(c, X=c["X"].transpose(-1, -2))
            return real_adj(c, S, dS_out, do)
        monkeypatch.setattr(bm, "chunk_adjoint", wrong_adj)
    else:  # a group rebuilt from the wrong checkpoint
        real_step = bm.step
        calls = {"n": 0}

        def wrong_step(c, S):
            calls["n"] += 1
            return real_step(c, S + (0.01 if calls["n"] == 6 else 0.0))  # the group's second entry state
        monkeypatch.setattr(bm, "step", wrong_step)
    errs = _errors(case, **kw)
    assert max(errs.values()) > 1e-6, errs


def test_bad_arguments():
    qn, kn, v, b, a, S0, do, dht = _inputs(B=1, T=8, H=1, K=4, V=4)
    for kw in (dict(chunk=0), dict(every=0)):
        with pytest.raises(ValueError, match="must be positive"):
            bm.chunked_backward(qn, kn, v, b, a, do, dht, scale=0.5, **kw)


def test_rounding_what_is_stored_reaches_the_gradients_it_should():
    """bf16 checkpoints move the chunk adjoint's gradients but not dh0 (the reverse chain reads no checkpoint);
    bf16 operands move every gradient, by bf16's relative rounding, not more."""
    qn, kn, v, b, a, S0, do, dht = _inputs(B=1, T=64, H=2, K=16, V=16)
    ref = _autograd(qn, kn, v, b, a, S0, do, dht, 0.25)

    def bf16(x):
        return x.to(torch.bfloat16).to(x.dtype)

    def err(got, n):
        return float((got[n] - ref[n]).norm() / ref[n].norm())
    ck = bm.chunked_backward(qn, kn, v, b, a, do, dht, scale=0.25, initial_state=S0, every=2, checkpoints=bf16)
    assert err(ck, "dh0") < TOL and 1e-5 < err(ck, "dkn") < 1e-2
    op = bm.chunked_backward(qn, kn, v, b, a, do, dht, scale=0.25, initial_state=S0, every=2, operands=bf16)
    assert all(1e-5 < err(op, n) < 1e-2 for n in ("dqn", "dkn", "dv", "db", "da", "dh0"))
