"""Every idea measured on its own: the ablations of a multi-idea stage.

A stage whose step from the previous one carries several ideas lists them in
``ABLATIONS`` (stage.py): each is a preprocessor switch that turns that one idea
off, the rest of the stage left on. This module builds each variant, holds it
to the stage's checks (fp64 reference, and the full stage in place of the
previous one), times it beside the stage at the stage's regime shape and
records the profile region the idea moved.

    from common import ablation
    rows = ablation.measure("06")            # on a GPU: check, time, profile
    ablation.table("06")                     # recorded (or live) rows as a DataFrame
    ablation.plot("06")                      # what each idea bought, and where
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import torch

from . import bench, checks, extrun
from .contract import prepare
from .stages import stage as ladder_stage

RESULTS = "ablations"  # results/h200/ablations.json


def ablations(stage_id) -> tuple:
    """The stage's ablations (empty for a one-idea stage)."""
    return ladder_stage(stage_id).ablations


def stages_with_ablations() -> list[str]:
    from .stages import ladder

    return [st.id for st in ladder() if st.ablations]


def variant(stage_id, name: str):
    """A stage-like object (SPEC, forward, profile, build) for the stage built
    with ablation ``name`` turned off; checks and timings take it as a stage."""
    stage = ladder_stage(stage_id)
    ab = next((a for a in stage.ABLATIONS if a.name == name), None)
    if ab is None:
        known = ", ".join(a.name for a in stage.ABLATIONS) or "none"
        raise ValueError(f"ablation must be one of stage {stage.SPEC.id}'s ablations ({known}), got {name!r}")
    spec = dataclasses.replace(stage.SPEC, name=f"{stage.SPEC.name} -{name}")

    def forward(q, k, v, g, beta, **kw):
        c = prepare(stage.SPEC, q, k, v, g, beta, **kw)
        return extrun.run(stage.build(ablation=name), stage.SPEC, c)

    def profile(q, k, v, g, beta, *, backward=False, **kw):
        c = prepare(stage.SPEC, q, k, v, g, beta, **kw)
        return extrun.profile(stage.build(profile=True, ablation=name), stage.SPEC, c, backward=backward)

    def build(profile=False, verbose=False):
        return stage.build(profile=profile, verbose=verbose, ablation=name)

    return SimpleNamespace(SPEC=spec, forward=forward, profile=profile, build=build, ABLATION=ab, BASE=stage)


def shape_for(stage_id) -> dict:
    """The shape a stage's ablations are timed and profiled at: its regime's
    summary shape (bench.REGIMES)."""
    return dict(bench.REGIMES[bench.regime(ladder_stage(stage_id).spec)]["shape"])


def _time(fn, budget_s: float) -> dict:
    return bench._timed(fn, torch.device("cuda"), budget_s, graph=True)


def _timings(st, spec, shape, budget_s: float) -> dict:
    kw = checks.stage_inputs(spec, **shape, device="cuda")

    def f():
        with torch.no_grad():
            st.forward(**kw)

    out = {"fwd_" + k: v for k, v in _time(f, budget_s).items()}
    out["peak_mb"] = bench.peak_mb(f)  # what one call adds to memory, MB as in the paths tables
    if spec.backward:  # the variant's own build: bench's backward closure calls st.build()
        out.update({"bwd_" + k: v for k, v in _time(bench._backward_fn(st, kw, "cuda"), budget_s).items()})
    return out


def measure(stage_id, *, budget_s: float = 1.0, quick: bool = False, say=print) -> list[dict]:
    """On a GPU: the stage and each ablation, checked (vs fp64 and vs the full
    stage), timed at :func:`shape_for` and profiled. One row per variant."""
    stage = ladder_stage(stage_id)
    sid = stage.id
    spec = stage.SPEC
    shape = shape_for(sid)
    cases = checks.cases_for(spec, "cuda", quick=quick)
    rows = []
    # the full stage at its regime shape and at every other shape an ablation names
    shapes = [shape] + [dict(a.shape) for a in ablations(sid) if a.shape and dict(a.shape) != shape]
    shapes = [x for i, x in enumerate(shapes) if x not in shapes[:i]]
    runs = [(None, x) for x in shapes] + [(ab, dict(ab.shape or shape)) for ab in ablations(sid)]
    for ab, shape in runs:
        st = stage if ab is None else variant(sid, ab.name)
        t0 = time.time()
        r = checks.check_stage(st, cases, device="cuda", prev=(None if ab is None else stage))
        det = checks.check_deterministic(st, checks.determinism_case(cases), device="cuda")
        worst = checks.summarize(r)
        row = dict(stage=spec.name, variant="full" if ab is None else ab.name,
                   define=None if ab is None else ab.define,
                   idea=None if ab is None else ab.idea, instead=None if ab is None else ab.instead,
                   region=None if ab is None else ab.region, **shape,
                   gate=spec.gates[0], chunk=spec.default_chunk,
                   checks_ok=all(x["ok"] for x in r) and det, deterministic=det, cases=len(cases),
                   err_ref=max(w["err_ref"] for w in worst),
                   err_full=(None if ab is None else max(w["err_prev"] for w in worst)))
        row.update(_timings(st, spec, shape, budget_s))
        kw = checks.stage_inputs(spec, **shape, device="cuda")
        row["profile"] = st.profile(**kw, backward=spec.backward)
        row["profile_unit"] = spec.region_unit
        rows.append(row)
        say(f"{spec.name} {row['variant']}: checks {'ok' if row['checks_ok'] else 'FAILED'} "
            f"(err vs fp64 {row['err_ref']:.2e}"
            + (f", vs full stage {row['err_full']:.2e}" if row["err_full"] is not None else "")
            + f"), fwd {bench.best_ms(row):.3f} ms ({time.time() - t0:.0f} s)")
    return rows


def recorded_rows(stage_id=None) -> tuple[dict | None, list[dict]]:
    """(meta, rows) of results/h200/ablations.json, for one stage or all."""
    from .results import recorded

    rec = recorded(RESULTS)
    if rec is None:
        return None, []
    rows = rec["rows"]
    if stage_id is not None:
        name = ladder_stage(stage_id).name
        rows = [r for r in rows if r["stage"] == name]
    return rec["meta"], rows


def _shape_of(r) -> tuple:
    return tuple(r.get(k) for k in ("B", "T", "H", "K", "V"))


SHRANK = 1.05  # a region shrank with an idea when it is more than 5% larger without it (a margin over noise)


def bought(rows) -> list[dict]:
    """Per ablation: how much slower the stage is without the idea (the idea's
    gain), forward and (where timed) backward, against the full stage at the
    same shape, its peak memory either way, and where it shows: the profile region it
    shrank most (per block, variant - full, by more than SHRANK: where the cycles went, a wait included), or
    the region the stage declares for it (``Ablation.region``) where it shrank none
    (``region_shrank`` False)."""
    fulls = {_shape_of(r): r for r in rows if r["variant"] == "full"}
    out = []
    for r in rows:
        if r["variant"] == "full":
            continue
        full = fulls.get(_shape_of(r)) or next(iter(fulls.values()))
        d = dict(variant=r["variant"], idea=r["idea"], instead=r["instead"], checks_ok=r["checks_ok"],
                 err_full=r["err_full"], shape=bench.shape_label(r))
        if r.get("peak_mb") is not None and full.get("peak_mb") is not None:
            d["peak_mb_without"], d["peak_mb_with"] = r["peak_mb"], full["peak_mb"]
        for y in ("fwd", "bwd"):
            a, b = bench.best_ms(r, y), bench.best_ms(full, y)
            if a is not None and b is not None:
                d[f"{y}_ms_without"], d[f"{y}_ms_with"], d[f"{y}_speedup"] = a, b, a / b
        region = r["region"]
        pf, pv = full.get("profile") or {}, r.get("profile") or {}
        # where the idea shows: the region it shrank most (without - with, per block), measured; the region
        # the stage declares for it (Ablation.region) where none shrank
        saved = {k: pv[k] - pf[k] for k in pf.keys() & pv.keys() if pf[k] > 0 and pv[k] > SHRANK * pf[k]}
        if saved:
            region = max(saved, key=saved.get)
        if region in pf or region in pv:
            d["region"] = region
            d["region_without"], d["region_with"] = pv.get(region, 0.0), pf.get(region, 0.0)
            d["region_shrank"] = bool(saved)
        out.append(d)
    return out
