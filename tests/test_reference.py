"""The fp64 reference itself, checked against the recurrence written out by hand."""

import pytest
import torch

from common.inputs import make_inputs
from common.reference import activate, kda_reference


def test_two_tokens_by_hand():
    kw = make_inputs(1, 2, 1, 4, 3, seed=5, dtype=torch.float64)
    kw = {n: (t.double() if torch.is_tensor(t) else t) for n, t in kw.items()}
    o, S = kda_reference(**kw)
    qn, kn, b, a = activate(kw["q"], kw["k"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"])
    S_ = kw["initial_state"][0, 0].clone()
    scale = 4 ** -0.5
    for t in range(2):
        S_ = torch.diag(torch.exp(a[0, t, 0])) @ S_
        k_, v_, q_ = kn[0, t, 0], kw["v"][0, t, 0], qn[0, t, 0]
        S_ = S_ + b[0, t, 0] * torch.outer(k_, v_ - S_.T @ k_)
        assert torch.allclose(o[0, t, 0], scale * S_.T @ q_, rtol=1e-12, atol=1e-12)
    assert torch.allclose(S[0, 0], S_, rtol=1e-12, atol=1e-12)


def test_gates():
    g = torch.randn(1, 3, 2, 4, dtype=torch.float64)
    A_log = torch.tensor([0.3, -0.2], dtype=torch.float64)
    dt = torch.randn(2, 4, dtype=torch.float64)
    x = g + dt
    _, _, _, a = activate(g, g, g, g[..., 0], A_log, dt, gate="softplus")
    assert torch.allclose(a, -torch.exp(A_log)[:, None] * torch.log1p(torch.exp(x)))
    _, _, _, a = activate(g, g, g, g[..., 0], A_log, dt, gate="bounded", lower_bound=-3.0)
    assert torch.allclose(a, -3.0 / (1 + torch.exp(-torch.exp(A_log)[:, None] * x)))
    assert (a < 0).all() and (a > -3.0).all()


@pytest.mark.parametrize("lb", [-1.0, -2.5, -5.0])
def test_bounded_gate_spans_its_bounds(lb):
    """The bounded gate's log-decay lies in [lower_bound, 0], falls as g grows,
    and reaches lower_bound for a large g and 0 for a very negative one (a gate
    that ignored or clamped lower_bound would miss one end)."""
    g = torch.linspace(-60, 60, 121, dtype=torch.float64).reshape(1, 121, 1, 1)
    zero = torch.zeros(1, dtype=torch.float64)
    _, _, _, a = activate(g, g, g, g[..., 0], zero, zero.reshape(1, 1), gate="bounded", lower_bound=lb)
    a = a.flatten()
    assert (a >= lb).all() and (a <= 0).all() and (a[1:] <= a[:-1]).all()
    assert abs(a[-1].item() - lb) < 1e-12 and abs(a[0].item()) < 1e-12


def test_final_state_flag():
    kw = make_inputs(1, 5, 1, 4, 4, seed=1)
    kw["output_final_state"] = False
    o, S = kda_reference(**kw)
    assert S is None and o.shape == (1, 5, 1, 4)
