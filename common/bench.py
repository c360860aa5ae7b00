"""Latency sweeps: one row per (stage, shape), forward and backward.

Forward: ``stage.forward`` under no_grad. Backward: the gradient call alone on
saved inputs: for compiled stages the extension's ``bwd`` (which recomputes
what it needs), for stage 00 autograd's backward over a retained graph. On a
GPU every figure comes twice: eager (CUDA events; host launch overhead
included) and CUDA-graph replay (GPU time).
"""

from __future__ import annotations

import sys
import time

import torch

from . import extrun, results
from .checks import stage_device
from .contract import prepare
from .fla_ref import (FLASHKDA_NAME, fla_available, fla_forward, flashkda_available, flashkda_call,
                      flashkda_unsupported)
from .inputs import make_cotangents, make_inputs, parse_shape, shape_label  # noqa: F401 (bench.shape_label)
from .stages import declared_records, load_stage, stage as ladder_stage
from .timing import time_call

# The sweeps of the issues, in one place.
CPU_SWEEP = [dict(B=1, T=t, H=2, K=32, V=32) for t in (64, 128, 256, 512)]
FP32_GPU_SWEEP = [dict(B=2, T=t, H=4, K=64, V=64) for t in (128, 512, 2048, 8192)] + [
    dict(B=1, T=1024, H=64, K=128, V=128)]
TC_GPU_SHAPES = [dict(B=1, T=1024, H=64, K=128, V=128), dict(B=8, T=1024, H=64, K=128, V=128),
                 dict(B=1, T=8192, H=64, K=128, V=128), dict(B=1, T=8192, H=96, K=128, V=128),
                 dict(B=1, T=4096, H=16, K=128, V=128), dict(B=2, T=2048, H=4, K=64, V=64)]

# The shape a stage's profile is taken at, per device type.
PROFILE_SHAPE = {"cpu": dict(B=1, T=256, H=2, K=32, V=32), "cuda": dict(B=2, T=2048, H=4, K=64, V=64)}

# The regimes of the tour's summary and of the ablations: one shape each, where a
# column can be read down the ladder (:func:`regime` gives a stage's).
REGIMES = {
    "cpu": dict(title="fp32 on the CPU (softplus gate, chunk 64)", shape=CPU_SWEEP[-1], results=("cpu", "tour"),
                refs=()),
    "fp32-gpu": dict(title="fp32 on the GPU (softplus gate, chunk 64)", shape=FP32_GPU_SWEEP[2],
                     results=("h200", "fp32_stages"), refs=("FLA chunk_kda",)),
    "tc-gpu": dict(title="bf16 tensor cores on the GPU (bounded gate, chunk 16)", shape=TC_GPU_SHAPES[0],
                   results=("h200", "tc_stages"), refs=("FLA chunk_kda", "FlashKDA")),
}


def declared_latency_rows() -> list[dict]:
    """The tensor-core stages' times from the records they declare (``RECORDS["latency"]`` in stage.py:
    a record under results/h200/ and its rows of the stage, ``part``), as rows of :func:`bench_stage`:
    one per shape (the record's last round), each naming its record, commit and date."""
    out = []
    for sid, decl in declared_records("latency").items():
        data = results.recorded(decl["file"])
        if not data:
            continue
        name, meta, at = load_stage(sid).SPEC.name, data["meta"], {}
        for r in data["rows"]:
            if r.get("stage") == name and r.get("part", decl.get("part")) == decl.get("part"):
                at[shape_label(r)] = r  # the last round at each shape
        for r in at.values():
            out.append(dict({k: r[k] for k in ("B", "T", "H", "K", "V")}, stage=name, fwd_ms=r.get("ms"),
                            fwd_graph_ms=r.get("graph_ms"), peak_mb=r.get("peak_mb"), gate=r.get("gate"),
                            record=f"results/h200/{decl['file']}.json", commit=meta.get("commit"),
                            run=meta.get("date"), device=meta.get("device")))
    return out


def recorded_tc_rows() -> tuple[dict | None, list[dict]]:
    """(meta, rows) of the tensor-core stages at the H200 shapes: results/h200/tc_stages.json, and for a
    stage with no row there, the rows of the record it declares (:func:`declared_latency_rows`)."""
    data = results.recorded(REGIMES["tc-gpu"]["results"][1], REGIMES["tc-gpu"]["results"][0])
    meta, rows = (data["meta"], list(data["rows"])) if data else (None, [])
    have, shapes = {r.get("stage") for r in rows}, {shape_label(s) for s in TC_GPU_SHAPES}
    return meta, rows + [r for r in declared_latency_rows() if r["stage"] not in have and shape_label(r) in shapes]


def regime(spec) -> str:
    """The regime (a key of :data:`REGIMES`) of a stage's spec."""
    if spec.compute_dtype == torch.bfloat16:
        return "tc-gpu"
    return "cpu" if "cpu" in spec.devices else "fp32-gpu"


def sweep_for(spec, device, quick: bool = False):
    """The shapes a stage is timed on where it runs."""
    if spec.compute_dtype == torch.bfloat16:
        return TC_GPU_SHAPES
    if torch.device(device).type == "cpu":
        return CPU_SWEEP[:3] if quick else CPU_SWEEP
    return FP32_GPU_SWEEP


def progress_bar(items, desc: str, unit: str):
    """A text progress bar (tqdm) on stdout: it shows in a terminal, a notebook
    and an executed notebook alike (no widget), only for a step that lasts
    more than a few seconds, and is gone when done."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit=unit, leave=False, file=sys.stdout, ncols=90, mininterval=1.0, delay=5.0)


def path_inputs(shape: dict, device="cuda", gate="bounded") -> dict:
    """The inputs of every path measurement of a stage with several paths (:func:`path_rows`, the
    notebook's live profile, scripts/ncu_case.py, scripts/try_variants.py): seed 0, bf16, chunk 16,
    the bounded gate (lower bound -5) or ``gate="softplus"`` (no bound)."""
    if gate not in ("bounded", "softplus"):
        raise ValueError(f"gate must be 'bounded' or 'softplus', got {gate!r}")
    bound = {"lower_bound": -5.0} if gate == "bounded" else {}
    return make_inputs(shape["B"], shape["T"], shape["H"], shape["K"], shape["V"], seed=0, dtype=torch.bfloat16,
                       device=device, gate=gate, chunk_size=16, **bound)


LONG_CALL_S = 0.05  # above this, launch overhead is noise: no graph replay, fewer repetitions
VERY_LONG_CALL_S = 0.5  # above this, the first call is the warm-up and two more are timed


def best_ms(row: dict, y: str = "fwd"):
    """A row's time for ``y`` ("fwd" or "bwd"): GPU time (graph replay) where
    it was measured, else the eager time; None if neither."""
    g = row.get(f"{y}_graph_ms")
    return g if g is not None else row.get(f"{y}_ms")


def predicted_s(row: dict) -> float | None:
    """About how many seconds bench_stage spends on a shape, from a recorded
    row of the same stage and shape: warm-up plus timed calls, forward and
    backward (see _timed). None when the row has no time."""
    total, known = 0.0, False
    for y in ("fwd", "bwd"):
        ms = row.get(f"{y}_ms")
        if ms is None:
            continue
        known, s = True, ms / 1e3
        if s > VERY_LONG_CALL_S:
            total += 3 * s  # warm-up and two timed calls
        elif s > LONG_CALL_S:
            total += 5 * s  # warm-up, sizing call, three repetitions
        else:
            total += 1.0  # repetitions bounded by the budget, graph capture
    return total if known else None


def fit_budget(name: str, shapes, recorded, budget_s: float):
    """Split a sweep into the shapes to time live and the recorded rows shown
    for the rest: shapes are taken in order while the time predicted from
    ``recorded`` (rows of any stage; those of ``name`` are used) stays within
    ``budget_s``. A shape with no recorded time is timed. Returns (live
    shapes, recorded rows for the skipped shapes, predicted seconds of the
    live part, predicted seconds of the skipped part)."""
    mine = {shape_label(r): r for r in recorded if r.get("stage") == name and best_ms(r) is not None}
    live, skipped, spent, left = [], [], 0.0, 0.0
    for shape in shapes:
        row = mine.get(shape_label(shape))
        need = predicted_s(row) if row is not None else None
        if need is None or spent + need <= budget_s:
            live.append(shape)
            spent += need or 0.0
        else:
            skipped.append(row)
            left += need
    return live, skipped, spent, left


def _timed(fn, device, budget_s: float, graph: bool, say=None) -> dict:
    """Time ``fn`` with a repetition count that fits ``budget_s``. The first call
    is a warm-up (lazy initialisation, autotuning); the second sizes the rest.
    Long calls (> LONG_CALL_S) get no graph replay and 3 repetitions; very long
    ones (> VERY_LONG_CALL_S) are the median of the second and a third call."""
    cuda = torch.device(device).type == "cuda"

    def once():
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()  # warm-up
    dt = max(once(), 1e-6)
    if dt > VERY_LONG_CALL_S:
        if say is not None:
            say(f"  one call takes {dt:.1f} s: timing one more")
        ts = sorted([dt, once()])
        return {"ms": 1e3 * (ts[0] + ts[1]) / 2, "min_ms": 1e3 * ts[0], "reps": 2,
                "note": "wall clock of two calls after a warm-up (each call > 0.5 s)",
                **({"graph_ms": None} if graph and cuda else {})}
    long_call = dt > LONG_CALL_S
    reps = 3 if long_call else int(max(3, min(50, budget_s / dt)))
    out = time_call(fn, device, reps=reps, graph=graph and not long_call, warmup=0 if long_call else None)
    if graph and long_call and cuda:
        out["graph_ms"] = None
        out["graph_note"] = f"one call takes {dt * 1e3:.0f} ms: launch overhead is noise, no graph replay"
    return out


def _backward_fn(stage, kw, device):
    """A closure that runs the stage's backward once on fixed inputs."""
    spec = stage.SPEC
    B, T, H, K, V = kw["q"].shape[0], kw["q"].shape[1], kw["q"].shape[2], kw["q"].shape[3], kw["v"].shape[3]
    do, dht = make_cotangents((B, T, H, V), (B, H, K, V), seed=1)
    do, dht = do.to(device), dht.to(device)
    ext = stage.build() if hasattr(stage, "build") else None
    if ext is not None:
        c = prepare(spec, **kw)
        return lambda: extrun.backward(ext, c, do, dht)
    leaves = {n: (t.detach().requires_grad_(True) if torch.is_tensor(t) else t) for n, t in kw.items()}
    o, S = stage.forward(**leaves)
    inputs = [t for t in leaves.values() if torch.is_tensor(t)]
    return lambda: torch.autograd.grad((o, S), inputs, (do, dht), retain_graph=True)


def bench_stage(stage_id, shape: dict, *, gate=None, chunk=None, backward=None, device=None,
                dtype=torch.float32, budget_s: float = 1.0, graph: bool = True, say=None) -> dict:
    """Time one stage (or "fla", or "flashkda") at one shape. Returns a flat
    row. ``gate`` and ``chunk`` default to the stage's own (its first gate, its
    default chunk); FLA defaults to the softplus gate. FlashKDA (row stage
    "FlashKDA") is forward only, bf16, bounded gate, its own 16-token chunks,
    K = V = 128; its own call is timed (fla_ref.flashkda_call: the states in
    its [B, H, V, K] layout, no transposes). RuntimeError with the reason when
    a reference is not available here or cannot take the shape."""
    if stage_id == "flashkda":
        ok, why = flashkda_available()
        if not ok:
            raise RuntimeError(why)
        gate = gate or "bounded"
        why = flashkda_unsupported(shape["K"], shape["V"], gate)
        if why is not None:
            raise RuntimeError(why)
        dev = torch.device("cuda")
        kw = make_inputs(shape["B"], shape["T"], shape["H"], shape["K"], shape["V"], seed=0, dtype=torch.bfloat16,
                         device=dev, gate=gate, chunk_size=16)
        row = dict(stage=FLASHKDA_NAME, **shape, gate=gate, chunk=16, dtype="bfloat16", device=str(dev))
        t = _timed(flashkda_call(**kw), dev, budget_s, graph, say)
        row.update({"fwd_" + k: v for k, v in t.items()})
        return row
    if stage_id == "fla":
        ok, why = fla_available()
        if not ok:
            raise RuntimeError(why)
        name, fwd, dev, spec = "FLA chunk_kda", fla_forward, torch.device("cuda"), None
        gate = gate or "softplus"
        has_bwd = True if backward is None else backward
    else:
        stage = load_stage(stage_id)
        spec = stage.SPEC
        name, fwd, dev = spec.name, stage.forward, stage_device(spec, device)
        has_bwd = spec.backward if backward is None else (backward and spec.backward)
        if spec.compute_dtype == torch.bfloat16:
            dtype = torch.bfloat16
        gate = gate or spec.gates[0]
        chunk = chunk or spec.default_chunk
    kw = make_inputs(shape["B"], shape["T"], shape["H"], shape["K"], shape["V"], seed=0, dtype=dtype,
                     device=dev, gate=gate, chunk_size=chunk)
    row = dict(stage=name, **shape, gate=gate, chunk=chunk or 64,  # FLA's chunk_kda: 64-token chunks
               dtype=str(dtype).replace("torch.", ""), device=str(dev))

    def f():
        with torch.no_grad():
            fwd(**kw)

    t = _timed(f, dev, budget_s, graph, say)
    row.update({"fwd_" + k: v for k, v in t.items()})
    if has_bwd:
        if say is not None:
            say(f"  forward {t['ms']:.3f} ms; backward next")
        if stage_id == "fla":
            leaves = {n: (x.detach().requires_grad_(True) if torch.is_tensor(x) and x.is_floating_point() else x)
                      for n, x in kw.items()}
            o, S = fla_forward(**leaves)
            do, dht = torch.randn_like(o), torch.randn_like(S)
            ins = [x for x in leaves.values() if torch.is_tensor(x) and x.requires_grad]
            b = lambda: torch.autograd.grad((o, S), ins, (do, dht), retain_graph=True)  # noqa: E731
            gb = False
        else:
            b = _backward_fn(stage, kw, dev)
            gb = graph and stage.build() is not None
        t = _timed(b, dev, budget_s, gb, say)
        row.update({"bwd_" + k: v for k, v in t.items()})
    return row


def unsteady(row: dict) -> list[str]:
    """What a row's timings say about their repeats disagreeing (common.timing.UNSTEADY_SPREAD), as sentences."""
    return [f"{row.get('stage')} at {shape_label(row)}, {k.split('_')[0]} {'graph replay' if 'graph' in k else 'time'}: "
            f"{row[k]}" for k in sorted(row) if k.endswith("unsteady") and row[k]]


def sweep(stage_ids, shapes, *, progress=None, on_row=None, bar: bool = False, **kw) -> list[dict]:
    """bench_stage over stages x shapes; ``on_row(rows)`` after each row (to save
    as it goes); ``bar`` shows a tqdm progress bar."""
    rows = []
    for sid in stage_ids:
        it = shapes
        if bar:
            it = progress_bar(shapes, f"timing {sid}", "shape")
        for shape in it:
            if progress is not None:
                progress(f"{sid} {shape_label(shape)}")
            try:
                rows.append(bench_stage(sid, shape, say=progress, **kw))
            except RuntimeError as e:  # out of memory or an unavailable reference: record why
                rows.append(dict(stage=str(sid), **shape, error=str(e).splitlines()[0][:300]))
            for msg in unsteady(rows[-1]):  # said where it happens, whoever called
                print(f"WARNING: {msg}", file=sys.stderr if progress is None else sys.stdout, flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if on_row is not None:
                on_row(rows)
    return rows


def kernel_times(fn, *, warmup: int = 10, calls: int = 30) -> dict:
    """{kernel name: (launches, mean GPU ms per launch)} over ``calls`` calls of ``fn`` after ``warmup``
    (torch.profiler's CUDA activity): which kernel moved when a whole call's time did."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: (e.count, e.self_device_time_total / 1000 / max(e.count, 1))
            for e in prof.key_averages() if e.self_device_time_total}


def peak_mb(fn) -> float:
    """max_memory_allocated above what is allocated before one call of ``fn``
    (on the GPU), in MB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 1e6


def _gpu_rel_err(x, ref) -> float:
    """common.metrics.rel_err computed where the tensors are (fp64 on the GPU:
    no copy of a 0.5 GB output to the host); NaN or inf gives inf."""
    import math

    d = (x.double() - ref.double()).norm() / ref.double().norm()
    v = float(d.item())
    return v if math.isfinite(v) and bool(torch.isfinite(x).all()) else math.inf


def path_rows(stage_id, shape: dict, *, budget_s: float = 0.4, flashkda: bool = True, profile: bool = False,
              on_row=None, segment_chunks: int | None = None) -> list[dict]:
    """A stage with several paths (its ``PATHS``, pinned one at a time by
    ``stage.path``; stages 08 and 09) at one shape on the GPU, beside the previous
    stage and FlashKDA, on the same inputs (bf16, bounded gate, chunk 16):
    the previous stage, the stage's rule, every path that exists for V, and
    FlashKDA when ``flashkda`` and it is built here (K = V = 128 only). Each
    row of the stage is held to the same path of the previous stage where that
    stage has paths too (``vs_path``), else to its rule.

    One row each (the schema of results/h200/stage08/, stage09/): stage (the id, or
    "FlashKDA"), path ("rule" where none is pinned), the shape, fwd_* times
    (eager and CUDA-graph replay, see _timed), peak_mb (:func:`peak_mb` of one
    call), and for the stages equal_to_<prev> (o and the final state bitwise
    equal to the previous stage's), err_vs_<prev> (the larger relative
    difference of the two), kernels (what the call launched); for FlashKDA
    o_vs_<prev>. ``profile``: the clock64 regions of each of the stage's rows
    too. A path that fails records its error. ``on_row(row)`` after each row.
    ``segment_chunks`` pins the split path's segment length (``stage.path``)
    for every row of the stage, and is recorded in them."""
    from contextlib import nullcontext

    from .fla_ref import flashkda_forward

    stage = ladder_stage(stage_id)
    prev = stage.previous
    pid = prev.id
    kw = path_inputs(shape)
    prev_paths = getattr(prev, "PATHS", {})

    def reference(name):
        """The previous stage's outputs to hold a row to: the same path pinned where
        the previous stage has it (stage 09 against stage 08), else its rule."""
        pin = name if name in prev_paths else None
        with torch.no_grad(), (prev.path(pin) if pin else nullcontext()):
            return prev.forward(**kw), pin or "rule"

    (o_ref, S_ref), _ = reference(None)
    paths = [None] + [n for n, (_, ncw) in stage.PATHS.items() if 16 * ncw <= shape["V"]]
    cands = [(pid, None, prev.forward)] + [(stage.SPEC.id, n, stage.forward) for n in paths]
    if flashkda and flashkda_available()[0] and flashkda_unsupported(shape["K"], shape["V"]) is None:
        cands.append((FLASHKDA_NAME, None, flashkda_forward))
    rows = []
    for who, name, fwd in cands:
        row = dict(stage=who, path=name or "rule", **shape)
        pin = dict(segment_chunks=segment_chunks) if segment_chunks else {}
        if who == stage.SPEC.id:
            row.update(pin)
        try:
            with (stage.path(name, **pin) if who == stage.SPEC.id else nullcontext()):
                def f():
                    with torch.no_grad():
                        return fwd(**kw)
                ours = who == stage.SPEC.id
                o, S = f()
                if ours:  # read right after the call: a later call replaces the launch log
                    row["kernels"] = [x["kernel"] for x in stage.build().launches()]
                if who != FLASHKDA_NAME:
                    (o_p, S_p), ref_path = reference(name) if who == stage.SPEC.id else ((o_ref, S_ref), "rule")
                    equal = bool(torch.equal(o, o_p) and torch.equal(S, S_p))
                    row[f"equal_to_{pid}"] = equal
                    row[f"err_vs_{pid}"] = 0.0 if equal else max(_gpu_rel_err(o, o_p), _gpu_rel_err(S, S_p))
                    if prev_paths:
                        row["vs_path"] = ref_path  # which of the previous stage's paths
                    del o_p, S_p
                else:
                    row[f"o_vs_{pid}"] = _gpu_rel_err(o, o_ref)
                del o, S
                if who == FLASHKDA_NAME:  # its own call as a model makes it: states in its layout, no transposes
                    call = flashkda_call(**kw)
                    t = _timed(call, "cuda", budget_s, True)
                    del call
                    row["peak_mb"] = round(peak_mb(lambda: flashkda_call(**kw)()), 1)
                else:
                    t = _timed(f, "cuda", budget_s, True)
                    row["peak_mb"] = round(peak_mb(f), 1)
                row.update({"fwd_" + k: v for k, v in t.items()})
                if profile and who == stage.SPEC.id:
                    row["profile"] = stage.profile(**kw)
        except Exception as e:  # noqa: BLE001 -- a path that does not run at this shape: record why
            row["error"] = str(e).splitlines()[0][:300]
        torch.cuda.empty_cache()
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
