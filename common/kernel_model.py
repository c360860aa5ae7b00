"""What a tensor-core stage's ``fwd`` computes from its arguments, as fp64 math on the CPU.

The varlen stages' binding (stages 11, 12: ``kda.cu`` behind ``binding.cpp``) takes the kernel's view
of a call: a gate id and bound, flags for the work it may do inside (l2norm, the beta mode), the state's
layout, the packed sequences with a bound of the longest and their lengths as the host knows them.
:class:`ReferenceExtension` stands in for that binding on the CPU and gives each argument its meaning,
on the fp64 token loop (common.reference.kda_recurrence):

- ``scale`` multiplies o as it is (0.0 gives o = 0);
- ``gate_id`` 0: the softplus gate -exp(A_log) softplus(g + dt_bias); 1: the bounded gate
  lower_bound sigmoid(exp(A_log) (g + dt_bias)); 3: g is the log decay itself, which a bound
  ``lower_bound`` < 0 promises lies in [lower_bound, 0] (the factored products' range: a decay below
  it makes the whole call NaN, as the kernel's products would overflow), 0: no bound;
- ``l2norm``: q and k normalised as the reference normalises them, else taken as given;
- ``beta_mode`` 0: beta as given, 1: sigmoid(beta), 2: 2 sigmoid(beta);
- ``h0`` and ``ht`` [N, H, K, V], or [N, H, V, K] with ``state_v_first``;
- ``cu_seqlens``: the sequences of a [1, T, H, *] call, each from its own initial state;
  ``max_seqlen`` bounds the tokens a sequence runs (0: T): the kernel's launch covers no more, so tokens
  past it are left unwritten (NaN here) and the final state is the one at the bound; ``seq_lens`` (the
  lengths as the host knows them, [] when not known) plans the hybrid's long sequences, so a sequence
  whose length it gives wrong comes out NaN.

Every element of o and ht is written (NaN where the kernel would leave it unwritten). The op's CPU tests
run ``kdalab.chunk_kda`` on it and compare with FLA's own reference, so that each flag is checked for what
it means, not for how it is spelled (tests/test_op.py).
"""

from __future__ import annotations

import concurrent.futures

import torch

from .contract import GATE_ID
from .reference import L2_EPS, kda_recurrence, log_decay

GATE_IDS = tuple(GATE_ID.values())  # softplus, bounded, the log decay (the contract's gate table)


class ReferenceExtension:
    """Stands in for a varlen stage's compiled extension (its ``fwd``) on CPU tensors; records each call's
    arguments in ``calls`` (the last in ``last``; a list several models may share), with the stage it
    stands in for."""

    def __init__(self, stage: str = "11", calls: list | None = None):
        self.stage, self.calls = stage, ([] if calls is None else calls)

    @property
    def last(self) -> dict:
        return self.calls[-1]

    def fwd(self, q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, chunk_size, o, ht, prof,
            fused=-1, ncw=0, segment_chunks=0, cu_seqlens=None, max_seqlen=0, state_v_first=False,
            l2norm=True, beta_mode=1, *, seq_lens=(), long_from=-1, pairwise=-1, u_halves=True,
            deep_ring=-1):
        """The binding's fwd (the arguments after beta_mode by name: stages 11 and 12 order them apart)."""
        self.calls.append(dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=h0, scale=scale,
                               gate_id=gate_id, lower_bound=lower_bound, chunk_size=chunk_size, o=o, ht=ht,
                               prof=prof, fused=fused, ncw=ncw, segment_chunks=segment_chunks,
                               cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, state_v_first=state_v_first,
                               l2norm=l2norm, beta_mode=beta_mode, seq_lens=list(seq_lens), long_from=long_from,
                               pairwise=pairwise, u_halves=u_halves, deep_ring=deep_ring,
                               stage=self.stage))
        with torch.no_grad():
            o_out, S_out = reference_outputs(q, k, v, g, beta, A_log, dt_bias, h0, scale=scale, gate_id=gate_id,
                                  lower_bound=lower_bound, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                  state_v_first=state_v_first, l2norm=l2norm, beta_mode=beta_mode,
                                  seq_lens=seq_lens)
        o.copy_(o_out.to(o.dtype))
        ht.copy_(S_out.to(ht.dtype))

    def bwd(self, q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, chunk_size, dout, dht, dq, dk,
            dv, dg, dbeta, dA_log, ddt_bias, dh0, prof, cu_seqlens=None, max_seqlen=0, seq_lens=(),
            state_v_first=False):
        """The backward's binding (stage 13's bwd, common.extrun's order, the varlen arguments by name): every
        gradient by autograd through the fp64 token loop, written into the buffers given. It takes what that
        binding takes: the gate in the kernel (gate_id 0 or 1), q and k normalised and sigmoid(beta) always."""
        self.calls.append(dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=h0, scale=scale,
                               gate_id=gate_id, lower_bound=lower_bound, chunk_size=chunk_size, dout=dout, dht=dht,
                               cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seq_lens=list(seq_lens),
                               state_v_first=state_v_first, kind="bwd", stage=self.stage))
        if gate_id not in (GATE_ID["softplus"], GATE_ID["bounded"]):
            raise ValueError(f"the backward takes gate_id 0 (softplus) or 1 (bounded), got {gate_id}")
        if (dh0 is None) != (h0 is None):
            raise ValueError("dh0 is given exactly when h0 is")
        f64 = torch.float64
        leaves = [None if t is None else t.detach().to("cpu", f64).requires_grad_()
                  for t in (q, k, v, g, beta, A_log, dt_bias, h0)]

        def autograd():
            o, S = reference_outputs(*leaves, scale=scale, gate_id=gate_id, lower_bound=lower_bound, cu_seqlens=cu_seqlens,
                          max_seqlen=max_seqlen, state_v_first=state_v_first, l2norm=True, beta_mode=1,
                          seq_lens=seq_lens)
            outs, cots = [o], [dout.detach().to("cpu", f64)]
            if dht is not None:
                outs.append(S)
                cots.append(dht.detach().to("cpu", f64))
            return torch.autograd.grad(outs, [t for t in leaves if t is not None], cots, allow_unused=True)

        # in a thread of its own: inside a custom op's kernel torch has turned autograd off for this thread
        # (a dispatch key excluded in thread-local state, which torch.enable_grad does not undo)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            grads = iter(pool.submit(autograd).result())
        for buf, leaf in zip((dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0), leaves):
            if leaf is None:
                continue
            d = next(grads)
            buf.copy_(torch.zeros_like(leaf) if d is None else d)


def reference_outputs(q, k, v, g, beta, A_log, dt_bias, h0, *, scale, gate_id, lower_bound, cu_seqlens, max_seqlen,
           state_v_first, l2norm, beta_mode, seq_lens):
    """o [B, T, H, V] and the final states [N, H, K, V] (V-first: [N, H, V, K]) in fp64 on the CPU, as the
    binding's arguments mean them (the module's docstring); differentiable in every tensor."""
    if gate_id not in GATE_IDS:
        raise ValueError(f"gate_id must be one of {GATE_IDS}, got {gate_id}")
    if beta_mode not in (0, 1, 2):
        raise ValueError(f"beta_mode must be 0, 1 or 2, got {beta_mode}")
    if cu_seqlens is not None and cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    f64 = torch.float64
    B, T, H, K = q.shape
    qd, kd, vd, gd, bd = (t.to("cpu", f64) for t in (q, k, v, g, beta))
    if l2norm:
        qd = qd / torch.sqrt((qd * qd).sum(-1, keepdim=True) + L2_EPS)
        kd = kd / torch.sqrt((kd * kd).sum(-1, keepdim=True) + L2_EPS)
    bd = {0: bd, 1: torch.sigmoid(bd), 2: 2 * torch.sigmoid(bd)}[beta_mode]
    if gate_id == GATE_ID["log_decay"]:
        a = gd
        if lower_bound < 0 and bool((a < lower_bound).any()):  # past the factored products' range
            a = torch.full_like(a, float("nan"))
    else:
        a = log_decay(gd, A_log.to("cpu", f64), dt_bias.to("cpu", f64),
                      gate="softplus" if gate_id == GATE_ID["softplus"] else "bounded",
                      lower_bound=None if gate_id == GATE_ID["softplus"] else lower_bound)
    S0 = None if h0 is None else h0.to("cpu", f64)
    if S0 is not None and state_v_first:
        S0 = S0.transpose(-1, -2)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, s, e) for s, e in zip(cu, cu[1:])]
    bound = T if max_seqlen == 0 else int(max_seqlen)
    lengths = [e - s for _, s, e in spans]
    wrong_lengths = bool(seq_lens) and list(seq_lens) != lengths
    V = v.shape[-1]
    o_out = torch.full((B, T, H, V), float("nan"), dtype=f64)
    S_out = torch.zeros(len(spans), H, K, V, dtype=f64)
    for n, (b, s, e) in enumerate(spans):
        run = min(e - s, bound)
        S = torch.zeros(1, H, K, V, dtype=f64) if S0 is None else S0[n:n + 1]
        if run > 0:
            sl = slice(s, s + run)
            on, S = kda_recurrence(qd[b:b + 1, sl], kd[b:b + 1, sl], vd[b:b + 1, sl], bd[b:b + 1, sl],
                                   a[b:b + 1, sl], scale=scale, initial_state=S)
            o_out[b:b + 1, sl] = on
        S_out[n] = S[0]
        if wrong_lengths and seq_lens[n] != e - s:
            o_out[b, s:e] = float("nan")
            S_out[n] = float("nan")
    if state_v_first:
        S_out = S_out.transpose(-1, -2)
    return o_out, S_out
