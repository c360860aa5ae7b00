"""Stage 12 and the softplus gate on the H200, in one call beside FLA (issue 21).

Seven parts, one results file (common.results; rows carry ``part``):

- ``accuracy``: on every softplus check case (common.checks.tc_softplus_cases:
  tails, B > 1 with h0, K = 64 and 128, the gate at its extremes) and the quick
  bounded-gate ones, o and the final state of stage 12 (as it runs, pair by pair
  pinned, and with u formed from Af rounded once: ``u_halves(False)``) and of
  FLA's chunk_kda (softplus gate: safe_gate=False) against the fp64 token loop on
  the same bf16 inputs, and whether every output is finite (FLA run on groups of
  heads: by_heads).
- ``speed``: at the tensor-core benchmark shapes and Kimi Linear's (B1 T8192
  H32, B4 T4096 H32, B1 T131072 H32), GPU time (CUDA events, and CUDA-graph
  replay where it captures) and peak memory of stage 12 and of FLA with the
  softplus gate, on the same inputs; FLA's rows come last so that a cut run
  keeps stage 12's.
- ``bounded``: at the same shapes with the bounded gate, stage 12 as it runs
  it (factored products; with ``u_halves(False)`` stage 11's bitwise), stage 12 with the
  pairwise products pinned (what the scheme costs where it is not needed),
  and stage 11.
- ``products``: at the same shapes with the softplus gate, stage 12 as it runs it
  (pair by pair only in the chunks that decay by more than 80, factored elsewhere)
  beside the pairwise products pinned in every chunk, with how many chunks of the
  inputs are wide (``stage.wide_chunks``): what the choice per chunk buys.
- ``paths``: stage 12 with the softplus gate on every path (``stage.path``), and
  the split paths at other segment lengths (``--segments``).
- ``u``: at the same shapes with the softplus gate, stage 12 as it runs it (u from
  Af in two bf16 halves) beside ``u_halves(False)``: what the second half costs.
- ``ring``: at K = 64 shapes where the rule takes K2's 8-slot ring (RING_SHAPES), both
  gates, stage 12 as it runs beside ``deep_ring(False)`` (4 slots), three rounds in turn.

    python scripts/bench_softplus.py --out $OUT/softplus.json [--parts accuracy,bounded,speed] [--who 12,fla]
        [--shapes 0,6] [--no-fla]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import checks  # noqa: E402
from common.bench import TC_GPU_SHAPES, _timed, peak_mb  # noqa: E402
from common.fla_ref import FLA_TUNED_HEADS, by_heads  # noqa: E402
from common.inputs import make_inputs  # noqa: E402
from common.metrics import rel_err  # noqa: E402
from common.reference import kda_reference, log_decay  # noqa: E402
from common.results import metadata, save  # noqa: E402
from common.stages import load_stage  # noqa: E402

KIMI_SHAPES = [dict(B=1, T=8192, H=32, K=128, V=128), dict(B=4, T=4096, H=32, K=128, V=128),
               dict(B=1, T=131072, H=32, K=128, V=128)]
SHAPES = TC_GPU_SHAPES + KIMI_SHAPES


def say(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def path_rows(shapes, on_row, segments=()) -> None:
    """Stage 12 with the softplus gate on each of its paths (the rule was chosen for the
    factored products, whose prepare is cheaper), and the split paths again at each
    segment length of ``segments`` (chunks per K1 + K2 pair; rows carry segment_chunks)."""
    s12 = load_stage("12")
    for shape in shapes:
        kw = gpu_inputs(**shape, gate="softplus")
        runs = [(None, None)] + [(n, None) for n, (_, ncw) in s12.PATHS.items() if 16 * ncw <= shape["V"]]
        runs += [(n, seg) for seg in segments for n, (fused, ncw) in s12.PATHS.items()
                 if not fused and 16 * ncw <= shape["V"]]
        for name, seg in runs:
            def f(kw=kw, name=name, seg=seg):
                with torch.no_grad(), s12.path(name, segment_chunks=seg):
                    return s12.forward(**kw)

            extra = {} if seg is None else {"segment_chunks": seg}
            on_row(timing_row("paths", "12_softplus", shape, f, gate="softplus", path=name or "rule", **extra))
        del kw


def product_rows(shapes, on_row) -> None:
    """Stage 12 with the softplus gate as it runs (pairwise only in the wide chunks) and
    with the pairwise products pinned in every chunk, on the same inputs."""
    s12 = load_stage("12")
    for shape in shapes:
        kw = gpu_inputs(**shape, gate="softplus")
        with torch.no_grad():
            wide, chunks = s12.wide_chunks(log_decay(kw["g"], kw["A_log"], kw["dt_bias"]))
            o, S = s12.forward(**kw)
            with s12.pairwise(True):
                o_pw, S_pw = s12.forward(**kw)
        diff = max(rel_err(o, o_pw), rel_err(S, S_pw))
        del o, S, o_pw, S_pw

        def f(kw=kw):
            with torch.no_grad():
                return s12.forward(**kw)

        def fpw(kw=kw):
            with torch.no_grad(), s12.pairwise(True):
                return s12.forward(**kw)

        on_row(timing_row("products", "12_softplus", shape, f, gate="softplus", products="as needed",
                          wide_chunks=wide, chunks=chunks, rel_diff_vs_pairwise=diff))
        on_row(timing_row("products", "12_softplus", shape, fpw, gate="softplus", products="pairwise"))
        del kw


def accuracy_rows(fla: bool) -> list[dict]:
    from common.fla_ref import fla_forward

    s12 = load_stage("12")
    rows = []
    for case in checks.tc_softplus_cases() + checks.tc_cases(quick=True):
        inp = checks.case_inputs(case, "cpu", torch.bfloat16)
        got = checks.run(s12.forward, inp, "cuda", backward=False)
        with s12.pairwise(True):
            pw = checks.run(s12.forward, inp, "cuda", backward=False)
        with s12.u_halves(False):
            once = checks.run(s12.forward, inp, "cuda", backward=False)
        ref = checks.run(kda_reference, inp, "cuda", backward=False, dtype=torch.float64)
        wide, chunks = s12.wide_chunks(log_decay(*(inp[n].double() for n in ("g", "A_log", "dt_bias"))))
        row = dict(part="accuracy", case=case.id, gate=case.gate, extreme=case.extreme, wide_chunks=wide, chunks=chunks,
                   o_err=rel_err(got["o"], ref["o"]), S_err=rel_err(got["S"], ref["S"]),
                   finite=bool(torch.isfinite(got["o"]).all() and torch.isfinite(got["S"]).all()),
                   pairwise_o_err=rel_err(pw["o"], ref["o"]), pairwise_S_err=rel_err(pw["S"], ref["S"]),
                   u_once_o_err=rel_err(once["o"], ref["o"]), u_once_S_err=rel_err(once["S"], ref["S"]))
        if fla:
            f = checks.run(by_heads(fla_forward, FLA_TUNED_HEADS[case.K]), inp, "cuda", backward=False)
            row.update(fla_o_err=rel_err(f["o"], ref["o"]), fla_S_err=rel_err(f["S"], ref["S"]),
                       fla_finite=bool(torch.isfinite(f["o"]).all() and torch.isfinite(f["S"]).all()))
        say("accuracy " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        rows.append(row)
    return rows


def _time(fn) -> dict:
    t = _timed(fn, "cuda", 0.5, True)
    out = {k: t.get(k) for k in ("ms", "min_ms", "graph_ms")}
    out["peak_mb"] = round(peak_mb(fn), 1)
    return out


def timing_row(part, who, shape, fn, **extra) -> dict:
    row = dict(part=part, stage=who, **shape, **extra)
    try:
        row.update(_time(fn))
    except Exception as e:  # noqa: BLE001 -- record why a row did not run
        row["error"] = str(e).splitlines()[0][:300]
    torch.cuda.empty_cache()
    say(f"{part} {who} {shape} " + " ".join(f"{k}={row.get(k)}" for k in ("ms", "graph_ms", "peak_mb", "error")
                                          if k in row))
    return row


def gpu_inputs(B, T, H, K, V, gate="softplus", lower_bound=None, seed=0) -> dict:
    """make_inputs' distributions (h0 present), drawn on the GPU: at T = 131072 the CPU
    draw of the four [B, T, H, 128] tensors would take minutes of the call."""
    small = make_inputs(1, 1, H, K, V, seed=seed, gate=gate, lower_bound=lower_bound)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    return dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, H, V), g=randn(B, T, H, K),
                beta=randn(B, T, H), A_log=small["A_log"].cuda(), dt_bias=small["dt_bias"].cuda(),
                initial_state=randn(B, H, K, V, dtype=torch.float32) * K ** -0.5, gate=gate,
                lower_bound=small["lower_bound"], scale=None, chunk_size=16)


def speed_rows(shapes, who_list, on_row, repeat: int = 1) -> None:
    """GPU time of each (who, shape); with ``repeat`` > 1 the whole sweep ``repeat`` times in
    turn (rows carry ``round``), so that the spread of one shape's time between rounds is
    seen beside the difference between who."""
    from common.fla_ref import fla_forward

    s12 = load_stage("12")
    fwds = {"12": ("12_softplus", s12.forward), "fla": ("FLA chunk_kda", fla_forward)}
    for rnd in range(repeat):
        for who, fwd in (fwds[w] for w in who_list):
            for shape in shapes:
                kw = gpu_inputs(**shape, gate="softplus")
                if who != "12_softplus":
                    kw["chunk_size"] = None  # FLA's own 64

                def f(kw=kw, fwd=fwd):
                    with torch.no_grad():
                        return fwd(**kw)

                on_row(timing_row("speed", who, shape, f, gate="softplus", **({"round": rnd} if repeat > 1 else {})))
                del kw


def bounded_rows(shapes, on_row) -> None:
    s11, s12 = load_stage("11"), load_stage("12")
    for shape in shapes:
        kw = gpu_inputs(**shape, gate="bounded", lower_bound=-5.0)
        with torch.no_grad():
            o11, S11 = s11.forward(**kw)
            with s12.u_halves(False):
                o12, S12 = s12.forward(**kw)
            with s12.pairwise(True):
                o_pw, S_pw = s12.forward(**kw)
        equal = bool(torch.equal(o11, o12) and torch.equal(S11, S12))
        diff = max(rel_err(o_pw, o11), rel_err(S_pw, S11))
        del o11, S11, o12, S12, o_pw, S_pw

        def f11(kw=kw):
            with torch.no_grad():
                return s11.forward(**kw)

        def f12(kw=kw):
            with torch.no_grad():
                return s12.forward(**kw)

        def f12pw(kw=kw):
            with torch.no_grad(), s12.pairwise(True):
                return s12.forward(**kw)

        on_row(timing_row("bounded", "11_varlen", shape, f11, gate="bounded"))
        on_row(timing_row("bounded", "12_softplus", shape, f12, gate="bounded", products="factored",
                          equal_to_11_without_u_halves=equal))
        on_row(timing_row("bounded", "12_softplus", shape, f12pw, gate="bounded", products="pairwise",
                          rel_diff_vs_11=diff))
        del kw


def u_rows(shapes, on_row) -> None:
    """Stage 12 with the softplus gate as it runs (u from Af in two bf16 halves) and with
    u_halves(False), at each shape on the same inputs: the second half's cost."""
    s12 = load_stage("12")
    for shape in shapes:
        kw = gpu_inputs(**shape, gate="softplus")
        with torch.no_grad():
            a = s12.forward(**kw)
            with s12.u_halves(False):
                b = s12.forward(**kw)
        diff = max(rel_err(a[0], b[0]), rel_err(a[1], b[1]))
        del a, b
        for halves in (True, False):
            def f(kw=kw, halves=halves):
                with torch.no_grad(), s12.u_halves(halves):
                    return s12.forward(**kw)

            on_row(timing_row("u", "12_softplus", shape, f, gate="softplus", u_halves=halves,
                              **({"rel_diff_vs_once": diff} if halves else {})))
        del kw


# K = 64 shapes whose K2 blocks fit on the SMs one each (the rule's 8-slot ring runs): the ring's shapes
RING_SHAPES = [dict(B=2, T=2048, H=4, K=64, V=64), dict(B=1, T=8192, H=4, K=64, V=64),
               dict(B=1, T=65536, H=4, K=64, V=64), dict(B=1, T=8192, H=16, K=64, V=64)]


def ring_rows(on_row, rounds: int = 3) -> None:
    """Stage 12 on the split path at K = 64 where the rule takes K2's 8-slot ring, as it runs and with
    deep_ring(False) (4 slots, stage 11's), both gates, ``rounds`` times in turn on the same inputs: what the
    deeper ring buys (the outputs must be bitwise equal: the depth changes no arithmetic)."""
    s12 = load_stage("12")
    for shape in RING_SHAPES:
        for gate in ("softplus", "bounded"):
            kw = gpu_inputs(**shape, gate=gate, lower_bound=-5.0 if gate == "bounded" else None)
            with torch.no_grad():
                a = s12.forward(**kw)
                with s12.deep_ring(False):
                    b = s12.forward(**kw)
            equal = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
            del a, b
            for rnd in range(rounds):
                for deep in (None, False):
                    def f(kw=kw, deep=deep):
                        with torch.no_grad(), s12.deep_ring(deep):
                            return s12.forward(**kw)

                    on_row(timing_row("ring", "12_softplus", shape, f, gate=gate, round=rnd,
                                      ring="rule" if deep is None else "4 slots", bitwise_equal=equal))
            del kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="results file (default $OUT/softplus.json)")
    ap.add_argument("--parts", default="accuracy,bounded,speed")
    ap.add_argument("--shapes", default=None, help="indices into the shape list (TC_GPU_SHAPES + Kimi's)")
    ap.add_argument("--who", default="12,fla", help="speed: whose rows (12, fla), in this order")
    ap.add_argument("--no-fla", action="store_true", help="accuracy without FLA's errors")
    ap.add_argument("--repeat", type=int, default=1, help="speed: the sweep this many times in turn")
    ap.add_argument("--segments", default="", help="paths: also the split paths at these segment lengths "
                                                   "(chunks, comma-separated; default: the stage's only)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_softplus.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from common.fla_ref import fla_available

    who = [w for w in args.who.split(",") if w]
    have_fla, why = fla_available()
    if not have_fla:
        say(f"FLA not available: {why}")
        who = [w for w in who if w != "fla"]
    fla = have_fla and not args.no_fla  # FLA's errors beside the accuracy rows
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    out = Path(args.out or Path(os.environ.get("OUT", "results")) / "softplus.json")
    meta = metadata(command="python scripts/bench_softplus.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    meta["what"] = ("stage 12 with the softplus gate beside FLA chunk_kda (softplus gate, safe_gate=False): "
                    "accuracy vs the fp64 loop on the softplus check cases, GPU time and peak memory; the "
                    "bounded gate factored / pairwise beside stage 11")
    rows: list[dict] = []

    def on_row(row):
        rows.append(row)
        save(out, rows, meta)  # after every row: a run cut short keeps what it measured

    for part in args.parts.split(","):
        if part == "accuracy":
            for r in accuracy_rows(fla):
                on_row(r)
        elif part == "bounded":
            bounded_rows(shapes, on_row)
        elif part == "speed":
            speed_rows(shapes, who, on_row, args.repeat)
        elif part == "paths":
            path_rows(shapes, on_row, [int(x) for x in args.segments.split(",") if x])
        elif part == "products":
            product_rows(shapes, on_row)
        elif part == "u":
            u_rows(shapes, on_row)
        elif part == "ring":
            ring_rows(on_row)
        else:
            ap.error(f"unknown part {part!r}: accuracy, bounded, speed, products, paths, u, ring")
    say(f"wrote {out}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
