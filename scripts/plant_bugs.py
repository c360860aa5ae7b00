"""Plant bugs in the checking code and in stages 00-01, one at a time, and see
whether the tests catch each (mutation testing of the checks; CPU only).

    python scripts/plant_bugs.py                 # every mutation, the fast CPU tests
    python scripts/plant_bugs.py --only "forced to ok" --tests tests/test_metrics.py

Each mutation replaces one exact piece of source text (it must occur exactly
once), runs the tests, and restores the file, also when interrupted. A
mutation is "caught" when the tests fail. Writes a JSON report when --out is
given. Run it from a clean working tree: it edits files in place (so that the
compiled stages' builds are reused) and restores them afterwards. A mutation
of stage 01's C++ is compiled by the tests (ninja rebuilds the edited file),
and counts only if an extension was rebuilt during its run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (file, text, replacement[, tests]): the planted bugs of issue 10 and a few more. ``tests``, where
# given, are the tests run for that plant instead of FAST_TESTS (a subset of the suite: caught there is
# caught by the suite).
MUTATIONS = {
    "checks: verdict forced to ok": (
        "common/checks.py", "    return dict(row, tol=tol, ok=bool(ok))", "    return dict(row, tol=tol, ok=True)"),
    "checks: error function returns 0": (
        "common/checks.py", '    r = rel_err(x, ref)\n    if scale is None or r == math.inf:\n        return r',
        "    return 0.0"),
    "checks: error function returns 0 for finite errors (keeps NaN)": (
        "common/checks.py", '    r = rel_err(x, ref)\n    if scale is None or r == math.inf:\n        return r',
        "    r = rel_err(x, ref)\n    return r if r == math.inf else 0.0"),
    "checks: no comparison with the previous stage": (
        "common/checks.py", "prev = previous_for(stage, case) if against_prev else None", "prev = None"),
    "checks: outputs not poisoned": (
        "common/checks.py", "with poisoned(), torch.set_grad_enabled(backward):", "with torch.set_grad_enabled(backward):"),
    "checks: check_deterministic always true": (
        "common/checks.py", 'return all(torch.equal(a[n], b[n]) for n in ("o", "S"))', "return True"),
    "checks: summary max drops NaN": (
        "common/checks.py", 'w["err_ref"] = worst([w["err_ref"], r["err_ref"]])',
        'w["err_ref"] = max(w["err_ref"] or 0.0, r["err_ref"])'),
    "checks: a missing profile region passes": (
        "common/checks.py", 'problems = [f"missing region {n!r}" for n in expected if n not in prof]', "problems = []"),
    "metrics: rel_err returns 0 for finite inputs": (
        "common/metrics.py", "    return num / den\n", "    return 0.0\n"),
    "metrics: zero reference reported as 0": (
        "common/metrics.py", "    if den == 0.0:\n        return math.inf", "    if den == 0.0:\n        return num"),
    "metrics: NaN reference passes": (
        "common/metrics.py", "if not torch.isfinite(x64).all() or not torch.isfinite(r64).all():",
        "if not torch.isfinite(x64).all():"),
    "metrics: fp32 tolerance 1e-5 -> 1e-1": (
        "common/metrics.py", '"fp32": 1e-5,', '"fp32": 1e-1,'),
    "contract: no .contiguous()": (
        "common/contract.py", "return x.to(dtype).contiguous()", "return x.to(dtype)"),
    "contract: no equal_kv check": (
        "common/contract.py", "if spec.equal_kv and K != V:", "if False:"),
    "contract: no head_dims check": (
        "common/contract.py", "if K not in spec.head_dims:", "if False:"),
    "contract: no mixed-device check": (
        "common/contract.py", "if x is not None and x.device != dev:", "if False:"),
    "contract: no B/T/H >= 1 check": (
        "common/contract.py", "if min(B, T, H) < 1:", "if False:"),
    "contract: lower_bound range unchecked": (
        "common/contract.py", "if not (-5.0 <= lb < 0.0):", "if False:"),
    "nbcheck: a cell without its figure passes": (
        "common/nbcheck.py", "if draws(source) and not has_image(outputs):", "if False:"),
    "stage 00: dense matmul spreads NaN backwards in time": (
        "stages/00_naive/stage.py", "_causal_matmul(Aqk[:, :, n], vcorr)", "Aqk[:, :, n] @ vcorr"),
    "stage 00: a timer on the forward path": (
        "stages/00_naive/stage.py", "clock = clock or _NO_CLOCK", "clock = clock or _Clock(c.device)"),
    # issue 22: what got through the tests before
    "checks: err_prev only for o and S": (
        "common/checks.py", "if pres is not None and pres.get(name) is not None:",
        'if pres is not None and name in ("o", "S"):'),
    "checks: gradients compared with the reference, not the previous stage": (
        "common/checks.py", "p = math.inf if x is None else _err(x, pres[name], sc)",
        'p = math.inf if x is None else _err(x, (pres if name in ("o", "S") else ref)[name], sc)'),
    "checks: pass/fail at 5x the tolerance": (
        "common/checks.py", '    tol = spec.tol(row["output"])', '    tol = 5 * spec.tol(row["output"])'),
    "checks: pass/fail at 9x the tolerance": (
        "common/checks.py", '    tol = spec.tol(row["output"])', '    tol = 9 * spec.tol(row["output"])'),
    "checks: quick CPU set without B > 1 and h0": (
        "common/checks.py", "return [cases[0], cases[1], cases[4]] if quick else cases",
        "return cases[:2] if quick else cases"),
    "extrun: final state allocated with torch.empty": (
        "common/extrun.py", "ht = alloc(c.state_shape, torch.float32, dev)",
        "ht = torch.empty(c.state_shape, dtype=torch.float32, device=dev)"),
    "extrun: no compiled output or gradient poisoned (torch.empty)": (
        "common/extrun.py", "from .contract import Call, StageSpec, alloc",
        'from .contract import Call, StageSpec\n\n\ndef alloc(shape, dtype=torch.float32, device="cpu"):\n'
        "    return torch.empty(tuple(shape), dtype=dtype, device=device)"),
    "contract: every stage run at its default chunk": (
        "common/contract.py", "lower_bound=lb, chunk_size=chunk_size,",
        "lower_bound=lb, chunk_size=spec.default_chunk,"),
    "contract: device unchecked": (
        "common/contract.py", "if x.device.type not in spec.devices:", "if False:"),
    "reference: lower_bound ignored": (
        "common/reference.py", "return lb * torch.sigmoid(A * x)", "return -5.0 * torch.sigmoid(A * x)"),
    # issue 35: what got through the tests before
    "reference: l2 epsilon 1e-6 -> 1e-5": (
        "common/reference.py", "L2_EPS = 1e-6", "L2_EPS = 1e-5"),
    "stage 00: the gate sum in float32": (
        "stages/00_naive/stage.py", "gc = a.double().cumsum(dim=-2)", "gc = a.cumsum(dim=-2)"),
    "stage 00: o off by 2x its own tolerance (1 + 1.6e-6)": (
        "stages/00_naive/stage.py", "return o.to(c.out_dtype), (S if c.output_final_state else None)",
        "return (o * (1 + 1.6e-6)).to(c.out_dtype), (S if c.output_final_state else None)"),
    "notebook: a check cell that only prints": (
        "common/notebook.py", '    fail_if(bad, f"checks of {spec.name}")\n', "", ["tests/test_tree_under_test.py", "tests/test_notebooks.py", "-k", "not nbval"]),
    "notebook: a check cell of another stage passes": (
        "common/notebook.py", "    if mine is not None and sid != mine:", "    if False:", ["tests/test_notebooks.py", "-k", "not nbval"]),
    "nbcheck: the kernel imports the installed checkout": (
        "common/nbcheck.py", '        env["PYTHONPATH"] = os.pathsep.join(', '        env["UNUSED"] = os.pathsep.join(', ["tests/test_tree_under_test.py"]),
    "checks: a stage that declares its bits may differ from them": (
        "common/checks.py", "        ok = p == 0.0", "        ok = True"),
    "stages: the fp32 tolerances at the regime's 1e-5": (
        "common/contract.py", "            return float(self.tolerance[output])", "            return 1e-5"),
    "op: scale=0.0 taken as the default scale": (
        "common/contract.py", "    if scale is None:\n        scale = K ** -0.5", "    if not scale:\n        scale = K ** -0.5", ["tests/test_op.py"]),
    "op: max_seqlen of the first sequence": (
        "kdalab/op.py", "cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu(), T)\n",
        "cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu(), T)\n                max_seqlen = seq_lens[0]\n",
        ["tests/test_op.py"]),
    "op: the V-first state taken K-first": (
        "kdalab/op.py", "state_v_first=bool(state_v_first), output_final_state", "state_v_first=False, output_final_state", ["tests/test_op.py"]),
    "contract: max_seqlen one short": (
        "common/contract.py", "int(lengths.max()), tuple(lengths.tolist())", "int(lengths.max()) - 1, tuple(lengths.tolist())", ["tests/test_varlen.py", "-k", "not gpu"]),
    "stage 00: chunk size fixed at 64": (
        "stages/00_naive/stage.py", "B, T, H, K, V, BT = c.B, c.T, c.H, c.K, c.V, c.chunk_size",
        "B, T, H, K, V, BT = c.B, c.T, c.H, c.K, c.V, 64"),
    "stage 00: o off by 2x the tolerance (1 + 2e-5)": (
        "stages/00_naive/stage.py", "return o.to(c.out_dtype), (S if c.output_final_state else None)",
        "return (o * (1 + 2e-5)).to(c.out_dtype), (S if c.output_final_state else None)"),
    "stage 00: lower_bound ignored": (
        "stages/00_naive/stage.py", "a = c.lower_bound * torch.sigmoid(A * x)", "a = -5.0 * torch.sigmoid(A * x)"),
    "stage 01 (C++): every sequence from batch 0's h0": (
        "stages/01_cpp/binding.cpp", "in.h0 = h0 ? h0->data_ptr<float>() + bh * K * V : nullptr;",
        "in.h0 = h0 ? h0->data_ptr<float>() + h * K * V : nullptr;"),
    "stage 01 (C++): dh0 written only for the first sequence": (
        "stages/01_cpp/binding.cpp", "gr.dh0 = dh0 ? dh0->data_ptr<float>() + bh * K * V : nullptr;",
        "gr.dh0 = dh0 && b == 0 ? dh0->data_ptr<float>() + bh * K * V : nullptr;"),
    "stage 01 (C++): final state ht left unwritten": (
        "stages/01_cpp/binding.cpp", "float* S = ht.data_ptr<float>() + bh * p.K * p.V;",
        "std::vector<float> S_own(p.K * p.V);\n    float* S = S_own.data();"),
    "prose: a figure that is not its record passes": (
        "common/prose.py", "        if why is not None:\n            bad.append(f\"{where}: {why}",
        "        if False:\n            bad.append(f\"{where}: {why}"),
    "prose: a one-digit figure skipped": (
        "common/prose.py", "        for i, (s, e, t, kind, unit) in enumerate(spans):\n            out.append(",
        "        for i, (s, e, t, kind, unit) in enumerate(spans):\n            if sig_digits(t) < 2:\n"
        "                continue\n            out.append("),
    "prose: a bound taken as a plain rounding": (
        "common/prose.py", "    ok = matches(f.text, v) if upper is None else bounds(f.text, v, upper)",
        "    ok = matches(f.text, v)"),
    "prose: a figure matched at one digit fewer": (
        "common/prose.py", 'return float(f"{value:.{n}g}") == float(f"{x:.{n}g}")',
        'return float(f"{value:.{max(1, n - 1)}g}") == float(f"{x:.{max(1, n - 1)}g}")'),
    "prose: an entry no figure uses passes": (
        "common/prose.py", "    bad += [f\"docs/figures.json: entry {k}", "    bad += [] and [f\"docs/figures.json: entry {k}"),
    "prose: lines naming the seed's H20 skipped": (
        "common/prose.py", "        spans = _spans(line)\n        if not spans:", "        spans = _spans(line)\n        if not spans or \"H20\" in line:"),
}

COMPILED = (".cpp", ".cu", ".cuh", ".h")  # a stage's sources that are built into an extension
BUILD_DIR = Path(os.environ.get("KDALAB_BUILD", ROOT / "build"))  # as common.paths.BUILD_DIR

FAST_TESTS = ["tests/test_metrics.py", "tests/test_negative_controls.py", "tests/test_contract.py",
              "tests/test_reference.py", "tests/test_tolerances.py", "tests/test_profile_regions.py",
              "tests/test_stages_cpu.py", "tests/test_common.py", "tests/test_notebooks.py", "tests/test_prose.py",
              "tests/test_op.py", "tests/test_varlen.py", "tests/test_tree_under_test.py",
              "-k", "not kdalab_check and not compile_error and not nbval"]


def run_one(name, tests, timeout) -> dict:
    """Plant one mutation, run the tests, restore the file. Caught only when
    tests failed (pytest exit 1, not a collection or usage error) and, for a
    compiled stage's source, when an extension was rebuilt meanwhile: ninja
    and torch's extension cache both see the edited file (its time and its
    hash), so the tests ran the mutated code, not a stale build."""
    rel, old, new = MUTATIONS[name][:3]
    path = ROOT / rel
    text = path.read_text()
    n = text.count(old)
    if n != 1:
        return dict(mutation=name, file=rel, caught=None, why=f"text found {n} times (must be once)")
    t0 = time.time()
    try:
        path.write_text(text.replace(old, new))
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                             capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    finally:
        path.write_text(text)
    failed = [line for line in out.stdout.splitlines() if line.startswith("FAILED")]
    row = dict(mutation=name, file=rel, caught=out.returncode == 1, seconds=round(time.time() - t0),
               by=failed[0][7:].split(" - ")[0] if failed else None)
    if out.returncode not in (0, 1):
        row.update(caught=None, why=f"pytest exited {out.returncode}: " + out.stdout.strip()[-300:])
    elif path.suffix in COMPILED:
        row["rebuilt"] = any(p.stat().st_mtime >= t0 for p in BUILD_DIR.glob("*/*.so"))
        if not row["rebuilt"]:
            row.update(caught=None, why="no extension was rebuilt: the tests ran a stale build, or it did not compile")
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="run the mutations whose name contains this text")
    p.add_argument("--tests", nargs="*", default=None, help="pytest arguments (default: the fast CPU tests)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "common", "stages"],
                           capture_output=True, text=True, cwd=ROOT).stdout.strip()
    if dirty:
        print("uncommitted changes under common/ or stages/: commit or stash them first (files are edited in place)")
        return 2
    names = [n for n in MUTATIONS if args.only is None or args.only in n]
    suites = {tuple(args.tests or (MUTATIONS[n][3] if len(MUTATIONS[n]) > 3 else FAST_TESTS)) for n in names}
    for tests in suites:  # a plant is caught only by tests that pass without it
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                             capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
        if out.returncode != 0:
            print(f"the tests fail with no plant ({' '.join(tests)}): fix them first\n{out.stdout[-2000:]}")
            return 2
    rows = []
    for name in names:
        own = MUTATIONS[name][3] if len(MUTATIONS[name]) > 3 else None
        r = run_one(name, args.tests or own or FAST_TESTS, args.timeout)
        rows.append(r)
        verdict = {True: "caught", False: "MISSED", None: "NOT APPLIED"}[r["caught"]]
        print(f"{verdict:11s} {name}" + (f"  (by {r['by']})" if r.get("by") else "")
              + (f"  ({r['why']})" if r.get("why") else ""), flush=True)
    missed = [r for r in rows if r["caught"] is not True]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} planted bugs caught")
    if args.out:
        sys.path.insert(0, str(ROOT))
        from common.results import metadata

        meta = metadata(command="python scripts/plant_bugs.py " + " ".join(sys.argv[1:]), device="cpu")
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
