"""Ground truth: the KDA recurrence token by token in float64 (DESIGN.md section 2).

This is deliberately *not* the chunked algorithm: it checks every stage
independently of the chunked algebra. It is differentiable (torch.autograd), so
the same function gives reference gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .contract import check_gate

L2_EPS = 1e-6


def activate(q, k, g, beta, A_log, dt_bias, *, gate="softplus", lower_bound=None):
    """The pre-stage in the dtype of its inputs: L2-normalised q, k, sigmoid(beta)
    and the log-decay a (per token, head and key dimension).

    Shapes: q, k, g [B, T, H, K]; beta [B, T, H]; A_log [H]; dt_bias [H, K].
    """
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    b = torch.sigmoid(beta)
    return qn, kn, b, log_decay(g, A_log, dt_bias, gate=gate, lower_bound=lower_bound)


def log_decay(g, A_log, dt_bias, *, gate="softplus", lower_bound=None):
    """The gate alone: the log-decay a [B, T, H, K] of the raw g [B, T, H, K] (A_log [H],
    dt_bias [H, K]), in the dtype of its inputs; the last of :func:`activate`'s four."""
    gate, _, lb = check_gate(gate, lower_bound)
    A = torch.exp(A_log)[None, None, :, None]  # [1, 1, H, 1]
    x = g + dt_bias[None, None]  # [B, T, H, K]
    if gate == "softplus":
        return -A * F.softplus(x)
    return lb * torch.sigmoid(A * x)


def kda_reference(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
                  output_final_state=True, gate="softplus", lower_bound=None, chunk_size=None,
                  dtype=torch.float64):
    """Token-by-token KDA in ``dtype`` (float64 by default).

    For each t, with S of shape [K, V] per (batch, head):
        S <- diag(exp(a_t)) S
        S <- S + beta_t k_t (v_t - S^T k_t)^T
        o_t = scale S^T q_t
    Returns o [B, T, H, V] and the final state [B, H, K, V] (None if not asked),
    both in ``dtype``. ``chunk_size`` is accepted and ignored, so the reference
    takes the stage call unchanged.
    """
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    A_log, dt_bias = A_log.to(dtype), dt_bias.to(dtype)
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    qn, kn, b, a = activate(q, k, g, beta, A_log, dt_bias, gate=gate, lower_bound=lower_bound)
    h0 = None if initial_state is None else initial_state.to(dtype)
    o, S = kda_recurrence(qn, kn, v, b, a, scale=scale, initial_state=h0)
    return o, (S if output_final_state else None)


def kda_recurrence(qn, kn, v, b, a, *, scale, initial_state=None):
    """The token loop on activated inputs (q, k normalised, beta after sigmoid,
    log-decay a). Shapes as kda_reference; returns (o, final state)."""
    B, T, H, K = qn.shape
    V = v.shape[-1]
    if initial_state is None:
        S = torch.zeros(B, H, K, V, dtype=qn.dtype, device=qn.device)
    else:
        S = initial_state
    outs = []
    for t in range(T):
        S = S * torch.exp(a[:, t])[..., None]  # [B, H, K, V]
        kt = kn[:, t]  # [B, H, K]
        pred = torch.einsum("bhkv,bhk->bhv", S, kt)  # S^T k
        delta = b[:, t][..., None] * (v[:, t] - pred)  # [B, H, V]
        S = S + kt[..., None] * delta[..., None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, qn[:, t]))
    return torch.stack(outs, dim=1), S  # [B, T, H, V], [B, H, K, V]
