"""scripts/split_chain.py's split (the chain cut into segments joined by the scan of their affine maps) on the
CPU: against the fp64 token loop run whole, it must give the same o and final state at round-off, for any
number of segments, with and without h0, the bounded and the softplus gate's decays; segment_bounds cuts at
whole chunks; a wrong map (the scan without M) must fail."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import split_chain as sc  # noqa: E402

from common.reference import kda_recurrence  # noqa: E402

F64 = torch.float64


def _forward(q, k, v, g, beta, *, cu_seqlens, initial_state, output_final_state, scale):
    """A packed-sequence forward on activated inputs (g is the log decay): each sequence from its own state."""
    cu = cu_seqlens.tolist()
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    o, states = torch.zeros_like(v), []
    for i, (s, e) in enumerate(zip(cu, cu[1:])):
        S0 = torch.zeros(1, H, K, V, dtype=F64) if initial_state is None else initial_state[i:i + 1].to(F64)
        on, S = kda_recurrence(q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], g[:, s:e], scale=scale,
                               initial_state=S0)
        o[:, s:e] = on
        states.append(S[0])
    return o, torch.stack(states)


def _inputs(T, H, K, amin, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, H, K, dtype=F64, generator=gen) for _ in range(2))
    q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    v = torch.randn(1, T, H, K, dtype=F64, generator=gen)
    a = amin * torch.rand(1, T, H, K, dtype=F64, generator=gen)
    b = torch.rand(1, T, H, dtype=F64, generator=gen)
    h0 = torch.randn(1, H, K, K, dtype=F64, generator=gen)
    return q, k, v, a, b, h0


@pytest.mark.parametrize("T,n,amin,h0", [(100, 3, -0.2, True), (256, 16, -0.05, False), (77, 5, -3.0, True),
                                         (64, 1, -0.5, True)])
def test_split_is_the_whole_chain(T, n, amin, h0):
    q, k, v, a, b, S0 = _inputs(T, 2, 8, amin)
    S0 = S0 if h0 else None
    o_ref, S_ref = kda_recurrence(q, k, v, b, a, scale=0.5, initial_state=S0)
    o, S = sc.split_forward(_forward, q, k, v, a, b, n_segments=n, initial_state=S0, scale=0.5)
    assert float((o - o_ref).norm() / o_ref.norm()) < 1e-12
    assert float((S - S_ref).norm() / S_ref.norm()) < 1e-12


def test_a_scan_without_the_maps_fails(monkeypatch):
    q, k, v, a, b, S0 = _inputs(100, 2, 8, -0.02)
    o_ref, _ = kda_recurrence(q, k, v, b, a, scale=0.5, initial_state=S0)
    real = torch.eye

    def no_map(n, *args, **kw):  # M = 0: every segment starts from C of the one before, h0 forgotten
        return real(n, *args, **kw) * 0
    monkeypatch.setattr(sc.torch, "eye", no_map)
    o, _ = sc.split_forward(_forward, q, k, v, a, b, n_segments=4, initial_state=S0, scale=0.5)
    assert float((o - o_ref).norm() / o_ref.norm()) > 1e-3


def test_segment_bounds():
    assert sc.segment_bounds(100, 3) == [0, 48, 96, 100]
    assert sc.segment_bounds(64, 4) == [0, 16, 32, 48, 64]
    assert sc.segment_bounds(65536, 32)[1] == 2048
    with pytest.raises(ValueError, match="positive"):
        sc.segment_bounds(64, 0)
    with pytest.raises(ValueError, match="need T"):
        sc.segment_bounds(64, 5)
