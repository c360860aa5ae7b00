"""Calling a compiled stage (01-07) the same way, with autograd and profiles.

Every compiled stage's binding exposes the same two functions, outputs passed
in preallocated (so checks can poison them):

    fwd(q, k, v, g, beta, A_log, dt_bias, h0 | None, scale, gate_id, lower_bound,
        chunk_size, o, ht, prof | None)
    bwd(q, k, v, g, beta, A_log, dt_bias, h0 | None, scale, gate_id, lower_bound,
        chunk_size, do, dht | None, dq, dk, dv, dg, dbeta, dA_log, ddt_bias,
        dh0 | None, prof | None)

o is [B, T, H, V] in the stage's compute dtype (float32 for 01-04, bfloat16
for the tensor-core stages), ht is float32 [B, H, K, V] (a varlen stage's call
with packed sequences or the V-first state: [N, H, K, V] or [N, H, V, K], and
fwd, and a varlen stage's bwd, take cu_seqlens, max_seqlen, seq_lens, state_v_first by name); every gradient is
float32 in the shape of its input. ``prof`` is the profile buffer of the -DKDA_PROFILE
build (None otherwise): float64 seconds [1, 20] on the CPU, int64 cycles
[slots, 16] on the GPU (see common/include/kda_profile.cuh).
"""

from __future__ import annotations

import math

import torch

from .contract import Call, StageSpec, alloc

MAX_REGIONS = 20  # common/include/kda_profile.cuh KDA_MAX_REGIONS


def _layout_args(c: Call) -> dict:
    """fwd's keyword arguments for packed sequences and the V-first state (none for a plain call,
    so that the stages without them are called as before)."""
    kw = {}
    if c.cu_seqlens is not None:
        kw.update(cu_seqlens=c.cu_seqlens, max_seqlen=c.max_seqlen)
        if c.seq_lens is not None:  # the lengths on the host: the varlen stages' hybrid plans with them
            kw["seq_lens"] = list(c.seq_lens)
    if c.state_v_first:
        kw["state_v_first"] = True
    return kw


def _fwd(ext, c: Call, prof=None, path=None):
    dev = c.device
    o = alloc((c.B, c.T, c.H, c.V), c.q.dtype, dev)
    ht = alloc(c.state_shape, torch.float32, dev)
    ext.fwd(c.q, c.k, c.v, c.g, c.beta, c.A_log, c.dt_bias, c.initial_state, c.scale, c.gate_id,
            c.lower_bound, c.chunk_size, o, ht, prof, **(path or {}), **_layout_args(c))
    return o, ht


def _bwd(ext, c: Call, do, dht, prof=None):
    dev = c.device
    f32 = torch.float32
    dq = alloc(c.q.shape, f32, dev)
    dk = alloc(c.k.shape, f32, dev)
    dv = alloc(c.v.shape, f32, dev)
    dg = alloc(c.g.shape, f32, dev)
    dbeta = alloc(c.beta.shape, f32, dev)
    dA_log = alloc(c.A_log.shape, f32, dev)
    ddt_bias = alloc(c.dt_bias.shape, f32, dev)
    dh0 = alloc(c.initial_state.shape, f32, dev) if c.initial_state is not None else None
    do = do.to(f32).contiguous()
    dht = None if dht is None else dht.to(f32).contiguous()
    ext.bwd(c.q, c.k, c.v, c.g, c.beta, c.A_log, c.dt_bias, c.initial_state, c.scale, c.gate_id,
            c.lower_bound, c.chunk_size, do, dht, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0, prof,
            **_layout_args(c))
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0


class _KdaFunction(torch.autograd.Function):
    """autograd through a compiled stage: forward runs ``fwd``, backward ``bwd``
    (which recomputes what it needs from the saved inputs)."""

    @staticmethod
    def forward(ctx, ext, c, q, k, v, g, beta, A_log, dt_bias, h0):
        o, ht = _fwd(ext, c)
        ctx.ext, ctx.c = ext, c
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        c = ctx.c
        if do is None:
            do = torch.zeros(c.B, c.T, c.H, c.V, dtype=torch.float32, device=c.device)
        grads = _bwd(ctx.ext, c, do, dht)
        return (None, None) + tuple(grads)


def run(ext, spec: StageSpec, c: Call, path: dict | None = None):
    """Forward through a compiled stage; differentiable when the stage has a
    backward and an input requires grad. Returns (o in v's dtype, ht or None).
    ``path``: keyword arguments of a stage with several paths (its path pin)."""
    tensors = (c.q, c.k, c.v, c.g, c.beta, c.A_log, c.dt_bias, c.initial_state)
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if need_grad and spec.backward:
        o, ht = _KdaFunction.apply(ext, c, *tensors)
    else:
        with torch.no_grad():
            o, ht = _fwd(ext, c, path=path)
    return o.to(c.out_dtype), (ht if c.output_final_state else None)


def backward(ext, c: Call, do, dht):
    """The eight gradients (q, k, v, g, beta, A_log, dt_bias, h0) as a dict."""
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    return dict(zip(names, _bwd(ext, c, do, dht)))


def _prof_buffer(spec: StageSpec, c: Call):
    if c.device.type == "cpu":
        return torch.zeros(1, MAX_REGIONS, dtype=torch.float64)
    # one slot per chunk of the longest sequence and (sequence, head), or per block (at most 16 per head)
    slots = c.N * c.H * max(math.ceil(c.max_seqlen / 16), 16)
    return torch.zeros(slots, MAX_REGIONS, dtype=torch.int64, device=c.device)


def summarize(buf: torch.Tensor, regions) -> dict:
    """Profile buffer -> {region: value}. Per region, the mean over the slots
    that recorded it (seconds on the CPU, clock64 cycles on the GPU)."""
    b = buf.detach().to("cpu", torch.float64)
    out = {}
    for i, name in enumerate(regions):
        col = b[:, i]
        nz = col[col != 0]
        out[name] = float(nz.mean()) if nz.numel() else 0.0
    return out


def profile(ext_prof, spec: StageSpec, c: Call, *, backward: bool = False, seed: int = 0,
            path: dict | None = None) -> dict:
    """Run the profile build once (forward, and backward when asked) and return
    {region: seconds or cycles}. Forward regions come from the forward call;
    from the backward call only regions named "bwd: ..." are kept (a backward
    that recomputes the forward does not count it twice). Regions the call did
    not visit are left out."""
    buf = _prof_buffer(spec, c)
    with torch.no_grad():
        _fwd(ext_prof, c, buf, path=path)
        res = {k: v for k, v in summarize(buf, spec.regions).items() if not k.startswith("bwd:")}
        if backward:
            if not spec.backward:
                raise ValueError(f"stage {spec.name} has no backward to profile")
            gen = torch.Generator().manual_seed(seed)
            do = torch.randn(c.B, c.T, c.H, c.V, generator=gen).to(c.device)
            dht = torch.randn(c.B, c.H, c.K, c.V, generator=gen).to(c.device)
            bbuf = _prof_buffer(spec, c)
            _bwd(ext_prof, c, do, dht, bbuf)
            names = spec.backward_regions or spec.regions
            res.update({k: v for k, v in summarize(bbuf, names).items() if k.startswith("bwd:")})
    return {k: v for k, v in res.items() if v != 0.0}
