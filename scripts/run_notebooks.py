"""Execute the notebooks as a reader would, top to bottom in a fresh kernel
each, in the ladder's order; time each one; check that every cell that draws
shows its figure; optionally write the executed notebooks back (the committed
notebooks carry their outputs).

    python scripts/run_notebooks.py                       # all, report only
    python scripts/run_notebooks.py --write               # and save the outputs into notebooks/
    python scripts/run_notebooks.py 02_cuda_baseline --out times.json

Exit code 1 if a notebook fails, misses a figure, or runs past --limit seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    import nbformat

    from common.nbcheck import errors, execute, missing_figures
    from common.results import metadata

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="notebook names (default: all, in order)")
    p.add_argument("--write", action="store_true", help="write the executed notebooks back into notebooks/")
    p.add_argument("--limit", type=float, default=None, help="seconds a notebook may take (fail above)")
    p.add_argument("--timeout", type=int, default=900, help="seconds a cell may take")
    p.add_argument("--out", default=None, help="write the timings as JSON here")
    args = p.parse_args()
    paths = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.names:
        paths = [q for q in paths if any(q.stem == n or q.stem.startswith(n) for n in args.names)]
    rows, bad = [], 0
    for path in paths:
        print(f"[notebooks] {path.name} ...", flush=True)
        t0 = time.time()
        try:
            nb, secs = execute(path, timeout=args.timeout, cwd=ROOT / "notebooks")
            problems = errors(nb) + missing_figures(nb)
        except Exception as e:  # a cell raised: nbclient stops there
            nb, secs, problems = None, time.time() - t0, [f"{type(e).__name__}: {str(e).splitlines()[-1][:300]}"]
        over = args.limit is not None and secs > args.limit
        ok = not problems and not over
        bad += not ok
        rows.append(dict(notebook=path.name, seconds=round(secs, 1), ok=ok, problems=problems,
                         over_limit=over))
        print(f"[notebooks] {path.name}: {secs:.0f} s, {'ok' if ok else 'FAILED'}"
              + "".join(f"\n    {x}" for x in problems) + (f"\n    over the {args.limit:.0f} s limit" if over else ""),
              flush=True)
        if args.write and nb is not None and not problems:
            import uuid

            for cell in nb.cells:  # keep the diff small: no per-run timing metadata; every cell has an id
                cell.get("metadata", {}).pop("execution", None)
                cell.setdefault("id", uuid.uuid4().hex[:8])
            nbformat.write(nb, path)
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": metadata(command="python scripts/run_notebooks.py "
                                                                   + " ".join(sys.argv[1:])),
                                                  "rows": rows}, indent=1) + "\n")
    print(f"[notebooks] {len(rows) - bad} of {len(rows)} ok, {sum(r['seconds'] for r in rows):.0f} s in all")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
