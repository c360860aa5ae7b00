"""Stage 00: the chunked KDA algorithm in plain PyTorch (forward; backward by autograd).

This is DESIGN.md section 3 written as readable tensor code. Every later stage
computes exactly these steps, only faster:

    pre-stage     q, k <- l2norm; beta <- sigmoid(beta); a <- gate(g)
    per chunk     gc = cumsum(a)                       (within the chunk)
                  L   = strict_lower(beta_c * sum_d k_c k_i exp(gc_c - gc_i))
                  Af  = (I + L)^-1 diag(beta)          (WY / UT transform)
                  w   = Af @ (k * exp(gc)),  u = Af @ v
                  Aqk = lower_incl_diag(scale * sum_d q_c k_i exp(gc_c - gc_i))
    serial loop   vcorr = u - w @ S
                  o     = (scale * q * exp(gc)) @ S + Aqk @ vcorr
                  S     = diag(exp(glast)) S + (k * exp(glast - gc))^T @ vcorr

kd @ ki^T = sum_d k_c k_i exp(gc_c) exp(-gc_i) is computed here in the
difference form exp(gc_c - gc_i) (exponent <= 0 below the diagonal), which
never overflows whatever the gate and chunk size.

Any chunk size that is a power of two >= 16 and any T: the last chunk is padded
with k = v = beta = a = 0, which leaves S untouched (the gate sum stays flat and
the padded rows of w, u and kr are zero), and the padded rows of o are dropped.

Causality, also for bad numbers: w and u come from a forward substitution
((I + L) w = diag(beta) kd), and Aqk @ vcorr never forms the terms above the
diagonal, as the loops of stage 01 do, so a NaN in token j's input reaches the
outputs of tokens >= j only, exactly as in the token loop. (A dense matmul with
the triangular Af or Aqk would multiply the zeros above the diagonal by the NaN
rows and spread it to the whole chunk.)

A limit of the chunked form: the decay between two tokens is a difference of
running sums, exp(gc_c - gc_i). An infinite gate (g = +inf with softplus, or any
g whose decay overflows to -inf) makes both sums -inf and the difference NaN,
although the token loop is finite (the state is simply reset to 0). Tokens
before it are unaffected; the chunk holding it and everything after are NaN.
Stages 01-04 share this limit (tests/test_stages_cpu.py pins it).
"""

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common.contract import StageSpec, prepare

HERE = Path(__file__).resolve().parent
L2_EPS = 1e-6

# The relative error each output and gradient may reach against the fp64 reference and the previous
# stage: about 4x the worst of the CPU check cases (common.checks.cpu_cases),
# so that a change which loses accuracy fails.
TOLERANCE = dict(o=8e-7, S=6e-7, dq=1e-6, dk=1e-6, dv=8e-7, dg=1e-6,
                 dbeta=1e-6, dA_log=1.5e-7, ddt_bias=5e-7, dinitial_state=1e-6)

SPEC = StageSpec(
    name="00_naive",
    title="PyTorch chunked reference (forward; backward by autograd)",
    devices=("cpu", "cuda"),
    chunk_sizes=None,  # any power of two >= 16
    default_chunk=64,
    max_head_dim=256,
    compute_dtype=torch.float32,
    backward=True,
    regions=("fwd: pre-stage", "fwd: WY transform", "fwd: Aqk", "fwd: recurrence", "bwd: autograd"),
    region_unit="s",
    tolerance=TOLERANCE,
)


class _Clock:
    """Wall time per region, for profile() only."""

    def __init__(self, device):
        self.device, self.times = device, {}
        self.restart()

    def restart(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t = time.perf_counter()

    def lap(self, region):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[region] = self.times.get(region, 0.0) + now - self.t
        self.t = now


class _NoClock:
    """The forward's clock when not profiling: reads no timer, so the forward
    stays one graph under torch.compile(fullgraph=True)."""

    def lap(self, region):
        pass


_NO_CLOCK = _NoClock()


def _chunks(x, NT, BT):
    """[B, T, H, ...] -> [B, H, NT, BT, ...], zero-padding T up to NT * BT."""
    B, T, H = x.shape[:3]
    pad = NT * BT - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, H, *x.shape[3:])], dim=1)
    x = x.reshape(B, NT, BT, H, *x.shape[3:])
    return x.movedim(3, 1)


def _pairwise(x, y, gc):
    """M[..., c, i] = sum_d x[c, d] y[i, d] exp(gc[c, d] - gc[i, d]) for c >= i, else 0.

    x, y, gc: [..., BT, K] -> M: [..., BT, BT]. One column i at a time keeps the
    memory at [..., BT, K] instead of [..., BT, BT, K]; the exponent is masked to
    0 above the diagonal before exp, so no inf ever enters (or its gradient)."""
    BT = gc.shape[-2]
    rows = torch.arange(BT, device=gc.device)
    cols = []
    for i in range(BT):
        keep = (rows >= i)[:, None]  # [BT, 1]: rows c >= i
        diff = torch.where(keep, gc - gc[..., i:i + 1, :], torch.zeros_like(gc))  # [..., BT, K]
        col = (x * torch.exp(diff.float()) * y[..., i:i + 1, :]).sum(-1)  # [..., BT]
        cols.append(torch.where(keep[:, 0], col, torch.zeros_like(col)))
    return torch.stack(cols, dim=-1)  # [..., BT(c), BT(i)]


def _causal_matmul(A, X):
    """A @ X for a lower-triangular A (diagonal included), as if the terms above
    the diagonal were never formed: out[c] = sum over i <= c of A[c, i] X[i].

    A dense matmul also multiplies those zeros by the rows of X below row c, and
    0 * NaN = NaN, so a NaN in row j of X would reach every row of the output.
    Here X's non-finite entries are left out of the product and put back as NaN
    where a causal product meets them: rows c >= j, the same column.
    A: [..., BT, BT], X: [..., BT, N] -> [..., BT, N]."""
    bad = ~torch.isfinite(X)  # [..., BT, N]
    out = A @ torch.where(bad, 0.0, X)
    reach = torch.tril(torch.ones_like(A)) @ bad.to(A.dtype) > 0  # [..., BT, N]: some bad X[i, n] with i <= c
    return torch.where(reach, float("nan"), out)


def chunk_kda(c, clock=None):
    """The chunked forward on a validated call ``c`` (common.contract.Call).
    Returns o [B, T, H, V] float32 and the final state [B, H, K, V] float32."""
    clock = clock or _NO_CLOCK
    B, T, H, K, V, BT = c.B, c.T, c.H, c.K, c.V, c.chunk_size
    NT = (T + BT - 1) // BT

    # ---- pre-stage: l2norm, beta sigmoid, gate (per token) ----
    q = c.q / torch.sqrt((c.q * c.q).sum(-1, keepdim=True) + L2_EPS)  # [B, T, H, K]
    k = c.k / torch.sqrt((c.k * c.k).sum(-1, keepdim=True) + L2_EPS)  # [B, T, H, K]
    beta = torch.sigmoid(c.beta)  # [B, T, H]
    A = torch.exp(c.A_log)[None, None, :, None]  # [1, 1, H, 1]
    x = c.g + c.dt_bias[None, None]  # [B, T, H, K]
    if c.gate == "softplus":
        a = -A * F.softplus(x)
    else:
        a = c.lower_bound * torch.sigmoid(A * x)

    q, k, a = (_chunks(t, NT, BT) for t in (q, k, a))  # [B, H, NT, BT, K]
    v = _chunks(c.v, NT, BT)  # [B, H, NT, BT, V]
    beta = _chunks(beta, NT, BT)  # [B, H, NT, BT]
    # The gate sum is kept in float64: a float32 gc carries an absolute error of
    # ~1e-7 |gc|, which the differences gc_c - gc_i below turn into relative
    # errors of L, Aqk and kr, and whose gradient (a reverse cumsum of +t/-t
    # pairs) cancels badly in float32. Everything else stays float32.
    gc = a.double().cumsum(dim=-2)  # [B, H, NT, BT, K] gate sum inside each chunk (fp64)
    glast = gc[..., -1:, :]  # [B, H, NT, 1, K]
    clock.lap("fwd: pre-stage")

    # ---- WY transform (chunk-parallel) ----
    eye = torch.eye(BT, dtype=q.dtype, device=q.device)
    L = torch.tril(beta[..., :, None] * _pairwise(k, k, gc), diagonal=-1)  # [B, H, NT, BT, BT] strict lower
    # w = Af kd, u = Af v with Af = (I + L)^-1 diag(beta): one forward substitution each
    w = torch.linalg.solve_triangular(eye + L, beta[..., None] * k * torch.exp(gc.float()), upper=False,
                                      unitriangular=True)  # [B, H, NT, BT, K]
    u = torch.linalg.solve_triangular(eye + L, beta[..., None] * v, upper=False,
                                      unitriangular=True)  # [B, H, NT, BT, V]
    clock.lap("fwd: WY transform")

    # ---- Aqk and the decayed operands (chunk-parallel) ----
    Aqk = c.scale * _pairwise(q, k, gc)  # [B, H, NT, BT, BT] lower incl. diagonal
    qd = c.scale * q * torch.exp(gc.float())  # [B, H, NT, BT, K]
    kr = k * torch.exp((glast - gc).float())  # [B, H, NT, BT, K]
    decay = torch.exp(glast.float()).transpose(-1, -2)  # [B, H, NT, K, 1]
    clock.lap("fwd: Aqk")

    # ---- the serial recurrence over chunks ----
    if c.initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = c.initial_state
    outs = []
    for n in range(NT):
        vcorr = u[:, :, n] - w[:, :, n] @ S  # [B, H, BT, V]
        outs.append(qd[:, :, n] @ S + _causal_matmul(Aqk[:, :, n], vcorr))  # [B, H, BT, V]
        S = decay[:, :, n] * S + kr[:, :, n].transpose(-1, -2) @ vcorr  # [B, H, K, V]
    o = torch.stack(outs, dim=2)  # [B, H, NT, BT, V]
    o = o.movedim(1, 3).reshape(B, NT * BT, H, V)[:, :T]  # [B, T, H, V]
    clock.lap("fwd: recurrence")
    return o, S


def build(profile=False, verbose=False):
    """Nothing to compile: stage 00 is PyTorch."""
    return None


def forward(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
            output_final_state=True, gate="softplus", lower_bound=None, chunk_size=None):
    """The stage contract (DESIGN.md section 5). Returns (o, final_state)."""
    c = prepare(SPEC, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, gate=gate,
                lower_bound=lower_bound, chunk_size=chunk_size)
    o, S = chunk_kda(c)
    return o.to(c.out_dtype), (S if c.output_final_state else None)


def profile(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
            output_final_state=True, gate="softplus", lower_bound=None, chunk_size=None,
            backward=False):
    """Seconds per region of one forward call (wall clock between regions); with
    ``backward`` also the whole autograd backward as one region."""
    c = prepare(SPEC, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, gate=gate,
                lower_bound=lower_bound, chunk_size=chunk_size)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    for n in names:  # fresh leaves, so the profile never touches the caller's graph
        t = getattr(c, n)
        if t is not None:
            setattr(c, n, t.detach().requires_grad_(backward))
    clock = _Clock(c.device)
    with torch.set_grad_enabled(backward):
        o, S = chunk_kda(c, clock)
        if backward:
            gen = torch.Generator().manual_seed(0)
            do = torch.randn(o.shape, generator=gen).to(o.device)
            dS = torch.randn(S.shape, generator=gen).to(S.device)
            clock.restart()
            torch.autograd.backward((o, S), (do, dS))
            clock.lap("bwd: autograd")
    return clock.times
