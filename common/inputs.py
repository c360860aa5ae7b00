"""Seeded random inputs with the distributions a real KDA layer sees.

- q, k, v: standard normal (q and k are L2-normalised inside the operator).
- g: standard normal raw gate input.
- beta: normal logits around 0 (sigmoid spreads them over (0, 1)).
- softplus gate: A_log = log of a rate drawn uniformly from [1, 16] per head
  and dt_bias = inverse softplus of a time step drawn log-uniformly from
  [1e-3, 1e-1] per head and key dimension (Mamba's / FLA's initialisation):
  per-token decays exp(a) mostly between 0.8 and 1.
- bounded gate: with that initialisation exp(A_log) * (g + dt_bias) sits near
  -40 and the sigmoid is ~0 (no decay at all), which would test nothing; so
  A_log = log U[0.5, 2] and dt_bias ~ N(-1, 0.5), which spreads
  sigmoid(...) over (0, 1) and the decays over (exp(lower_bound), 1).
- initial_state: normal, scaled like a state accumulated over ~K tokens.

Everything is drawn on the CPU from one seeded generator, then moved, so the
same seed gives the same numbers on every device.
"""

from __future__ import annotations

import math

import torch


def make_inputs(B=1, T=64, H=2, K=32, V=None, *, seed=0, dtype=torch.float32, device="cpu",
                gate="softplus", lower_bound=None, h0=True, requires_grad=False, chunk_size=None,
                scale=None, extreme=False):
    """Keyword arguments for a stage call (and for :func:`common.reference.kda_reference`).

    Returns a dict with q, k, v, g, beta (``dtype``), A_log, dt_bias and
    initial_state (float32, or None when ``h0`` is False), gate, lower_bound,
    scale and chunk_size. With ``requires_grad`` every float input is a leaf
    that requires grad. ``extreme`` draws the gate at its extremes (issue 21):
    A_log up to 3, g + dt_bias uniform in [-20, 20], and tokens 16-31 (a whole
    chunk of 16) at g = +20, the strongest decay (softplus gate: a = -400 per
    token at A_log = 3).
    """
    V = K if V is None else V
    gen = torch.Generator().manual_seed(int(seed))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float32)

    q = randn(B, T, H, K)
    k = randn(B, T, H, K)
    v = randn(B, T, H, V)
    g = randn(B, T, H, K)
    beta = randn(B, T, H)
    if gate == "bounded":
        A_log = torch.log(0.5 + 1.5 * rand(H))
        dt_bias = -1.0 + 0.5 * randn(H, K)
    else:
        A_log = torch.log(1.0 + 15.0 * rand(H))
        dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * rand(H, K))
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if extreme:
        A_log = 3.0 * rand(H)
        dt_bias = torch.zeros(H, K)
        g = 40.0 * rand(B, T, H, K) - 20.0
        g[:, 16:32] = 20.0
    h = randn(B, H, K, V) * (1.0 / math.sqrt(K)) if h0 else None

    def place(x, dt_):
        if x is None:
            return None
        x = x.to(device=device, dtype=dt_)
        if requires_grad:
            x.requires_grad_(True)
        return x

    if gate == "bounded" and lower_bound is None:
        lower_bound = -5.0
    return dict(
        q=place(q, dtype), k=place(k, dtype), v=place(v, dtype), g=place(g, dtype),
        beta=place(beta, dtype), A_log=place(A_log, torch.float32),
        dt_bias=place(dt_bias, torch.float32), initial_state=place(h, torch.float32),
        gate=gate, lower_bound=lower_bound if gate == "bounded" else None,
        scale=scale, chunk_size=chunk_size,
    )


def make_cotangents(o_shape, s_shape, *, seed=0, device="cpu"):
    """Random upstream gradients (do, dht) for a backward check, float32."""
    gen = torch.Generator().manual_seed(int(seed) + 7919)
    do = torch.randn(*o_shape, generator=gen).to(device)
    dht = torch.randn(*s_shape, generator=gen).to(device)
    return do, dht


TENSOR_ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
GRAD_NAMES = TENSOR_ARGS  # the eight gradients a backward returns


def shape_label(s: dict) -> str:
    """A shape as one label: "B1 T1024 H64 K128 V128"."""
    return f"B{s['B']} T{s['T']} H{s['H']} K{s['K']} V{s['V']}"


def parse_shape(text: str) -> dict:
    """The shape of a label ("B8 T1024 H64 K128 V128", the inverse of :func:`shape_label`)."""
    try:
        d = {tok[0]: int(tok[1:]) for tok in text.split()}
        return dict(B=d["B"], T=d["T"], H=d["H"], K=d["K"], V=d["V"])
    except (KeyError, ValueError, IndexError):
        raise ValueError(f"a shape is 'B.. T.. H.. K.. V..' (positive integers), got {text!r}") from None
