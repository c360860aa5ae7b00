"""Packed sequences on the H200, in one call: stage 11 (or --stage 11,12) with cu_seqlens beside
FlashKDA's varlen call and FLA's chunk_kda varlen (--fla), at FlashKDA's varlen
shape (lengths 1300, 547, 2048, 963, 271, 3063 at H = 96) and three more mixes (a
serving batch of 64 sequences of 64-2048 tokens at H = 32; 48 short sequences
and one of 8192 tokens, last, at H = 32; 60 sequences of 128-1024 tokens and four
of 4096 among them at H = 32), K = V = 128, bounded gate (lower bound -5), an
initial state per sequence. Also the old way at the first mix: stage 10 called
once per sequence in a Python loop (the cost the idea removes). With --paths,
each stage's V-first call again on each pinned path (what the rule's choice is
worth at each mix): a path's name, or long_from=N (the rule's path with the
hybrid's threshold pinned to N tokens; 0: no hybrid).

    python scripts/bench_varlen.py [--fla] [--out $OUT/varlen.json] [--mixes flashkda,serving64,long+short]
                                   [--budget 1.0] [--no-ref] [--loop-all] [--stage 11,12]
                                   [--paths split2,fused8,long_from=0,long_from=2048]

Per row (results/h200 schema, common.results.save): mix, lengths, N, T, H, K, V,
impl (the stage's name with its state layout, "FlashKDA", "FLA chunk_kda", or
the per-sequence loop), gpu_ms (CUDA-graph replay; None where the call cannot be
captured, with graph_error), call_ms (plain calls timed with CUDA events), both
medians after a warm-up (common.bench._timed), peak_mb (common.bench.peak_mb).
The stage's forward validates cu_seqlens on a CPU copy, which a CUDA graph cannot
capture: its gpu_ms is the replay of its call validated once (prepare, then
extrun.run; call_ms_prepared its plain time), as FlashKDA's call is converted
once, and its call_ms the whole forward as a user calls it. Also
vs_flashkda (time over FlashKDA's, GPU time where both have it), and errors of o
and the final state against FlashKDA's (o_vs_flashkda, S_vs_flashkda) and the
fp64 token loop run sequence by sequence (o_err_ref, S_err_ref;
common.checks.kda_reference_varlen on the GPU; --no-ref skips it). Stage 11 in
FlashKDA's layout (V-first states) carries meets_target: GPU time at most 0.8 x
FlashKDA's (issue 20).

Every row is written to --out as it comes. FLA is timed last (a fresh machine
autotunes its kernels for minutes); FlashKDA's own backend in FLA is switched
off (FLA_FLASH_KDA=0) so that its rows are FLA's Triton kernels. Needs a GPU,
stages 10 and 11 built, and FlashKDA built (scripts/build_flashkda.py; rows
without it carry the reason).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common import bench, checks  # noqa: E402
from common.checks import VarlenCase, random_lengths  # noqa: E402
from common.fla_ref import FLASHKDA_NAME, fla_available, flashkda_available, flashkda_varlen_call  # noqa: E402
from common.results import metadata, save  # noqa: E402

def _few_long() -> tuple:
    """60 sequences of 128-1024 tokens with four of 4096 among them (after the 5th, 20th, 35th
    and 50th): long prompts scattered through a serving batch."""
    short = list(random_lengths(60, 128, 1024, seed=3))
    for at in (50, 35, 20, 5):
        short.insert(at, 4096)
    return tuple(short)


# The mixes timed, in order: FlashKDA's varlen test shape first (the old way is timed there).
MIXES = {
    "flashkda": VarlenCase(checks.FLASHKDA_VARLEN_LENGTHS, H=96, K=128, V=128, seed=0, name="flashkda"),
    "serving64": VarlenCase(random_lengths(64, 64, 2048, seed=1), H=32, K=128, V=128, seed=1, name="serving64"),
    "long+short": VarlenCase(random_lengths(48, 16, 512, seed=2) + (8192,), H=32, K=128, V=128, seed=2,
                             name="long+short"),
    "few-long": VarlenCase(_few_long(), H=32, K=128, V=128, seed=3, name="few-long"),
}
MIXES = {k: VarlenCase(c.lengths, H=c.H, K=c.K, V=c.V, h0=True, state_v_first=True, lower_bound=-5.0,
                       cu_dtype="int64", seed=c.seed, name=c.name) for k, c in MIXES.items()}
TARGET_VS_FLASHKDA = 0.8  # issue 20: stage 11's GPU time at most 0.8 x FlashKDA's varlen time
FLA_NAME = "FLA chunk_kda"


def stage_name(sid: str) -> str:
    from common.stages import load_stage

    return load_stage(sid).SPEC.name


def spans(case: VarlenCase):
    b = case.bounds()
    return [(b[n], b[n + 1]) for n in range(case.N)]


def err(x, ref) -> float | None:
    """Relative L2 error on the GPU (common.bench._gpu_rel_err), inf on a shape mismatch."""
    if x is None or ref is None:
        return None
    if tuple(x.shape) != tuple(ref.shape):
        return math.inf
    return bench._gpu_rel_err(x, ref)


def timed(fn, budget: float, peak_fn=None) -> dict:
    """call_ms / gpu_ms (medians after a warm-up, common.bench._timed) and peak_mb of one call
    (of ``peak_fn`` where given: a call that allocates its outputs)."""
    t = bench._timed(fn, "cuda", budget, True)
    out = dict(call_ms=t.get("ms"), call_min_ms=t.get("min_ms"), gpu_ms=t.get("graph_ms"),
               gpu_min_ms=t.get("graph_min_ms"), reps=t.get("reps"))
    for k in ("graph_error", "graph_note", "note"):
        if k in t:
            out[k] = t[k]
    out["peak_mb"] = round(bench.peak_mb(peak_fn or fn), 1)
    return out


def prepared_call(stage, kw: dict):
    """The stage's call with its arguments validated and converted once (common.contract.prepare:
    the CPU copy of cu_seqlens happens here, not in the call), the path its rule picks: what a
    CUDA graph can capture. Each call allocates its outputs, as the stage's forward does."""
    from common import extrun
    from common.contract import prepare

    c = prepare(stage.SPEC, **kw)
    ext = stage.build()
    pin = stage._path_args(c.V) if hasattr(stage, "_path_args") else None

    def call():
        with torch.no_grad():
            return extrun.run(ext, stage.SPEC, c, path=pin)

    return call


def inputs(case: VarlenCase) -> dict:
    """The packed call on the GPU (bf16, V-first states, cu_seqlens int64), seeded."""
    return checks.varlen_inputs(case, "cuda", torch.bfloat16)


def kfirst(inp: dict) -> dict:
    h0 = inp["initial_state"]
    return dict(inp, initial_state=None if h0 is None else h0.transpose(-1, -2).contiguous(), state_v_first=False)


def with_ratio(row: dict, fk: dict | None) -> dict:
    """vs_flashkda: the row's GPU time over FlashKDA's (call time where either has no GPU time)."""
    if fk is None or row.get("error"):
        return row
    if row.get("gpu_ms") and fk.get("gpu_ms"):
        row["vs_flashkda"], row["vs_flashkda_of"] = row["gpu_ms"] / fk["gpu_ms"], "gpu_ms"
    elif row.get("call_ms") and fk.get("call_ms"):
        row["vs_flashkda"], row["vs_flashkda_of"] = row["call_ms"] / fk["call_ms"], "call_ms"
    return row


def errors(o, S_vfirst, ref: dict) -> dict:
    """o and the final state (V-first) against FlashKDA's and the fp64 reference's, where present."""
    out = {}
    if ref.get("fk") is not None:
        out["o_vs_flashkda"], out["S_vs_flashkda"] = err(o, ref["fk"][0]), err(S_vfirst, ref["fk"][1])
    if ref.get("ref") is not None:
        out["o_err_ref"], out["S_err_ref"] = err(o, ref["ref"][0]), err(S_vfirst, ref["ref"][1])
    return out


def old_way(case: VarlenCase, inp: dict, sid: str = "10"):
    """Stage ``sid`` called once per sequence in a Python loop (K-first states), the outputs
    gathered into one o [1, T, H, V] and the final states [N, H, V, K], as a caller without
    cu_seqlens must."""
    from common.stages import load_stage

    fwd = load_stage(sid).forward
    kw = kfirst(inp)
    h0 = kw.pop("initial_state")
    for n in ("cu_seqlens", "state_v_first"):
        kw.pop(n)
    sp = spans(case)

    def f():
        with torch.no_grad():
            os_, ss = [], []
            for n, (s, e) in enumerate(sp):
                part = {x: (kw[x][:, s:e] if x in ("q", "k", "v", "g", "beta") else kw[x]) for x in kw}
                o, S = fwd(**part, initial_state=None if h0 is None else h0[n:n + 1])
                os_.append(o)
                ss.append(S)
            return torch.cat(os_, dim=1), torch.cat(ss, dim=0).transpose(-1, -2)

    return f


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp/kdalab-out")) / "varlen.json"))
    p.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, of {', '.join(MIXES)}")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per row")
    p.add_argument("--fla", action="store_true", help="FLA's chunk_kda varlen too (last)")
    p.add_argument("--no-ref", action="store_true", help="skip the fp64 reference (errors against FlashKDA only)")
    p.add_argument("--loop-all", action="store_true", help="the per-sequence loop at every mix, not only the first")
    p.add_argument("--stage", default="11", help="the packed-sequence stages, comma-separated (default 11)")
    p.add_argument("--paths", default="", help="also each of these pinned paths (e.g. split2,fused8) or hybrid "
                   "thresholds (long_from=N tokens, 0: none), V-first")
    p.add_argument("--old", default="10", help="the stage called once per sequence (default 10)")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.mixes.split(",") if m.strip()]
    bad = [m for m in names if m not in MIXES]
    if bad:
        p.error(f"unknown mix {bad[0]!r}: mixes are {', '.join(MIXES)}")
    if not torch.cuda.is_available():
        print("bench_varlen: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    os.environ["FLA_FLASH_KDA"] = "0"  # FLA's rows are FLA's own kernels, never its FlashKDA backend
    from common.stages import load_stage

    stages = [load_stage(sid) for sid in args.stage.split(",") if sid.strip()]
    pins = [x for x in args.paths.split(",") if x.strip()]
    oname = stage_name(args.old)
    fk_ok, fk_why = flashkda_available()
    fla_ok, fla_why = fla_available() if args.fla else (False, "not asked (--fla)")
    print(f"FlashKDA: {'importable' if fk_ok else fk_why}; FLA: {'importable' if fla_ok else fla_why}", flush=True)
    cmd = "python scripts/bench_varlen.py" + (" --fla" if args.fla else "") + (" --no-ref" if args.no_ref else "") \
        + ("" if names == list(MIXES) else f" --mixes {','.join(names)}") + (" --loop-all" if args.loop_all else "") \
        + ("" if args.stage == "11" else f" --stage {args.stage}") + (f" --paths {args.paths}" if pins else "")
    meta = metadata(command=cmd)
    meta.update(target_vs_flashkda=TARGET_VS_FLASHKDA, budget_s=args.budget, gate="bounded", lower_bound=-5.0,
                mixes={m: dict(lengths=list(MIXES[m].lengths), H=MIXES[m].H, K=MIXES[m].K, V=MIXES[m].V)
                       for m in names})
    rows: list[dict] = []
    refs: dict = {}  # per mix: FlashKDA's and the reference's outputs (o, S V-first), for the FLA rows at the end
    fk_rows: dict = {}
    out = Path(args.out)

    def add(row):
        rows.append(row)
        save(out, rows, meta)
        ms = row.get("gpu_ms") or row.get("call_ms")
        r = row.get("vs_flashkda")
        print(f"{row['mix']:11s} {row['impl']:34s} " + (f"gpu {ms:.4f} ms" if ms else f"ERROR {row.get('error')}")
              + (f" call {row['call_ms']:.4f} ms" if row.get("call_ms") else "")
              + (f" x{r:.3f} FlashKDA" if r else "") + f" peak {row.get('peak_mb')} MB"
              + "".join(f" {k} {row[k]:.2e}" for k in ("o_vs_flashkda", "S_vs_flashkda", "o_err_ref", "S_err_ref")
                        if row.get(k) is not None), flush=True)

    def base(mix, case, impl):
        return dict(mix=mix, lengths=list(case.lengths), N=case.N, T=case.T, H=case.H, K=case.K, V=case.V,
                    impl=impl)

    for i, mix in enumerate(names):
        case, t0 = MIXES[mix], time.time()
        inp = inputs(case)
        ref: dict = {}
        # outputs first, each call on its own copy of the initial states (nothing timed has run yet)
        if not args.no_ref:
            try:
                r = checks.run_varlen(checks.kda_reference_varlen, inp, "cuda", dtype=torch.float64)
                ref["ref"] = (r["o"].float(), r["S"].float())
                del r
                print(f"{mix}: fp64 reference in {time.time() - t0:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 -- out of memory: go on with FlashKDA's outputs only
                print(f"{mix}: no fp64 reference ({type(e).__name__}: {str(e).splitlines()[0][:200]})", flush=True)
            torch.cuda.empty_cache()
        if fk_ok:
            try:
                call, o, S = flashkda_varlen_call(**dict(inp, initial_state=inp["initial_state"].clone()))
                call()
                torch.cuda.synchronize()
                ref["fk"] = (o.clone(), S.clone())
                del call, o, S
            except Exception as e:  # noqa: BLE001
                fk_why = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        refs[mix] = ref

        # FlashKDA: its own call (states [N, H, V, K], cu_seqlens int64), converted once
        row = base(mix, case, FLASHKDA_NAME)
        try:
            if "fk" not in ref:
                raise RuntimeError(fk_why)
            own = dict(inp, initial_state=inp["initial_state"].clone())  # its own states: the stage's stay as drawn
            call, _, _ = flashkda_varlen_call(**own)

            def alloc_and_call():  # peak memory with its output buffers allocated inside, as path_rows measures
                c, o, S = flashkda_varlen_call(**own)
                c()
                return o, S

            row.update(timed(call, args.budget, peak_fn=alloc_and_call))
            if "ref" in ref:
                row["o_err_ref"], row["S_err_ref"] = err(ref["fk"][0], ref["ref"][0]), err(ref["fk"][1], ref["ref"][1])
            del call
        except Exception as e:  # noqa: BLE001
            row["error"] = str(e).splitlines()[0][:300]
        fk = fk_rows[mix] = row if not row.get("error") else None
        add(row)
        torch.cuda.empty_cache()

        # each stage with cu_seqlens: FlashKDA's layout (V-first states) and the K-first one; then the
        # V-first call on each pinned path (--paths), which shows what the rule's choice is worth
        for stage in stages:
            sname = stage.SPEC.name
            runs = [(True, None), (False, None)] + [(True, pn) for pn in pins
                                                    if pn in getattr(stage, "PATHS", {}) or pn.startswith("long_from=")]
            for vfirst, pin in runs:
                impl = f"{sname} ({'V-first' if vfirst else 'K-first'} state)" + (f" {pin}" if pin else "")
                row = base(mix, case, impl)
                row.update(stage=sname, state_v_first=vfirst, path=pin or "rule")
                try:
                    kw = inp if vfirst else kfirst(inp)

                    def pinned(stage=stage, pin=pin):  # a fresh context each time (one use each)
                        if pin and pin.startswith("long_from="):
                            return stage.path(long_from=int(pin.split("=", 1)[1]))
                        return stage.path(pin) if pin else contextlib.nullcontext()

                    def f(kw=kw, stage=stage, pinned=pinned):
                        with torch.no_grad(), pinned():
                            return stage.forward(**kw)

                    o, S = f()
                    row.update(errors(o, S if vfirst else S.transpose(-1, -2), ref))
                    del o, S
                    # GPU time: the call validated once (its CPU copy of cu_seqlens cannot be captured in a
                    # graph), as FlashKDA's call is converted once; call time: the whole forward, as a user
                    # calls it
                    with pinned():
                        call = prepared_call(stage, kw)
                    row.update(timed(call, args.budget, peak_fn=f))
                    row["call_ms_prepared"], row["call_ms"] = row["call_ms"], bench._timed(f, "cuda", args.budget,
                                                                                           False)["ms"]
                    row["gpu_ms_of"] = "the call validated once (common.contract.prepare, then extrun.run)"
                    with_ratio(row, fk)
                    if vfirst and not pin and row.get("vs_flashkda_of") == "gpu_ms":
                        row["target"] = TARGET_VS_FLASHKDA
                        row["meets_target"] = row["vs_flashkda"] <= TARGET_VS_FLASHKDA
                except Exception as e:  # noqa: BLE001
                    row["error"] = str(e).splitlines()[0][:300]
                add(row)
                torch.cuda.empty_cache()

        # the old way: one call per sequence of the previous stage, in a Python loop
        if i == 0 or args.loop_all:
            row = base(mix, case, f"{oname} once per sequence ({case.N} calls)")
            row.update(stage=oname, per_sequence_loop=True)
            try:
                f = old_way(case, inp, args.old)
                o, S = f()
                row.update(errors(o, S, ref))
                del o, S
                row.update(timed(f, args.budget))
                with_ratio(row, fk)
            except Exception as e:  # noqa: BLE001
                row["error"] = str(e).splitlines()[0][:300]
            add(row)
        del inp
        torch.cuda.empty_cache()

    # FLA last: its Triton kernels autotune on first use of each head count
    if args.fla:
        for mix in names:
            case = MIXES[mix]
            row = base(mix, case, f"{FLA_NAME} (safe gate, K-first state)")
            try:
                if not fla_ok:
                    raise RuntimeError(fla_why)
                from fla.ops.kda import chunk_kda

                kw = kfirst(inputs(case))
                cu = kw["cu_seqlens"].to(torch.int64)
                cu_cpu = cu.cpu()

                def f(kw=kw, cu=cu, cu_cpu=cu_cpu):
                    with torch.no_grad():
                        return chunk_kda(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scale=kw["scale"],
                                         initial_state=kw["initial_state"], output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                         use_beta_sigmoid_in_kernel=True, safe_gate=True,
                                         lower_bound=kw["lower_bound"], A_log=kw["A_log"],
                                         dt_bias=kw["dt_bias"].reshape(-1), cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)

                t0 = time.time()
                o, S = f()
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.time() - t0, 1)  # autotuning on a fresh machine
                row.update(errors(o, S.transpose(-1, -2), refs.get(mix, {})))
                del o, S
                row.update(timed(f, args.budget))
                with_ratio(row, fk_rows.get(mix))
            except Exception as e:  # noqa: BLE001
                row["error"] = str(e).splitlines()[0][:300]
            add(row)
            torch.cuda.empty_cache()

    print("\n| mix | impl | gpu ms | call ms | x FlashKDA | o vs FlashKDA | S vs FlashKDA | o vs fp64 | S vs fp64 |")
    print("|---|---|---|---|---|---|---|---|---|")

    def f_(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        print(f"| {r['mix']} | {r['impl']} | {f_(r.get('gpu_ms'), '.4f')} | {f_(r.get('call_ms'), '.4f')} | "
              f"{f_(r.get('vs_flashkda'), '.3f')} | {f_(r.get('o_vs_flashkda'), '.2e')} | "
              f"{f_(r.get('S_vs_flashkda'), '.2e')} | {f_(r.get('o_err_ref'), '.2e')} | "
              f"{f_(r.get('S_err_ref'), '.2e')} |")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
