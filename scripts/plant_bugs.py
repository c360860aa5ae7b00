"""Plant bugs in the checking code, one at a time, and see whether the tests
catch each (mutation testing of the checks; CPU only).

    python scripts/plant_bugs.py                 # every mutation, the fast CPU tests
    python scripts/plant_bugs.py --only ok-forced --tests tests/test_metrics.py

Each mutation replaces one exact piece of source text (it must occur exactly
once), runs the tests, and restores the file, also when interrupted. A
mutation is "caught" when the tests fail. Writes a JSON report when --out is
given. Run it from a clean working tree: it edits files in place (so that the
compiled stages' builds are reused) and restores them afterwards.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (file, text, replacement): the planted bugs of issue 10 and a few more.
MUTATIONS = {
    "checks: verdict forced to ok": (
        "common/checks.py", "ok = r <= tol and (p is None or p <= tol)", "ok = True"),
    "checks: error function returns 0": (
        "common/checks.py", '    r = rel_err(x, ref)\n    if scale is None or r == math.inf:\n        return r',
        "    return 0.0"),
    "checks: error function returns 0 for finite errors (keeps NaN)": (
        "common/checks.py", '    r = rel_err(x, ref)\n    if scale is None or r == math.inf:\n        return r',
        "    r = rel_err(x, ref)\n    return r if r == math.inf else 0.0"),
    "checks: no comparison with the previous stage": (
        "common/checks.py", "pid = previous(spec.id) if against_prev else None", "pid = None"),
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
}

FAST_TESTS = ["tests/test_metrics.py", "tests/test_negative_controls.py", "tests/test_contract.py",
              "tests/test_profile_regions.py", "tests/test_stages_cpu.py", "tests/test_common.py",
              "tests/test_notebooks.py", "-k", "not kdalab_check and not compile_error and not nbval"]


def run_one(name, tests, timeout) -> dict:
    rel, old, new = MUTATIONS[name]
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
    return dict(mutation=name, file=rel, caught=out.returncode != 0, seconds=round(time.time() - t0),
                by=failed[0][7:].split(" - ")[0] if failed else None)


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
    rows = []
    for name in names:
        r = run_one(name, args.tests or FAST_TESTS, args.timeout)
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
