"""Correctness checks shared by the tests, the notebooks and ``kdalab check``.

A check draws fresh seeded inputs for a :class:`Case`, runs the stage with its
outputs poisoned (NaN), and compares o, the final state and, for stages with a
backward, all eight gradients against

- the fp64 token-by-token reference (common.reference), and
- the previous stage on the same inputs (same gate; a forward-only stage's
  previous stage is run with the same gate and chunk size).

Gradients come from ``torch.autograd.backward((o, S), (do, dht))`` with random
cotangents, so the autograd wiring of each stage is checked too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .contract import check_cu_seqlens, poisoned
from .inputs import TENSOR_ARGS, make_cotangents, make_inputs
from .metrics import rel_err, tolerance, worst
from .reference import kda_reference
from .stages import STAGE_DIRS, Stage, previous, stage as ladder_stage


def as_stage(stage):
    """The :class:`common.stages.Stage` of an id ("01", "01_cpp") or of a stage
    module, resolved once; a stage-like object with SPEC and forward that is not
    a stage of the ladder (as the negative-control tests plant) as it is."""
    if isinstance(stage, (str, int, Stage)):
        return ladder_stage(stage)
    return stage


_DEFAULT = object()


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    K: int
    V: int
    chunk: int = 64
    gate: str = "softplus"
    lower_bound: float | None = None
    h0: bool = True
    seed: int = 0
    extreme: bool = False  # the gate at its extremes (inputs.make_inputs(extreme=True))

    @property
    def id(self) -> str:
        lb = f"{self.lower_bound:g}" if (self.gate == "bounded" and self.lower_bound is not None) else ""
        return (f"B{self.B}-T{self.T}-H{self.H}-K{self.K}-V{self.V}-c{self.chunk}-{self.gate}{lb}"
                f"{'-extreme' if self.extreme else ''}{'' if self.h0 else '-noh0'}-s{self.seed}")


def cpu_cases(quick: bool = False):
    """Small shapes that run in seconds on a CPU: K != V, T not a multiple of
    the chunk, h0 absent and present, both gates, every chunk size, three
    lower bounds, and B > 1 with h0 under each gate (each sequence of a batch
    starts from its own initial state and gets its own dh0). The quick subset
    keeps one B > 1 case with h0 and a tail."""
    cases = [
        Case(1, 37, 2, 16, 24, chunk=16, gate="softplus", seed=1),
        Case(2, 64, 1, 32, 32, chunk=32, gate="bounded", lower_bound=-5.0, h0=False, seed=2),
        Case(1, 100, 2, 64, 48, chunk=64, gate="softplus", h0=False, seed=3),
        Case(1, 70, 1, 8, 5, chunk=16, gate="bounded", lower_bound=-1.0, seed=4),
        Case(2, 45, 2, 16, 12, chunk=16, gate="bounded", lower_bound=-2.5, seed=5),
        Case(3, 50, 1, 8, 16, chunk=32, gate="softplus", seed=6),
    ]
    return [cases[0], cases[1], cases[4]] if quick else cases


def gpu_cases(quick: bool = False):
    """Shapes for the fp32 CUDA stages: the CPU set, and also B*H above the
    H200's 132 SMs (with and without h0; B*H = 135 at K = V = 32 with a short
    sequence, where stage 04's dg was reported above the tolerance), K, V = 256
    and long T. The quick subset is the CPU one plus the first two GPU shapes."""
    extra = [
        Case(2, 300, 3, 64, 64, chunk=64, gate="softplus", seed=11),
        Case(3, 129, 50, 32, 48, chunk=32, gate="bounded", lower_bound=-5.0, h0=False, seed=12),
        Case(1, 200, 2, 128, 96, chunk=16, gate="softplus", seed=13),
        Case(1, 80, 1, 256, 256, chunk=64, gate="bounded", lower_bound=-3.0, seed=14),
        Case(1, 1000, 2, 64, 64, chunk=64, gate="softplus", h0=False, seed=15),
        Case(4, 150, 40, 32, 64, chunk=32, gate="bounded", lower_bound=-2.5, seed=16),
        Case(2, 90, 3, 128, 96, chunk=16, gate="softplus", seed=17),
        Case(5, 40, 27, 32, 32, chunk=64, gate="softplus", seed=18),  # many heads, a short sequence (issue 22)
    ]
    return cpu_cases(quick) + (extra[:2] if quick else extra)


def tc_cases(quick: bool = False):
    """Shapes for the tensor-core stages (bf16, bounded gate, chunk 16, K = V
    in {64, 128}): tails, h0 absent, B*H up to 256, four lower bounds, and B > 1
    with h0 and a tail at both head sizes. The quick subset keeps one of those."""
    cases = [
        Case(1, 100, 2, 64, 64, chunk=16, gate="bounded", lower_bound=-5.0, seed=21),
        Case(2, 257, 3, 128, 128, chunk=16, gate="bounded", lower_bound=-5.0, h0=False, seed=22),
        Case(1, 1000, 2, 128, 128, chunk=16, gate="bounded", lower_bound=-5.0, seed=23),
        Case(2, 64, 80, 64, 64, chunk=16, gate="bounded", lower_bound=-2.0, seed=24),
        Case(4, 130, 64, 128, 128, chunk=16, gate="bounded", lower_bound=-5.0, h0=False, seed=25),
        Case(3, 200, 4, 128, 128, chunk=16, gate="bounded", lower_bound=-3.0, seed=26),
        Case(2, 77, 5, 64, 64, chunk=16, gate="bounded", lower_bound=-1.0, seed=27),
    ]
    return [cases[0], cases[1], cases[5]] if quick else cases


def tc_softplus_cases(quick: bool = False):
    """Shapes for the tensor-core stages that take the softplus gate (Kimi Linear's,
    no lower bound; chunk 16, K = V in {64, 128}): B > 1 with h0 and a tail at both
    head sizes, h0 absent, B*H = 256, and the gate at its extremes (A_log up to 3,
    g + dt_bias in [-20, 20], a whole chunk at the strongest decay) with and without
    h0. The quick subset keeps the first B > 1 case and one extreme one."""
    cases = [
        Case(2, 257, 3, 128, 128, chunk=16, gate="softplus", seed=41),
        Case(3, 77, 5, 64, 64, chunk=16, gate="softplus", seed=42),
        Case(1, 1000, 2, 128, 128, chunk=16, gate="softplus", h0=False, seed=43),
        Case(4, 130, 64, 128, 128, chunk=16, gate="softplus", seed=44),
        Case(2, 200, 4, 128, 128, chunk=16, gate="softplus", extreme=True, seed=45),
        Case(2, 100, 3, 64, 64, chunk=16, gate="softplus", extreme=True, h0=False, seed=46),
    ]
    return [cases[0], cases[4]] if quick else cases


def one_wide_chunk_inputs(device="cpu") -> dict:
    """The first softplus check case (B2 T257 H3 K128, bf16) with one wide chunk among narrow
    ones: sequence 1, head 0, tokens 32-47 at g = 20, where a is about -130 to -170 per token,
    so that chunk decays by 2058-2776 (past the factored products' range, and past fp32's
    exp). Every other chunk keeps the case's gate (decays below 80). The GPU test of the
    choice per chunk runs on it; a CPU test checks that it means what it says."""
    inp = case_inputs(tc_softplus_cases()[0], device, torch.bfloat16)
    inp["g"][1, 32:48, 0] = 20.0
    return inp


def fla_cases():
    """Shapes on which the tensor-core stages are compared with FLA's chunk_kda
    (safe gate, lower_bound -5): K = 128 and 64, a tail chunk, h0 present."""
    return [
        Case(2, 257, 3, 128, 128, chunk=16, gate="bounded", lower_bound=-5.0, seed=31),
        Case(1, 300, 4, 64, 64, chunk=16, gate="bounded", lower_bound=-5.0, seed=32),
    ]


def flashkda_cases():
    """The cases FlashKDA is checked on against the fp64 reference: the
    tensor-core and FLA cases it can take (K = V = 128, bounded gate), with
    and without h0, a tail chunk, T = 1000."""
    return [c for c in tc_cases() + fla_cases() if c.K == c.V == 128 and c.gate == "bounded"]


def cases_for(spec, device, quick: bool = False):
    """The check cases a stage is held to on a device: bf16 stages their own
    regime (bounded gate, chunk 16), fp32 stages the CPU or the GPU set."""
    if spec.compute_dtype == torch.bfloat16:
        return tc_cases(quick) + (tc_softplus_cases(quick) if "softplus" in spec.gates else [])
    return cpu_cases(quick) if torch.device(device).type == "cpu" else gpu_cases(quick)


def determinism_case(cases) -> Case:
    """The case of a set that check_deterministic runs: the most (batch, head)
    pairs, then the longest T (the most blocks in flight at once, where a race
    or an order-dependent sum would show)."""
    return max(cases, key=lambda c: (c.B * c.H, c.T))


def stage_inputs(spec, B, T, H, K, V, *, seed=0, device="cpu"):
    """Inputs in a stage's own regime (its first gate, default chunk size and
    compute dtype), for profiles and timings that are not about the gate."""
    return make_inputs(B, T, H, K, V, seed=seed, device=device, dtype=spec.compute_dtype, gate=spec.gates[0],
                       chunk_size=spec.default_chunk)


def case_inputs(case: Case, device="cpu", dtype=torch.float32):
    return make_inputs(case.B, case.T, case.H, case.K, case.V, seed=case.seed, dtype=dtype, device=device,
                       gate=case.gate, lower_bound=case.lower_bound, h0=case.h0, chunk_size=case.chunk,
                       extreme=case.extreme)


def takes(spec, case: Case) -> bool:
    """Whether a stage can run a case: its gate, chunk size and head sizes."""
    dims_ok = (max(case.K, case.V) <= spec.max_head_dim if spec.head_dims is None
               else case.K in spec.head_dims and case.V in spec.head_dims)
    chunk_ok = spec.chunk_sizes is None or case.chunk in spec.chunk_sizes
    return case.gate in spec.gates and chunk_ok and dims_ok and (not spec.equal_kv or case.K == case.V)


def previous_for(stage, case: Case):
    """The stage a case is compared with: the previous stage of the ladder, or,
    when that one cannot run the case (the softplus gate before stage 12), the
    nearest earlier stage that can (stage 04, fp32, takes both gates). None for
    a case at the gate's extremes: every earlier stage forms exp(-gc), which
    overflows there (the reason for stage 12), so only fp64 can judge it."""
    if case.extreme:
        return None
    prev = ladder_stage(stage.SPEC.id).previous
    while prev is not None and not takes(prev.SPEC, case):
        prev = prev.previous
    return prev


def _leaves(inp: dict, device, requires_grad: bool) -> dict:
    out = dict(inp)
    for n in TENSOR_ARGS:
        t = inp[n]
        if t is not None:
            out[n] = t.detach().to(device).requires_grad_(requires_grad)
    return out


def run(fn, inp: dict, device, *, backward: bool, cotangents=None, dtype=None) -> dict:
    """Call ``fn`` (a stage's forward or the reference) on fresh leaves on
    ``device`` with poisoned outputs. Returns {"o", "S"} and, with ``backward``,
    {"d" + name} for the eight inputs (None where an input is absent)."""
    kw = _leaves(inp, device, backward)
    if dtype is not None:
        for n in TENSOR_ARGS:
            if kw[n] is not None:
                kw[n] = kw[n].detach().to(dtype).requires_grad_(backward)
    with poisoned(), torch.set_grad_enabled(backward):
        o, S = fn(**kw)
        res = {"o": o.detach(), "S": S.detach()}
        if backward:
            do, dht = cotangents
            torch.autograd.backward((o, S), (do.to(o.device, o.dtype), dht.to(S.device, S.dtype)))
            for n in TENSOR_ARGS:
                t = kw[n]
                res["d" + n] = None if t is None else (t.grad if t.grad is not None else torch.zeros_like(t))
    return res


def reduction_scales(inp: dict, cotangents) -> dict:
    """Per element of dA_log and ddt_bias, the sum of |terms| it is reduced from.

    dA_log[h] = sum over b, t, k of da * da/dA_log, ddt_bias[h, k] = sum over b,
    t of dg. When these sums cancel (a small result from O(1) terms), float32
    accumulation cannot give a small *relative* error, whatever the kernel:
    the float32 token loop itself lands near 1e-5. Their errors are therefore
    measured against the size of the terms, ||x - ref|| / ||sum |terms|||,
    which is never smaller than the plain relative error's denominator, and
    still flags any wrong term (an error of the size of the terms)."""
    from .reference import activate, kda_recurrence

    f64 = torch.float64
    kw = {n: (t.detach().to("cpu", f64) if torch.is_tensor(t) else t) for n, t in inp.items()}
    kw["g"].requires_grad_(True)
    qn, kn, b, a = activate(kw["q"], kw["k"], kw["g"], kw["beta"], kw["A_log"], kw["dt_bias"],
                            gate=kw["gate"], lower_bound=kw["lower_bound"])
    a.retain_grad()
    scale = kw["scale"] if kw["scale"] is not None else kw["q"].shape[-1] ** -0.5
    o, S = kda_recurrence(qn, kn, kw["v"], b, a, scale=scale, initial_state=kw["initial_state"])
    do, dht = cotangents
    torch.autograd.backward((o, S), (do.to(f64), dht.to(f64)))
    da, dg = a.grad, kw["g"].grad  # [B, T, H, K]
    A = torch.exp(kw["A_log"])[None, None, :, None]
    if kw["gate"] == "softplus":
        da_dA = a.detach()
    else:
        lb = -5.0 if kw["lower_bound"] is None else kw["lower_bound"]
        x = kw["g"].detach() + kw["dt_bias"][None, None]
        sg = torch.sigmoid(A * x)
        da_dA = lb * sg * (1 - sg) * A * x
    return {"dA_log": (da * da_dA).abs().sum(dim=(0, 1, 3)), "ddt_bias": dg.abs().sum(dim=(0, 1))}


# The reduced gradients' second bound: besides the stage's tolerance against the size of their terms
# (reduction_scales), their plain relative error against fp64 stays within the fp32 bound that holds for
# every other gradient (metrics.TOLERANCE["fp32"]). The fp32 token loop lands at 1e-7..1e-6 on every
# check case; a float32 gate cumsum in the GPU stages once left dA_log at 1.1-1.5e-5 (issue 36).
PLAIN_BOUND = tolerance("fp32")


def _err(x, ref, scale=None):
    """rel_err, or for a reduced gradient the error relative to the size of the
    terms it sums (see reduction_scales). inf whenever rel_err is inf."""
    r = rel_err(x, ref)
    if scale is None or r == math.inf:
        return r
    d = torch.linalg.vector_norm(x.detach().double().cpu() - ref.detach().double().cpu()).item()
    den = torch.linalg.vector_norm(scale.double()).item()
    return d / den if den > 0 else math.inf


def stage_device(spec, want=None) -> torch.device:
    """Where a stage runs: ``want`` if it supports that device type, else its first."""
    if want is not None and torch.device(want).type in spec.devices:
        return torch.device(want)
    for d in spec.devices:
        if d == "cpu" or (d == "cuda" and torch.cuda.is_available()):
            return torch.device(d)
    raise RuntimeError(f"stage {spec.name} cannot run here: {spec.runnable_here()[1]}")


def check_case(stage, case: Case, *, device=None, backward=None, against_prev=True, prev=_DEFAULT,
               ref_device=None) -> list[dict]:
    """Errors of one stage on one case: a row per output (o, S, gradients) with
    the error against the fp64 reference and against the previous stage.

    ``stage`` is an id or a stage module; ``prev`` overrides the stage it is
    compared with (default: the previous stage of the ladder; None: no
    comparison). A row is ok only if both errors are within the tolerance of
    the stage's precision; a comparison that could not be made is never ok."""
    stage = as_stage(stage)
    spec = stage.SPEC
    dev = stage_device(spec, device)
    backward = spec.backward if backward is None else (backward and spec.backward)
    in_dtype = spec.compute_dtype
    inp = case_inputs(case, "cpu", in_dtype)
    cot = make_cotangents((case.B, case.T, case.H, case.V), (case.B, case.H, case.K, case.V), seed=case.seed)

    got = run(stage.forward, inp, dev, backward=backward, cotangents=cot)
    rdev = torch.device(ref_device) if ref_device is not None else dev
    ref = run(kda_reference, inp, rdev, backward=backward, cotangents=cot, dtype=torch.float64)
    if prev is _DEFAULT:
        prev = previous_for(stage, case) if against_prev else None
    pres = None
    if prev is not None:
        pdev = stage_device(prev.SPEC, dev)
        pres = run(prev.forward, inp, pdev, backward=backward and prev.SPEC.backward, cotangents=cot)
    scales = reduction_scales(inp, cot) if backward else {}
    rows = []
    for name, x in got.items():
        if x is None and ref[name] is None:
            continue  # an absent input (no h0) has no gradient on either side
        sc = scales.get(name)
        r = math.inf if x is None or ref[name] is None else _err(x, ref[name], sc)
        p = None
        if pres is not None and pres.get(name) is not None:
            p = math.inf if x is None else _err(x, pres[name], sc)
        row = dict(stage=spec.name, case=case.id, output=name, err_ref=r, err_prev=p,
                   prev=(prev.SPEC.name if prev is not None else None))
        if sc is not None:  # a reduced gradient: also its plain relative error against fp64 (PLAIN_BOUND)
            row["err_plain"] = math.inf if x is None or ref[name] is None else rel_err(x, ref[name])
        rows.append(judge(stage, row))
    return rows


def same_bits(stage) -> bool:
    """Whether a stage declares that it computes the previous stage's outputs bit for bit (its stage.py
    ``SAME_BITS_AS_PREVIOUS``: a change of mapping or launch order, not of arithmetic)."""
    return bool(getattr(as_stage(stage), "SAME_BITS_AS_PREVIOUS", False))


def judge(stage, row: dict) -> dict:
    """A check row (output, err_ref, err_prev, prev) with its verdict: ``tol`` the stage's tolerance of the
    output, ``ok`` when both errors are within it, and, for a stage that declares the previous stage's bits,
    the difference from that stage exactly 0. Also re-judges a recorded row by today's tolerance."""
    stage = as_stage(stage)
    spec = stage.SPEC
    tol = spec.tol(row["output"])
    r, p = row.get("err_ref"), row.get("err_prev")
    ok = r is not None and r <= tol and (p is None or p <= tol)
    if row.get("err_plain") is not None:  # dA_log, ddt_bias: within the fp32 bound as any gradient is
        ok = ok and row["err_plain"] <= PLAIN_BOUND
    pid = previous(spec.id)
    if ok and p is not None and same_bits(stage) and pid is not None and row.get("prev") == STAGE_DIRS[pid]:
        ok = p == 0.0
    return dict(row, tol=tol, ok=bool(ok))


def check_against_fla(stage, case: Case) -> list[dict]:
    """o and the final state of a stage against FLA's chunk_kda on the same bf16
    inputs (GPU, fla-core installed). A row carries the stage's error against
    FLA (``err_fla``) and FLA's own error against the fp64 reference
    (``fla_err_ref``), which must be within the bf16 regime's bound
    (common.metrics.TOLERANCE). Both sides carry their own bf16 roundings (o is
    rounded to bf16 by each), so the two are held to the sum of their bounds:
    |stage - FLA| <= |stage - ref| + |ref - FLA|, the stage's tolerance plus
    that bound (``tol_fla``)."""
    from .fla_ref import fla_available, fla_forward

    ok, why = fla_available()
    if not ok:
        raise RuntimeError(why)
    stage = as_stage(stage)
    spec = stage.SPEC
    inp = case_inputs(case, "cpu", spec.compute_dtype)
    got = run(stage.forward, inp, "cuda", backward=False)
    fla = run(fla_forward, inp, "cuda", backward=False)
    ref = run(kda_reference, inp, "cuda", backward=False, dtype=torch.float64)
    bound = tolerance("bf16")
    rows = []
    for name in ("o", "S"):
        e, f = rel_err(got[name], fla[name]), rel_err(fla[name], ref[name])
        tol = spec.tol(name)
        rows.append(dict(stage=spec.name, case=case.id, output=name, against="FLA chunk_kda", err_fla=e,
                         fla_err_ref=f, tol_fla=tol + bound, tol=bound, ok=e <= tol + bound and f <= bound))
    return rows


def check_flashkda(case: Case) -> list[dict]:
    """FlashKDA's own errors on one case: o and the final state against the
    fp64 reference on the same bf16 inputs as the stages (GPU, FlashKDA built;
    fla_ref.flashkda_forward turns its [B, H, V, K] state back into
    [B, H, K, V]). Rows like a stage's (stage "FlashKDA", err_ref, no previous
    stage), held to the bf16 tolerance; summarize() takes them."""
    from .fla_ref import FLASHKDA_NAME, flashkda_available, flashkda_forward

    ok, why = flashkda_available()
    if not ok:
        raise RuntimeError(why)
    inp = case_inputs(case, "cpu", torch.bfloat16)
    got = run(flashkda_forward, inp, "cuda", backward=False)
    ref = run(kda_reference, inp, "cuda", backward=False, dtype=torch.float64)
    tol = tolerance("bf16")
    rows = []
    for name in ("o", "S"):
        e = rel_err(got[name], ref[name])
        rows.append(dict(stage=FLASHKDA_NAME, case=case.id, output=name, err_ref=e, err_prev=None, prev=None,
                         tol=tol, ok=e <= tol))
    return rows


def summarize_fla(rows) -> list[dict]:
    """Worst stage-vs-FLA and FLA-vs-fp64 error per (stage, output)."""
    out: dict = {}
    for r in rows:
        w = out.setdefault((r["stage"], r["output"]), dict(stage=r["stage"], output=r["output"], against=r["against"],
                                                          err_fla=None, fla_err_ref=None, tol_fla=r["tol_fla"],
                                                          tol=r["tol"], ok=True, cases=0))
        w["err_fla"] = worst([w["err_fla"], r["err_fla"]])
        w["fla_err_ref"] = worst([w["fla_err_ref"], r["fla_err_ref"]])
        w["ok"] = w["ok"] and r["ok"]
        w["cases"] += 1
    return list(out.values())


def check_stage(stage, cases, *, progress=None, **kw) -> list[dict]:
    """check_case over cases; ``progress(i, n, case, rows)`` after each."""
    rows = []
    for i, case in enumerate(cases, 1):
        r = check_case(stage, case, **kw)
        rows += r
        if progress is not None:
            progress(i, len(cases), case, r)
    return rows


def check_deterministic(stage, case: Case, device=None) -> bool:
    """Two forward calls on the same inputs give bitwise identical o and S."""
    stage = as_stage(stage)
    dev = stage_device(stage.SPEC, device)
    inp = case_inputs(case, "cpu", stage.SPEC.compute_dtype)
    a = run(stage.forward, inp, dev, backward=False)
    b = run(stage.forward, inp, dev, backward=False)
    return all(torch.equal(a[n], b[n]) for n in ("o", "S"))


def check_chunk_sizes(stage, case: Case, chunks=(16, 32), device=None) -> dict:
    """o and S of one case at two chunk sizes (``case.chunk`` is replaced):
    {"err": {chunk: {"o": err_ref, "S": err_ref}}, "equal": bool, "tol": {"o": tol, "S": tol}}.

    Two chunkings sum in a different order, so their outputs differ in the
    last bits; ``equal`` (o and S bitwise equal at both sizes) says that the
    stage, or the contract in front of it, ignored chunk_size. Each size must
    still be within the tolerance of the fp64 reference."""
    stage = as_stage(stage)
    dev = stage_device(stage.SPEC, device)
    if len(chunks) != 2 or chunks[0] == chunks[1]:
        raise ValueError(f"chunks must be two different chunk sizes, got {chunks!r}")
    out, err = {}, {}
    for bt in chunks:
        inp = case_inputs(replace(case, chunk=bt), "cpu", stage.SPEC.compute_dtype)
        got = run(stage.forward, inp, dev, backward=False)
        ref = run(kda_reference, inp, dev, backward=False, dtype=torch.float64)
        out[bt] = got
        err[bt] = {n: rel_err(got[n], ref[n]) for n in ("o", "S")}
    a, b = (out[bt] for bt in chunks)
    return dict(err=err, equal=all(torch.equal(a[n], b[n]) for n in ("o", "S")),
                tol={n: stage.SPEC.tol(n) for n in ("o", "S")})


def summarize(rows) -> list[dict]:
    """Worst error per (stage, output, previous stage compared with) over all cases (NaN counts as
    inf). A stage compared with two (stage 12: stage 11 on the bounded gate, stage 04 on the softplus
    gate) gets a row for each, over the cases of each: whether it holds the previous stage's bits
    stays visible beside the larger difference from the other."""
    out: dict = {}
    for r in rows:
        w = out.setdefault((r["stage"], r["output"], r["prev"]), dict(stage=r["stage"], output=r["output"], err_ref=None,
                                                                      err_prev=None, prev=r["prev"], tol=r["tol"],
                                                                      ok=True, cases=0))
        w["err_ref"] = worst([w["err_ref"], r["err_ref"]])
        w["err_prev"] = worst([w["err_prev"], r["err_prev"]])
        if r.get("err_plain") is not None:
            w["err_plain"] = worst([w.get("err_plain"), r["err_plain"]])
        w["ok"] = w["ok"] and r["ok"]
        w["cases"] += 1
    return list(out.values())


def vs_previous(rows) -> tuple:
    """(err_prev, prev) of one stage's check rows for a one-line summary: the difference from the
    stage before it in the ladder where it was compared with that stage, else the largest difference
    and the stage it came from."""
    rows = [r for r in rows if r.get("err_prev") is not None]
    if not rows:
        return None, None
    name = rows[0]["stage"]
    pid = previous(name) if name in STAGE_DIRS.values() else None
    ladder = [r for r in rows if pid is not None and r.get("prev") == STAGE_DIRS[pid]]
    pick = ladder or rows
    top = worst(r["err_prev"] for r in pick)
    return top, next(r["prev"] for r in pick if worst([r["err_prev"]]) == top)


def check_profile(prof: dict, expected) -> list[str]:
    """What is wrong with a region profile against the region names a stage is
    expected to record: missing regions (one that stopped recording is dropped
    as zero by extrun.profile), unexpected ones, and values that are not
    positive and finite. Empty: nothing wrong."""
    problems = [f"missing region {n!r}" for n in expected if n not in prof]
    problems += [f"unexpected region {n!r}" for n in prof if n not in expected]
    problems += [f"region {n!r} = {v!r}" for n, v in prof.items() if not (math.isfinite(v) and v > 0)]
    return problems


def format_rows(rows, *, columns=("stage", "case", "output", "err_ref", "err_prev", "ok")) -> str:
    """A Markdown table of check rows (errors in %.2e)."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.2e}"
        if v is None:
            return "-"
        return str(v)

    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |\n" for r in rows)


# --------------------------------------------------------------------------
# packed sequences (cu_seqlens)
# --------------------------------------------------------------------------
#
# A packed call holds N sequences of different lengths in one [1, T, H, *]
# tensor, cut by cu_seqlens [N + 1] (0 = cu[0] <= cu[1] <= ... <= cu[N] = T);
# each sequence starts from its own initial state and ends in its own final
# state ([N, H, K, V], or [N, H, V, K] with state_v_first). The check holds a
# packed call to the fp64 token loop run sequence by sequence and to the stage
# itself called once per sequence without cu_seqlens (its equal-length path).


@dataclass(frozen=True)
class VarlenCase:
    """One packed call: the sequence lengths (0 allowed), heads, head sizes,
    initial states present or not, the state layout, the gate's lower bound,
    the dtype of cu_seqlens and the seed; ``name`` labels a named shape
    (FlashKDA's). Always bf16-regime inputs (bounded gate, chunk 16)."""

    lengths: tuple
    H: int
    K: int
    V: int
    h0: bool = True
    state_v_first: bool = False
    lower_bound: float = -5.0
    cu_dtype: str = "int32"  # "int32" or "int64" (FlashKDA's)
    seed: int = 0
    name: str = ""

    @property
    def N(self) -> int:
        return len(self.lengths)

    @property
    def T(self) -> int:
        return sum(self.lengths)

    def bounds(self) -> list[int]:
        """cu_seqlens as a list: [0, l0, l0 + l1, ..., T]."""
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out

    def cu_seqlens(self, device="cpu") -> torch.Tensor:
        dt = {"int32": torch.int32, "int64": torch.int64}[self.cu_dtype]
        return torch.tensor(self.bounds(), dtype=dt, device=device)

    @property
    def id(self) -> str:
        lens = "L" + "_".join(map(str, self.lengths)) if self.N <= 8 else f"N{self.N}-T{self.T}"
        return (f"{self.name + '-' if self.name else ''}{lens}-H{self.H}-K{self.K}-V{self.V}-lb{self.lower_bound:g}"
                f"-{'vfirst' if self.state_v_first else 'kfirst'}-{self.cu_dtype}{'' if self.h0 else '-noh0'}"
                f"-s{self.seed}")


def random_lengths(n: int, lo: int, hi: int, seed: int) -> tuple:
    """``n`` sequence lengths drawn uniformly from [lo, hi] (seeded, CPU generator)."""
    gen = torch.Generator().manual_seed(int(seed))
    return tuple(int(x) for x in torch.randint(lo, hi + 1, (n,), generator=gen))


# FlashKDA's varlen test shape (its tests/test_fwd.py): six sequences at H = 96, K = V = 128.
FLASHKDA_VARLEN_LENGTHS = (1300, 547, 2048, 963, 271, 3063)
FLASHKDA_VARLEN = VarlenCase(FLASHKDA_VARLEN_LENGTHS, H=96, K=128, V=128, h0=True, state_v_first=True,
                             lower_bound=-5.0, cu_dtype="int64", seed=47, name="flashkda")

# The hybrid of stages 11 and 12 (long sequences on the split path beside the fused kernel), pinned from
# HYBRID_FROM tokens: the cases of its GPU test and of the sanitizer run.
HYBRID_FROM = 200
HYBRID_CASES = (
    # three runs of one long sequence among short ones and an empty one, h0, K-first
    VarlenCase((40, 300, 17, 0, 333, 25, 260, 9), H=3, K=128, V=128, seed=91),
    # a run of two long sequences first, then short ones and one more, no h0, V-first
    VarlenCase((250, 210, 5, 61, 400), H=2, K=64, V=64, h0=False, state_v_first=True, seed=92),
)


def varlen_cases(big: bool = True):
    """Packed-sequence cases for the tensor-core stages (K = V in {64, 128}):
    ragged lengths with 0, 1, 15, 16 and 17 tokens (shorter than, equal to and
    one past a 16-token chunk), empty sequences first, inside and last, N*H
    above the H200's 132 SMs and below, h0 present and absent, both state
    layouts, four lower bounds, cu_seqlens int32 and int64. ``big`` adds
    FlashKDA's varlen shape (T = 8192 at H = 96: a GPU case, its fp64
    reference is slow on a CPU)."""
    cases = [
        VarlenCase((1, 15, 16, 17, 0, 40), H=2, K=64, V=64, h0=True, state_v_first=False, lower_bound=-5.0,
                   cu_dtype="int32", seed=41),
        VarlenCase((17, 0, 1, 100, 16, 15), H=3, K=128, V=128, h0=False, state_v_first=True, lower_bound=-2.0,
                   cu_dtype="int64", seed=42),
        # many sequences: N*H = 140 > 132 SMs (the first three fixed, the rest random 0..40)
        VarlenCase((0, 1, 16) + random_lengths(67, 0, 40, seed=43), H=2, K=64, V=64, h0=True, state_v_first=True,
                   lower_bound=-5.0, cu_dtype="int32", seed=43),
        # many heads: N*H = 240, empty sequences first and last
        VarlenCase((0, 33, 1, 64, 5, 0), H=40, K=128, V=128, h0=True, state_v_first=False, lower_bound=-1.0,
                   cu_dtype="int64", seed=44),
        # sequences of many chunks with tails, next to a single token
        VarlenCase((257, 1, 130), H=4, K=128, V=128, h0=True, state_v_first=True, lower_bound=-3.0,
                   cu_dtype="int32", seed=45),
        VarlenCase((16, 0, 31, 2), H=2, K=64, V=64, h0=False, state_v_first=False, lower_bound=-1.0,
                   cu_dtype="int64", seed=46),
    ]
    return cases + ([FLASHKDA_VARLEN] if big else [])


def varlen_inputs(case: VarlenCase, device="cpu", dtype=torch.bfloat16) -> dict:
    """A packed call's keyword arguments for a stage with cu_seqlens (and for
    :func:`kda_reference_varlen`): q, k, v, g, beta [1, T, H, *] in ``dtype``,
    A_log, dt_bias (fp32), initial_state fp32 [N, H, K, V] ([N, H, V, K] with
    state_v_first; None without h0), cu_seqlens, state_v_first, the bounded
    gate and chunk 16. Drawn on the CPU from the case's seed, then moved."""
    kw = make_inputs(1, case.T, case.H, case.K, case.V, seed=case.seed, dtype=dtype, device=device, gate="bounded",
                     lower_bound=case.lower_bound, h0=False, chunk_size=16)
    h0 = None
    if case.h0:
        gen = torch.Generator().manual_seed(int(case.seed) + 104729)
        h0 = torch.randn(case.N, case.H, case.K, case.V, generator=gen) * (1.0 / math.sqrt(case.K))
        if case.state_v_first:
            h0 = h0.transpose(-1, -2).contiguous()
        h0 = h0.to(device)
    kw.update(initial_state=h0, cu_seqlens=case.cu_seqlens(device), state_v_first=case.state_v_first)
    return kw


def _bounds(cu_seqlens, T: int) -> list[int]:
    """The token offsets of packed sequences, checked as the stage contract checks them."""
    return check_cu_seqlens(cu_seqlens, 1, T, getattr(cu_seqlens, "device", None))[0].tolist()


def kda_reference_varlen(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
                         output_final_state=True, gate="bounded", lower_bound=None, chunk_size=None,
                         cu_seqlens=None, state_v_first=False, dtype=torch.float64):
    """The fp64 token loop (common.reference.kda_reference) over packed
    sequences: sequence n (tokens cu_seqlens[n]:cu_seqlens[n + 1] of the
    [1, T, H, *] inputs) runs on its own from initial_state[n] (zero without
    one). Takes a stage's packed call unchanged. Returns o [1, T, H, V] and
    the final states [N, H, K, V] ([N, H, V, K] with state_v_first; None if not
    asked) in ``dtype``. A sequence of length 0 writes no output and keeps its
    initial state (zero without one). Without cu_seqlens it is kda_reference
    (with the state layout handled)."""
    h0 = initial_state
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2)
    common_kw = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, gate=gate, lower_bound=lower_bound, dtype=dtype)
    if cu_seqlens is None:
        o, S = kda_reference(q, k, v, g, beta, initial_state=h0, **common_kw)
    else:
        B, T, H, K = q.shape
        V = v.shape[-1]
        if B != 1:
            raise ValueError(f"packed sequences need B == 1, got B = {B}")
        b = _bounds(cu_seqlens, T)
        N = len(b) - 1
        if h0 is not None and tuple(h0.shape) != (N, H, K, V):
            raise ValueError(f"initial_state must hold N = {N} states, got shape {list(initial_state.shape)}")
        o = torch.zeros(1, T, H, V, dtype=dtype, device=q.device)
        S = torch.zeros(N, H, K, V, dtype=dtype, device=q.device)
        for n in range(N):
            s, e = b[n], b[n + 1]
            hn = None if h0 is None else h0[n:n + 1]
            if e == s:
                if hn is not None:
                    S[n] = hn[0].to(dtype)
                continue
            on, Sn = kda_reference(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=hn,
                                   **common_kw)
            o[:, s:e] = on
            S[n] = Sn[0]
    if state_v_first:
        S = S.transpose(-1, -2).contiguous()
    return o, (S if output_final_state else None)


def run_varlen(fn, inp: dict, device, dtype=None) -> dict:
    """Call ``fn`` (a stage's forward or :func:`kda_reference_varlen`) on a
    packed call's inputs moved to ``device`` (cu_seqlens too), under no_grad,
    with outputs poisoned. ``dtype`` converts the float inputs (the fp64
    reference). Returns {"o", "S"}."""
    kw = {n: (t.to(device) if torch.is_tensor(t) else t) for n, t in inp.items()}
    if dtype is not None:
        for n in TENSOR_ARGS:
            if kw[n] is not None:
                kw[n] = kw[n].to(dtype)
    with poisoned(), torch.no_grad():
        o, S = fn(**kw)
    return {"o": o, "S": S}


def run_per_sequence(fn, inp: dict, device) -> dict:
    """A packed call done the old way: ``fn`` (a stage contract forward without
    cu_seqlens, any stage) called once per non-empty sequence on its slice
    [1, L, H, *] and its own initial state ([1, H, K, V]), outputs poisoned; an
    empty sequence keeps its initial state (zero without one). Returns {"o"
    [1, T, H, V], "S" in the packed call's layout}."""
    kw = {n: (t.to(device) if torch.is_tensor(t) else t) for n, t in inp.items()}
    cu, vfirst = kw.pop("cu_seqlens"), kw.pop("state_v_first", False)
    h0 = kw.pop("initial_state")
    if h0 is not None and vfirst:
        h0 = h0.transpose(-1, -2).contiguous()
    q, v = kw["q"], kw["v"]
    _, T, H, K = q.shape
    V = v.shape[-1]
    b = _bounds(cu, T)
    N = len(b) - 1
    o = torch.full((1, T, H, V), float("nan"), dtype=v.dtype, device=device)
    S = torch.zeros(N, H, K, V, dtype=torch.float32, device=device)
    with poisoned(), torch.no_grad():
        for n in range(N):
            s, e = b[n], b[n + 1]
            hn = None if h0 is None else h0[n:n + 1].contiguous()
            if e == s:
                if hn is not None:
                    S[n] = hn[0]
                continue
            part = {x: (kw[x][:, s:e].contiguous() if x in ("q", "k", "v", "g", "beta") else kw[x]) for x in kw}
            on, Sn = fn(**part, initial_state=hn)
            o[:, s:e] = on
            S[n] = Sn[0]
    if vfirst:
        S = S.transpose(-1, -2).contiguous()
    return {"o": o, "S": S}


def _seq_err(x, ref) -> float:
    """rel_err, except that a reference of norm 0 (the final state of an empty
    sequence without h0) must be met exactly: 0.0 if ``x`` is all zero, else inf."""
    r64 = ref.detach().to("cpu", torch.float64)
    if torch.isfinite(r64).all() and torch.linalg.vector_norm(r64).item() == 0.0:
        x64 = x.detach().to("cpu", torch.float64)
        return 0.0 if bool(torch.isfinite(x64).all()) and not bool(x64.any()) else math.inf
    return rel_err(x, ref)


def _whole_err(x, ref) -> float:
    """rel_err, inf where the shapes differ (a stage that returned the wrong layout or count)."""
    if x is None or ref is None or tuple(x.shape) != tuple(ref.shape):
        return math.inf
    return rel_err(x, ref)


def _worst_sequence(name: str, x, ref, bounds) -> tuple[float, int | None]:
    """The largest per-sequence error of output ``name`` ("o": the sequence's
    tokens, empty ones skipped; "S": its final state) and which sequence."""
    if x is None or ref is None or tuple(x.shape) != tuple(ref.shape):
        return math.inf, None
    worst_e, at = 0.0, None
    for n in range(len(bounds) - 1):
        s, e = bounds[n], bounds[n + 1]
        if name == "o" and e == s:
            continue
        err = _seq_err(x[:, s:e], ref[:, s:e]) if name == "o" else _seq_err(x[n], ref[n])
        if at is None or err > worst_e:
            worst_e, at = err, n
    return worst_e, at


# A single sequence of a few tokens has no averaging: its relative error may be
# up to about twice the whole call's (one bf16 token of o sits near 3e-3).
VARLEN_SEQ_TOL_FACTOR = 2.0


def check_varlen(stage, case: VarlenCase, *, device=None, per_seq="self", ref_device=None) -> list[dict]:
    """Errors of a stage's packed call (cu_seqlens) on one case: a row per
    output (o, S) with the error against :func:`kda_reference_varlen` (fp64,
    sequence by sequence) and against ``per_seq`` run sequence by sequence
    without cu_seqlens (:func:`run_per_sequence`): "self" (default: the stage's
    own equal-length path), "previous" (the stage before it in the ladder), a
    stage id or module, or None (no comparison). Outputs are poisoned.

    Rows as check_case's (stage, case, output, err_ref, err_prev, prev, tol,
    ok) plus the worst single sequence's errors (err_ref_seq, err_prev_seq,
    worst_seq: an error in one short sequence hardly moves the whole call's),
    held to VARLEN_SEQ_TOL_FACTOR x the tolerance (tol_seq), and equal_prev
    (bitwise equal to the per-sequence calls). A comparison that could not be
    made (a wrong shape, NaN) is inf and never ok."""
    stage = as_stage(stage)
    spec = stage.SPEC
    dev = stage_device(spec, device)
    inp = varlen_inputs(case, "cpu", spec.compute_dtype)
    got = run_varlen(stage.forward, inp, dev)
    rdev = torch.device(ref_device) if ref_device is not None else dev
    ref = run_varlen(kda_reference_varlen, inp, rdev, dtype=torch.float64)
    if per_seq == "self":
        cmp = stage
    elif per_seq == "previous":
        cmp = ladder_stage(spec.id).previous
    else:
        cmp = as_stage(per_seq) if per_seq is not None else None
    pres = None
    if cmp is not None:
        pres = run_per_sequence(cmp.forward, inp, stage_device(cmp.SPEC, dev))
    b = case.bounds()
    rows = []
    for name in ("o", "S"):
        tol = spec.tol(name)
        tol_seq = VARLEN_SEQ_TOL_FACTOR * tol
        x = got[name]
        r = _whole_err(x, ref[name])
        rs, ws = _worst_sequence(name, x, ref[name], b)
        p = ps = eq = None
        if pres is not None:
            p = _whole_err(x, pres[name])
            ps, _ = _worst_sequence(name, x, pres[name], b)
            y = pres[name]
            eq = x is not None and x.dtype == y.dtype and tuple(x.shape) == tuple(y.shape) and torch.equal(x, y)
        ok = r <= tol and rs <= tol_seq and (p is None or (p <= tol and ps <= tol_seq))
        rows.append(dict(stage=spec.name, case=case.id, output=name, err_ref=r, err_prev=p,
                         prev=(f"{cmp.SPEC.name} per sequence" if cmp is not None else None), tol=tol, ok=ok,
                         err_ref_seq=rs, err_prev_seq=ps, worst_seq=ws, equal_prev=eq, tol_seq=tol_seq))
    return rows
