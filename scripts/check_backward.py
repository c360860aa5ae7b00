"""The backward of a stage against the fp64 token loop's autograd, on the tensor-core check cases
of both gates and a few more that a backward's indexing could hide an error in (a sequence
shorter than a chunk, B > 1 with h0 and a tail at both head sizes). For each case and output: the
error against fp64 (common.checks.check_case: o and S also against the previous stage, which
must be bitwise where the stage declares it), against stage 04's fp32 backward on the same
inputs, and, with --fla, FLA's own error on the same inputs and the ratio of the two (FLA's
measure: RMS of the difference over RMS of the reference, common.metrics.rel_err). Also packed sequences
(cu_seqlens, one empty, one shorter than a chunk; the state in either layout) against each sequence alone.
Rows are saved after every case. (GPU.)

    python scripts/check_backward.py --stage 13 --quick --out $OUT/bwd_quick.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common import checks  # noqa: E402
from common.checks import Case  # noqa: E402
from common.inputs import make_cotangents  # noqa: E402
from common.metrics import rel_err  # noqa: E402
from common.results import metadata  # noqa: E402
from common.stages import load_stage  # noqa: E402

# Cases beyond the forward's: one sequence shorter than a chunk, B > 1 with h0 and a tail at both sizes.
EXTRA = [
    Case(2, 5, 3, 64, 64, chunk=16, gate="softplus", seed=51),
    Case(3, 45, 2, 128, 128, chunk=16, gate="bounded", lower_bound=-5.0, seed=52),
    Case(2, 33, 4, 64, 64, chunk=16, gate="bounded", lower_bound=-2.0, seed=53),
]


def cases(quick: bool):
    return EXTRA + checks.tc_cases(quick) + checks.tc_softplus_cases(quick)


def fla_rows(case: Case, names) -> dict:
    """FLA's error against fp64 on the case's inputs, per output."""
    from common.fla_ref import fla_forward
    from common.reference import kda_reference
    inp = checks.case_inputs(case, "cpu", torch.bfloat16)
    cot = make_cotangents((case.B, case.T, case.H, case.V), (case.B, case.H, case.K, case.V), seed=case.seed)
    fla = checks.run(fla_forward, inp, "cuda", backward=True, cotangents=cot)
    ref = checks.run(kda_reference, inp, "cuda", backward=True, cotangents=cot, dtype=torch.float64)
    scales = checks.reduction_scales(inp, cot)
    return {n: checks._err(fla[n], ref[n], scales.get(n)) for n in names if fla.get(n) is not None
            and ref.get(n) is not None}


def vs_stage(stage, other, case: Case) -> dict:
    """Each gradient of ``stage`` against ``other``'s backward on the same inputs (plain rel_err)."""
    inp = checks.case_inputs(case, "cpu", torch.bfloat16)
    cot = make_cotangents((case.B, case.T, case.H, case.V), (case.B, case.H, case.K, case.V), seed=case.seed)
    a = checks.run(stage.forward, inp, "cuda", backward=True, cotangents=cot)
    b = checks.run(other.forward, inp, "cuda", backward=True, cotangents=cot)
    return {n: rel_err(a[n], b[n]) for n in a if n.startswith("d") and a[n] is not None and b.get(n) is not None}


KERNEL_CASES = [Case(2, 37, 3, 64, 64, chunk=16, gate="softplus", seed=61),
                Case(1, 50, 2, 128, 128, chunk=16, gate="bounded", lower_bound=-5.0, seed=62)]


def kernel_rows(stage, case: Case) -> dict:
    """Each backward kernel's output against common/backward_model.py on the same (bf16) inputs, in fp64:
    B1's operands, B2's entry states and vcorr, B3's exit gradients and dvcorr (rel_err over the real chunks)."""
    from common import backward_model as bm
    from common.contract import prepare
    from common.reference import activate
    inp = checks.case_inputs(case, "cpu", torch.bfloat16)
    do, dht = make_cotangents((case.B, case.T, case.H, case.V), (case.B, case.H, case.K, case.V), seed=case.seed)
    c = prepare(stage.SPEC, **{n: (x.cuda() if torch.is_tensor(x) else x) for n, x in inp.items()})
    # the stage's "exact" build where it has one (its own takes the chains on bf16 MMAs and stores the states in
    # bf16): each kernel's output then carries fp32 round-off only, and a wrong element cannot hide in bf16's rounding
    variants = getattr(stage, "BACKWARD_VARIANTS", {})
    ext = stage.build(variant="exact") if "exact" in variants else stage.build()
    ws = ext.bwd_workspace(c.q, c.k, c.v, c.g, c.beta, c.A_log, c.dt_bias, c.initial_state, c.scale,
                                     c.gate_id, c.lower_bound, do.cuda(), dht.cuda())
    names = ("qd", "kr", "w", "u", "Aqk", "el", "states", "dstates", "vcorr", "dvcorr")
    ws = {n: t.double().cpu() for n, t in zip(names, ws)}
    f64 = {n: (x.double() if torch.is_tensor(x) else x) for n, x in inp.items()}
    qn, kn, b, a = activate(f64["q"], f64["k"], f64["g"], f64["beta"], f64["A_log"], f64["dt_bias"], gate=case.gate,
                            lower_bound=case.lower_bound)
    B, T, H, K = qn.shape
    NT = -(-T // 16)
    ops = [bm.chunk_operands(qn, kn, f64["v"], b, a, scale=c.scale, t0=s0, t1=min(s0 + 16, T))
           for s0 in range(0, T, 16)]
    S = f64["initial_state"] if f64["initial_state"] is not None else qn.new_zeros(B, H, K, K)
    want = {n: [] for n in names}
    for n, op in enumerate(ops):
        vc, _, S_out = bm.step(op, S)
        want["states"].append(S)
        want["vcorr"].append(vc)
        S = S_out
    dS = dht.double()
    dos = [do.double()[:, s0:min(s0 + 16, T)].transpose(1, 2) for s0 in range(0, T, 16)]
    rev = [None] * NT
    for n in range(NT - 1, -1, -1):
        dvc, dS_in = bm.reverse_step(ops[n], dS, dos[n])
        rev[n] = (dS, dvc)
        dS = dS_in
    out = {}
    for name in names:
        got = ws[name].reshape(B, H, NT, *ws[name].shape[1:])
        errs = []
        for n, op in enumerate(ops):
            m = op["q"].shape[2]  # real tokens of chunk n
            if name in ("states",):
                ref = want["states"][n]
            elif name == "vcorr":
                ref = want["vcorr"][n]
            elif name == "dstates":
                ref = rev[n][0]
            elif name == "dvcorr":
                ref = rev[n][1]
            elif name == "el":
                ref = torch.exp(op["glast"])
            elif name == "Aqk":
                ref = op["Aqk"]
            else:
                ref = op[name]
            g = got[:, :, n]
            if name in ("qd", "kr", "w", "u", "vcorr", "dvcorr"):
                g = g[:, :, :m]
            elif name == "Aqk":
                g = g[:, :, :m, :m]
            errs.append(rel_err(g, ref))
        out[name] = max(errs)
    return out


def packed_rows(stage, gate: str, lb=None, lens=(7, 0, 20, 33, 300), H=2, K=64, v_first=False) -> dict:
    """Packed sequences (cu_seqlens) through the stage's autograd on the GPU, each with its own h0, against
    autograd through the fp64 token loop on each sequence alone: rel_err per gradient."""
    from common.inputs import make_inputs
    from common.reference import kda_reference
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    N, T = len(lens), sum(lens)
    kw = make_inputs(1, T, H, K, K, seed=9, dtype=torch.bfloat16, gate=gate, lower_bound=lb, h0=False, chunk_size=16)
    kw["initial_state"] = torch.randn(N, H, K, K, generator=torch.Generator().manual_seed(10)) / 8
    do, dht = make_cotangents((1, T, H, K), (N, H, K, K), seed=11)
    dev = {n: kw[n].cuda().requires_grad_() for n in names}
    h0 = dev["initial_state"].transpose(-1, -2) if v_first else dev["initial_state"]
    o, S = stage.forward(*(dev[n] for n in ("q", "k", "v", "g", "beta")), A_log=dev["A_log"], dt_bias=dev["dt_bias"],
                         initial_state=h0, gate=gate, lower_bound=lb, cu_seqlens=cu.cuda(), state_v_first=v_first)
    S = S.transpose(-1, -2) if v_first else S
    torch.autograd.backward((o, S), (do.cuda().to(o.dtype), dht.cuda()))
    ref = {n: kw[n].double().requires_grad_() for n in names}
    loss = 0.0
    for i in range(N):
        s0, s1 = int(cu[i]), int(cu[i + 1])
        if s1 == s0:
            loss = loss + (ref["initial_state"][i:i + 1] * dht[i:i + 1].double()).sum()
            continue
        oi, Si = kda_reference(**{n: ref[n][:, s0:s1] for n in ("q", "k", "v", "g", "beta")}, A_log=ref["A_log"],
                               dt_bias=ref["dt_bias"], initial_state=ref["initial_state"][i:i + 1], gate=gate,
                               lower_bound=lb, scale=K ** -0.5)
        loss = loss + (oi * do[:, s0:s1].double()).sum() + (Si * dht[i:i + 1].double()).sum()
    loss.backward()
    return {"d" + n: rel_err(dev[n].grad, ref[n].grad) for n in names}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", default="13")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fla", action="store_true", help="FLA's error on each case too (its Triton backward compiles first)")
    ap.add_argument("--no-04", action="store_true", help="skip the comparison with stage 04's fp32 backward")
    ap.add_argument("--kernels", action="store_true", help="first, each kernel's output against the model")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    stage = load_stage(args.stage)
    s04 = None if args.no_04 else load_stage("04")
    out = Path(args.out)
    rec = dict(meta=metadata(), stage=stage.SPEC.name, rows=[], fla={}, vs04={}, errors={})
    t0 = time.time()
    if args.kernels:
        rec["kernels"] = {}
        for case in KERNEL_CASES:
            try:
                rec["kernels"][case.id] = kernel_rows(stage, case)
                print(f"kernels {case.id}: " + ", ".join(f"{n} {e:.1e}" for n, e in rec["kernels"][case.id].items()),
                      flush=True)
            except Exception as e:  # noqa: BLE001
                rec["errors"]["kernels " + case.id] = f"{type(e).__name__}: {e}"
                print(f"kernels {case.id}: {type(e).__name__}: {e}", flush=True)
        out.write_text(json.dumps(rec, indent=1, default=str))
    rec["packed"] = {}
    for gate, lb, vf in (("softplus", None, False), ("bounded", -3.0, True)):
        key = f"{gate}{'' if lb is None else lb}{'-vfirst' if vf else ''}"
        try:
            rec["packed"][key] = packed_rows(stage, gate, lb, v_first=vf)
            print(f"packed {key}: " + ", ".join(f"{n} {e:.1e}" for n, e in rec["packed"][key].items()), flush=True)
        except Exception as e:  # noqa: BLE001
            rec["errors"]["packed " + key] = f"{type(e).__name__}: {e}"
            print(f"packed {key}: {type(e).__name__}: {e}", flush=True)
    for case in cases(args.quick):
        try:
            rows = checks.check_case(stage, case, backward=True)
            rec["rows"] += rows
            bad = [r["output"] for r in rows if not r["ok"]]
            worst = max((r["err_ref"] for r in rows if r["output"].startswith("d")), default=None)
            print(f"[{time.time() - t0:6.1f} s] {case.id}: worst gradient {worst:.2e}; not ok: {bad}", flush=True)
            if s04 is not None and not case.extreme:
                rec["vs04"][case.id] = vs_stage(stage, s04, case)
            if args.fla:
                rec["fla"][case.id] = fla_rows(case, [r["output"] for r in rows])
        except Exception as e:  # noqa: BLE001  (recorded, and the next case runs)
            rec["errors"][case.id] = f"{type(e).__name__}: {e}"
            print(f"{case.id}: {type(e).__name__}: {e}", flush=True)
        out.write_text(json.dumps(rec, indent=1, default=str))
    print(f"done in {time.time() - t0:.0f} s: {sum(not r['ok'] for r in rec['rows'])} rows not ok, "
          f"{len(rec['errors'])} errors", flush=True)


if __name__ == "__main__":
    main()
