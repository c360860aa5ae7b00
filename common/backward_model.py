"""The chunked backward as the tensor-core backward's kernels are to compute it, in float64.

The forward's chunk algebra (DESIGN.md section 3) runs per chunk of BT tokens, the state S [K, V] carried
from chunk to chunk. Its adjoint separates the same way, into one serial walk and two parallel ones:

1. **states** (serial over chunks, as the forward's K2): the forward chain run again from h0, keeping the
   state every ``every`` chunks (a checkpoint) instead of every chunk, so that the memory of the saved states
   is that of FLA's 64-token chunks at ``every = 4``;
2. **the reverse chain** (serial, from the last chunk to the first): dS, the gradient of the state after a
   chunk, carried back through it,

       dvcorr = kr dS + Aqk^T do        dS <- diag(e^glast) dS + qd^T do - w^T dvcorr

   It needs no forward state, only each chunk's operands and do; it keeps dS every ``every`` chunks and
   gives dh0;
3. **the chunk adjoint** (parallel over chunks): each chunk's entry state and exit gradient, rebuilt from the
   nearest checkpoints (forward from the one before it, backward from the one after it), then that chunk's
   gradients of q, k, v, the log decay a and beta, through vcorr, o and the state update, the WY
   transform, the two products and the decays.

Everything is on activated inputs (q, k normalised, beta after its sigmoid, the log decay a), as
common.reference.kda_recurrence takes them; the products are taken pair by pair (each decay
e^{gc_i - gc_j} inside its pair's span), as stage 12 takes them where a chunk needs it, so no gate
overflows here. :func:`chunked_backward` returns what torch.autograd gives through kda_recurrence
(tests/test_backward_model.py), and, with ``trace``, the checkpoints and the reverse chain's dS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .contract import check_gate
from .reference import L2_EPS


def chunk_operands(qn, kn, v, b, a, *, scale: float, t0: int, t1: int) -> dict:
    """The forward's operands of the chunk of tokens [t0, t1) for every (batch, head), in the inputs'
    dtype: shapes [B, H, n, K] (n = t1 - t0), [B, H, n, V], [B, H, n, n], [B, H, K]."""
    q, k, vv = (x[:, t0:t1].transpose(1, 2) for x in (qn, kn, v))  # [B, H, n, *]
    beta = b[:, t0:t1].transpose(1, 2)  # [B, H, n]
    gc = a[:, t0:t1].transpose(1, 2).cumsum(2)  # [B, H, n, K]: the decay from the chunk's start through token c
    glast = gc[:, :, -1]  # [B, H, K]
    n = t1 - t0
    # e^{gc_c - gc_i}, pair by pair and only where c >= i (the exponent is then <= 0)
    diff = gc[:, :, :, None, :] - gc[:, :, None, :, :]  # [B, H, c, i, K]
    lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    dec = torch.where(lower[..., None], torch.exp(diff.clamp(max=0.0)), torch.zeros_like(diff))
    kk = torch.einsum("bhcd,bhid,bhcid->bhci", k, k, dec)  # sum_d k_c k_i e^{gc_c - gc_i}
    L = beta[..., None] * kk * torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)  # strictly lower
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    X = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False)  # (I + L)^-1
    Af = X * beta[:, :, None, :]
    ed = torch.exp(gc)  # e^{gc} <= 1
    kd = k * ed
    w, u = Af @ kd, Af @ vv
    Aqk = scale * torch.einsum("bhcd,bhid,bhcid->bhci", q, k, dec)  # lower, diagonal included
    qd = scale * q * ed
    kr = k * torch.exp(glast[:, :, None] - gc)
    return dict(q=q, k=k, v=vv, beta=beta, gc=gc, glast=glast, dec=dec, kk=kk, L=L, X=X, Af=Af, ed=ed, w=w, u=u,
                Aqk=Aqk, qd=qd, kr=kr, scale=scale)


def _exact(x):
    return x


def step(c: dict, S, rnd=_exact):
    """One chunk forward from the entry state S [B, H, K, V]: (vcorr, o, the exit state). ``rnd``: what each
    product's operands are rounded to (the tensor-core kernels': bf16)."""
    vcorr = c["u"] - rnd(c["w"]) @ rnd(S)
    o = rnd(c["qd"]) @ rnd(S) + rnd(c["Aqk"]) @ rnd(vcorr)
    S_out = torch.exp(c["glast"])[..., None] * S + rnd(c["kr"]).transpose(-1, -2) @ rnd(vcorr)
    return vcorr, o, S_out


def reverse_step(c: dict, dS_out, do, rnd=_exact):
    """One chunk of the reverse chain: (dvcorr, the gradient of the entry state); ``rnd`` as step's."""
    dvcorr = rnd(c["kr"]) @ rnd(dS_out) + rnd(c["Aqk"]).transpose(-1, -2) @ rnd(do)
    dS = torch.exp(c["glast"])[..., None] * dS_out + rnd(c["qd"]).transpose(-1, -2) @ rnd(do) \
        - rnd(c["w"]).transpose(-1, -2) @ rnd(dvcorr)
    return dvcorr, dS


def mma_chains(ws: dict, do, *, H: int, h0=None, dht=None) -> dict:
    """The two chains as the tensor-core kernels take them (next/13_backward/chains_mma.cuh), from B1's operands
    as the kernels hold them: ``ws`` qd, kr, w [slots, 16, K], u [slots, 16, V], Aqk [slots, 16, 16], el
    [slots, K], slot (b H + h) NT + n, for B plain sequences of T tokens (do [B, T, H, V]). step and reverse_step
    in float64 with every mma operand rounded to bf16, the states carried unrounded. Returns states, dstates
    [slots, K, V] (each chunk's entry state and the gradient of its exit state), vcorr, dvcorr [slots, 16, V] and
    dh0 [B, H, K, V]."""
    def bf(x):
        return x.to(torch.bfloat16).double()

    B, T, _, V = do.shape
    K, NT = ws["qd"].shape[-1], -(-T // 16)
    op = {n: ws[n].double().reshape(B, H, NT, *ws[n].shape[1:]) for n in ("qd", "kr", "w", "u", "Aqk", "el")}
    ops = [dict({n: op[n][:, :, i] for n in ("qd", "kr", "w", "u", "Aqk")}, glast=torch.log(op["el"][:, :, i]))
           for i in range(NT)]
    dos = F.pad(do.double(), (0, 0, 0, 0, 0, NT * 16 - T)).reshape(B, NT, 16, H, V).permute(0, 3, 1, 2, 4)
    zero = torch.zeros(B, H, K, V, dtype=torch.float64)
    out = {n: [None] * NT for n in ("states", "dstates", "vcorr", "dvcorr")}
    S = zero if h0 is None else h0.double()
    for n in range(NT):
        out["states"][n] = S
        out["vcorr"][n], _, S = step(ops[n], S, bf)
    dS = zero if dht is None else dht.double()
    for n in range(NT - 1, -1, -1):
        out["dstates"][n] = dS
        out["dvcorr"][n], dS = reverse_step(ops[n], dS, dos[:, :, n], bf)
    res = {n: torch.stack(x, 2).reshape(B * H * NT, *x[0].shape[2:]) for n, x in out.items()}
    return dict(res, dh0=dS)


def chunk_adjoint(c: dict, S, dS_out, do) -> dict:
    """The chunk's gradients (kernel 3) from its entry state S, the exit gradient dS_out and do:
    dq, dk, da [B, H, n, K], dv [B, H, n, V], dbeta [B, H, n] (of the activated inputs)."""
    vcorr, _, _ = step(c, S)
    dvcorr, _ = reverse_step(c, dS_out, do)
    n = c["q"].shape[2]
    incl = torch.ones(n, n, dtype=torch.bool, device=S.device).tril()
    strict = torch.ones(n, n, dtype=torch.bool, device=S.device).tril(-1)
    # o = qd S + Aqk vcorr;  S_out = diag(e^glast) S + kr^T vcorr;  vcorr = u - w S
    dqd = do @ S.transpose(-1, -2)
    dAqk = (do @ vcorr.transpose(-1, -2)) * incl
    dkr = vcorr @ dS_out.transpose(-1, -2)
    dglast = torch.exp(c["glast"]) * (S * dS_out).sum(-1)  # through diag(e^glast) S
    du, dw = dvcorr, -dvcorr @ S.transpose(-1, -2)
    # w = Af kd, u = Af v;  Af = X diag(beta);  X = (I + L)^-1
    dAf = dw @ (c["k"] * c["ed"]).transpose(-1, -2) + du @ c["v"].transpose(-1, -2)
    dkd = c["Af"].transpose(-1, -2) @ dw
    dv = c["Af"].transpose(-1, -2) @ du
    dbeta = (dAf * c["X"]).sum(-2)  # d Af[c, j] / d beta_j = X[c, j]
    dX = dAf * c["beta"][:, :, None, :]
    Xt = c["X"].transpose(-1, -2)
    dL = -(Xt @ dX @ Xt) * strict  # the inverse's VJP, on L's strictly lower entries
    # L = strict_lower(beta_c kk[c, i]);  Aqk = scale * lower_incl(q_c . k_i e^{gc_c - gc_i})
    dbeta = dbeta + (dL * c["kk"]).sum(-1)
    dkk = dL * c["beta"][..., None]
    dq = torch.zeros_like(c["q"])
    dk = torch.zeros_like(c["k"])
    dgc = torch.zeros_like(c["gc"])
    # a pair (c, i) with weight W: sum_d x_c[d] k_i[d] e^{gc_c[d] - gc_i[d]}
    for W, x, dx in ((dkk, c["k"], dk), (dAqk * c["scale"], c["q"], dq)):
        t = W[..., None] * c["dec"]  # [B, H, c, i, K]
        dx += torch.einsum("bhcid,bhid->bhcd", t, c["k"])
        dk += torch.einsum("bhcid,bhcd->bhid", t, x)
        pair = t * x[:, :, :, None, :] * c["k"][:, :, None, :, :]
        dgc += pair.sum(3) - pair.sum(2)
    # kd = k e^{gc}, qd = scale q e^{gc}, kr = k e^{glast - gc}
    dk += dkd * c["ed"] + dkr * torch.exp(c["glast"][:, :, None] - c["gc"])
    dq += dqd * c["scale"] * c["ed"]
    dgc += dkd * c["k"] * c["ed"] + dqd * c["qd"] - dkr * c["kr"]
    dglast = dglast + (dkr * c["kr"]).sum(2)
    # gc = cumsum(a), glast = gc[last]: a token's a reaches every gc at or after it, and glast
    da = dgc.flip(2).cumsum(2).flip(2) + dglast[:, :, None]
    return dict(dq=dq, dk=dk, dv=dv, da=da, dbeta=dbeta)


OPERANDS = ("qd", "kr", "w", "u", "Aqk")  # what a prepare kernel hands the chains, stored as bf16 by the kernels


def chunked_backward(qn, kn, v, b, a, do, dht=None, *, scale: float, initial_state=None, chunk: int = 16,
                     every: int = 4, trace: bool = False, operands=None, checkpoints=None) -> dict:
    """The gradients of o = kda_recurrence(qn, kn, v, b, a)[0] and its final state, given do [B, T, H, V] and
    dht [B, H, K, V] (None: zero), through the three kernels of the module docstring: dqn, dkn, dv, da
    [B, T, H, *], db [B, T, H] and dh0 [B, H, K, V]. With ``trace`` also the checkpoints (``states``: the entry
    state of every ``every``-th chunk) and the reverse chain's (``dstates``: the exit gradient of every
    ``every``-th chunk's last chunk of its group, and of the last chunk). ``operands`` and ``checkpoints`` (None:
    exact) round what the kernels keep in memory, as they would, e.g. ``lambda x: x.to(torch.bfloat16).to(x.dtype)``:
    the chains' operands (OPERANDS) and do, and the two chains' checkpoints; every product is then taken exactly on
    the rounded values (fp32 accumulation is near exact beside bf16's rounding), which predicts what the storage
    costs in accuracy."""
    if chunk < 1 or every < 1:
        raise ValueError(f"chunk and every must be positive, got {chunk} and {every}")
    B, T, H, K = qn.shape
    V = v.shape[-1]
    spans = [(t0, min(t0 + chunk, T)) for t0 in range(0, T, chunk)]
    ops = [chunk_operands(qn, kn, v, b, a, scale=scale, t0=s, t1=e) for s, e in spans]
    same = lambda x: x  # noqa: E731
    rop, keep = operands or same, checkpoints or same
    if operands is not None:
        ops = [dict(c, **{x: rop(c[x]) for x in OPERANDS}) for c in ops]
    S = qn.new_zeros(B, H, K, V) if initial_state is None else initial_state
    # 1. states: the entry state of chunks 0, every, 2 every, ...
    states = {}
    for n, c in enumerate(ops):
        if n % every == 0:
            states[n] = keep(S)
        S = step(c, S)[2]
    # 2. the reverse chain: the exit gradient of the last chunk of each group (chunks every-1, 2 every-1, ...)
    dS = qn.new_zeros(B, H, K, V) if dht is None else dht
    dstates = {}
    dos = [rop(do[:, s:e].transpose(1, 2)) for s, e in spans]
    for n in range(len(ops) - 1, -1, -1):
        if n % every == every - 1 or n == len(ops) - 1:
            dstates[n] = keep(dS)
        dS = reverse_step(ops[n], dS, dos[n])[1]
    dh0 = dS
    # 3. the chunk adjoint, each group rebuilt from its two checkpoints
    out = {x: [] for x in ("dq", "dk", "dv", "da", "dbeta")}
    for g0 in range(0, len(ops), every):
        g1 = min(g0 + every, len(ops))
        entry, S = [], states[g0]
        for n in range(g0, g1):
            entry.append(S)
            S = step(ops[n], S)[2]
        exits, dS = [None] * (g1 - g0), dstates[g1 - 1]
        for n in range(g1 - 1, g0 - 1, -1):
            exits[n - g0] = dS
            dS = reverse_step(ops[n], dS, dos[n])[1]
        for n in range(g0, g1):
            g = chunk_adjoint(ops[n], entry[n - g0], exits[n - g0], dos[n])
            for x in out:
                out[x].append(g[x])
    res = {"dqn": torch.cat(out["dq"], 2).transpose(1, 2), "dkn": torch.cat(out["dk"], 2).transpose(1, 2),
           "dv": torch.cat(out["dv"], 2).transpose(1, 2), "da": torch.cat(out["da"], 2).transpose(1, 2),
           "db": torch.cat(out["dbeta"], 2).transpose(1, 2), "dh0": dh0}
    if trace:
        res.update(states=states, dstates=dstates)
    return res


def activation_backward(q, k, g, beta, A_log, dt_bias, dqn, dkn, db, da, *, gate="softplus", lower_bound=None):
    """The pre-stage's adjoint (common.reference.activate walked back), as the kernels take it: from the
    gradients of the activated inputs to those of the raw ones. q, k normalised (qn = q / r, r = sqrt(|q|^2 +
    eps): dq = (dqn - qn (qn . dqn)) / r), beta through its sigmoid, and the gate, its two partial derivatives
    taken from the raw x = g + dt_bias:

    - softplus, a = -A softplus(x): da/dx = -A sigmoid(x), da/dA_log = a;
    - bounded, a = lb sigmoid(A x), s = sigmoid(A x): da/dx = lb s (1 - s) A, da/dA_log = da/dx x.

    dt_bias and A_log are shared by every token, so their gradients are sums over batch and tokens (and, for
    A_log, key dimensions). Returns dq, dk, dg [B, T, H, K], dbeta [B, T, H], dA_log [H], ddt_bias [H, K]."""
    gate, _, lb = check_gate(gate, lower_bound)

    def l2_back(x, dxn):
        r = torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)
        xn = x / r
        return (dxn - xn * (xn * dxn).sum(-1, keepdim=True)) / r

    s_beta = torch.sigmoid(beta)
    A = torch.exp(A_log)[None, None, :, None]
    x = g + dt_bias[None, None]
    if gate == "softplus":
        dadx = -A * torch.sigmoid(x)
        dadlog = -A * F.softplus(x)  # a itself
    else:
        s = torch.sigmoid(A * x)
        dadx = lb * s * (1 - s) * A
        dadlog = dadx * x
    dg = da * dadx
    return dict(dq=l2_back(q, dqn), dk=l2_back(k, dkn), dg=dg, dbeta=db * s_beta * (1 - s_beta),
                dA_log=(da * dadlog).sum((0, 1, 3)), ddt_bias=dg.sum((0, 1)))
